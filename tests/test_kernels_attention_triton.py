"""The Triton paged attention (ignis.kernels.attention_triton) against `attend_reference`, and `attend`'s choice of
path.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET) on CPU tensors, in
fp32 (the interpreter mishandles bf16 loads), compared within 1e-5. The K/V live in shuffled pages of several sizes
(so a key tile may sit in one page or straddle several), the null page and the pages no lane holds are large
garbage (a read of one shows), one lane holds only the pages its positions need, and the splits are forced small
(so the merge of several splits and a split of several tiles both run). The kernels also compile for sm_90 here,
in a child interpreter without TRITON_INTERPRET: tensor-core products, shared memory within an H200 SM's, and no
register spills in bf16. The GPU run at the 27B shape is in tests/test_kernels_gpu.py.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
from ignis.kernels import attention
from ignis.kernels.attention import attend, attend_reference, route, splits, use, visibility
from ignis.kernels.attention_triton import Tiles

from tests.sm90 import run_child
from tests.test_kernels_fused import paged

if torch.cuda.is_available():
    pytest.skip("the interpreter takes CPU tensors: tests/test_kernels_gpu.py runs these", allow_module_level=True)

pytestmark = pytest.mark.usefixtures("interpreted_loop_bounds")

NKV, GROUP, HD, LANES, SLOTS = 2, 6, 16, 5, 100  # 12 query heads, 2 of them KV heads; a 100-slot span


@pytest.fixture(autouse=True)
def auto_path() -> Iterator[None]:
    """Every test leaves `attend` on its automatic choice."""
    yield
    use("auto")


def inputs(page: int, positions: list[list[int]], seed: int) -> dict[str, object]:
    """3 of 5 lanes (out of order) as shuffled pages of `page` positions, lane 0 holding only its first pages;
    positions [B, C], queries q [B, NKV, GROUP * C, HD], a projection qkv to read the gates from."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.tensor(positions)
    b, c = pos.shape
    nh = NKV * GROUP
    k, v = torch.randn(LANES, SLOTS, NKV, HD, generator=g), torch.randn(LANES, SLOTS, NKV, HD, generator=g)
    lanes = torch.tensor([0, 4, 2][:b])
    held = int(pos[0].max()) // page + 1  # lane 0's pages past its positions stay on the null page
    (kc, vc), table = paged([k, v], page, g, {0: held})
    return {
        "q": torch.randn(b, NKV, GROUP * c, HD, generator=g), "kc": kc, "vc": vc, "table": table, "lanes": lanes,
        "positions": pos, "mask": visibility(pos, SLOTS, GROUP * c), "span": SLOTS, "scale": HD**-0.5,
        "qkv": torch.randn(b * c, (2 * nh + 2 * NKV) * HD, generator=g) * 2, "nh": nh,
    }


def check(x: dict, per_split: int | None = None, tile: Tiles | None = None) -> None:
    from ignis.kernels import attention_triton

    args = (x["q"], x["kc"], x["vc"], x["table"], x["lanes"])
    want = attend_reference(*args, x["mask"], x["scale"], x["qkv"], x["nh"])
    got = attention_triton.attend(*args, x["positions"], x["span"], x["scale"], x["qkv"], x["nh"],
                                  per_split=per_split, tile=tile)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# (page, positions [B, C], key slots a split (None: the plan's), tile (None: `tiles`, 16 keys in fp32))
CASES = [
    (16, [[40], [99], [7]], None, None),  # decode, 6 rows: one page a tile, a split a tile
    (16, [[40], [99], [7]], 48, None),  # three tiles a split
    (64, [[40], [99], [7]], 32, None),  # tiles inside the engine's pages
    (16, [[40], [99], [7]], 64, Tiles(64, 4, 2)),  # a tile of 64 keys across four pages of 16
    (6, [[40], [99], [7]], 32, Tiles(32, 4, 2)),  # pages of 6: tiles straddle pages anywhere
    (16, [[33 + i for i in range(8)], [91 + i for i in range(8)]], None, None),  # verify: 8 columns, 48 rows
    (64, [[33 + i for i in range(8)], [91 + i for i in range(8)]], 32, Tiles(32, 8, 2)),  # ends mid-page
    (16, [[20, 75, 3], [99, 0, 64], [50, 50, 49]], 32, None),  # 3 columns, 18 rows, positions in no order
    (16, [[20, 75, 3], [99, 0, 64], [50, 50, 49]], 128, Tiles(64, 4, 2)),  # one split: no merge
]


@pytest.mark.parametrize(("page", "positions", "per_split", "tile"), CASES)
def test_triton_attention_equals_the_reference(page: int, positions: list[list[int]], per_split: int | None,
                                               tile: Tiles | None) -> None:
    check(inputs(page, positions, seed=page + len(positions[0])), per_split, tile)


def test_attend_takes_the_chosen_path() -> None:
    x = inputs(16, [[33 + i for i in range(8)], [91 + i for i in range(8)]], seed=1)
    args = (x["q"], x["kc"], x["vc"], x["table"], x["lanes"], x["positions"], x["span"], x["scale"], x["qkv"], x["nh"])
    want = attend_reference(*args[:5], x["mask"], *args[7:])
    assert route(x["q"]) == "reference"  # auto, on the CPU
    assert torch.equal(attend(*args), want)
    use("triton")  # forced: the interpreter runs it on CPU tensors
    assert route(x["q"]) == "triton"
    torch.testing.assert_close(attend(*args), want, rtol=1e-5, atol=1e-5)
    use("numba")
    with pytest.raises(ValueError, match="CUDA"):
        attend(*args)
    with pytest.raises(ValueError, match="not one of"):
        use("sdpa")  # type: ignore[arg-type]
    assert attention.PATHS == ("auto", "numba", "triton", "reference")


def test_triton_attention_refuses_what_it_cannot_take() -> None:
    from ignis.kernels import attention_triton

    x = inputs(16, [[40], [99], [7]], seed=2)
    rest = (x["kc"], x["vc"], x["table"], x["lanes"], x["positions"], x["span"], x["scale"], x["qkv"], x["nh"])
    with pytest.raises(ValueError, match="rows a KV head"):
        attention_triton.attend(torch.zeros(3, NKV, 72, HD), *rest)  # 12 columns x 6 heads: two row blocks
    with pytest.raises(ValueError, match="power-of-two"):
        attention_triton.attend(torch.zeros(3, NKV, GROUP, 24), *rest)
    with pytest.raises(ValueError, match="multiple of the key tile"):
        attention_triton.attend(x["q"], *rest, per_split=40)


def test_splits_cover_the_span_in_whole_tiles() -> None:
    for span, lanes, kv, tile in ((100, 3, 2, 16), (262144, 1, 4, 32), (262144, 8, 4, 64), (1024, 8, 4, 32)):
        ns, per = splits(span, lanes, kv, tile)
        assert per % tile == 0 and ns * per >= span > (ns - 1) * per
        assert ns == -(-span // tile) or ns * lanes * kv >= 132


def test_importing_attention_does_not_import_triton() -> None:
    code = "import sys, ignis.kernels.attention; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_bench_attention_plans_its_cases() -> None:
    from tools.bench_attention import Case, cases, main, paths, table

    plan = cases([1, 8], [1, 8], [1024, 32768], 262144)
    assert len(plan) == 10 and plan[-2:] == [Case(1, 1, 262144), Case(1, 8, 262144)]  # the longest span: one lane
    assert Case(8, 8, 1024).rows == 48 and Case(8, 1, 1024).rows == 6
    assert Case(8, 1, 1024).floor_bytes == 8 * 1024 * 4 * 256 * 2 * 2  # K and V, bf16
    assert paths(Case(1, 1, 1024)) == ["numba", "triton", "reference"]
    assert paths(Case(1, 8, 1024)) == ["triton", "reference"]  # 48 rows: no numba
    row = {"lanes": 8, "columns": 8, "span": 1024, "path": "triton", "us": 12.34, "floor_us": 2.0, "x_floor": 6.17,
           "auto": "triton", "err": 0.003}
    assert table([row]).splitlines()[-1] == "| 8 | 8 | 1024 | triton | 12.3 | 2.0 | 6.17 | triton | 3.0e-03 |"
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0


COMPILE = r"""
from ignis.kernels.attention_triton import _combine, _partial, rows_block, tiles
from tests.sm90 import build, spills
import torch

ptr = {"table": "*i64", "lanes": "*i64", "positions": "*i64", "opart": "*fp32", "mpart": "*fp32", "lpart": "*fp32",
       "qk_scale": "fp32"}
strides = ("q_b", "q_h", "q_r", "k_p", "k_s", "k_h", "table_l")  # multiples of 16 at the 27B shape
for elt, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
    for rows, hd in ((6, 256), (48, 256), (64, 256), (48, 128), (1, 16)):
        t = tiles(rows, hd, dtype)
        kernel = build(_partial, ptr | {"q": "*" + elt, "kc": "*" + elt, "vc": "*" + elt},
                       {"HD": hd, "BLOCK_M": rows_block(rows), "BLOCK_N": t.keys,
                        "PRECISION": "ieee" if elt == "fp32" else "tf32"}, strides, t.warps, t.stages)
        ptx = kernel.asm["ptx"]
        assert ".target sm_90a" in ptx
        assert kernel.metadata.shared <= 232448, (elt, rows, hd, kernel.metadata.shared)  # 227 KiB an H200 block
        if elt == "bf16":
            assert ("wgmma" if rows_block(rows) >= 64 else "mma.sync") in ptx, (rows, hd)  # tensor cores
            assert spills(kernel) == 0, (rows, hd)
    combine = build(_combine, {"opart": "*fp32", "mpart": "*fp32", "lpart": "*fp32", "qkv": "*" + elt, "y": "*" + elt},
                    {"HD": 256, "BLOCK_S": 16}, (), 4, 1)
    assert spills(combine) == 0
    print("ok", elt)
"""


def test_kernels_compile_for_sm90_on_tensor_cores() -> None:
    assert run_child(COMPILE).count("ok") == 2
