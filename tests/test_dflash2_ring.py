"""The dflash2 drafter reading and writing its context rings in place (ignis.kernels.drafter_triton) against the
torch path it replaces on CUDA: `ContextCache.gather` + `block_mask` + `DrafterModel.block` for the block rows, and
`DrafterModel.context_kv` + `ContextCache.write_rows` for committed rows.

Without a GPU the kernels run in Triton's interpreter on CPU tensors in fp32, with the backend's `ring` switch turned
on by hand: the rows and rings must be the torch path's up to the order of a norm's sum of squares. The GPU run (bf16,
the 27B drafter's shape) is in tests/test_dflash2_ring_gpu.py; graph rounds and greedy equality in tests/test_engine_gpu.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ignis.backends.base import Choice, Committed, Observation
from ignis.backends.dflash2.backend import DFlash2
from ignis.backends.dflash2.weights import save_random_drafter
from ignis.config import load_config
from ignis.backends.base import BackendContext
from ignis.model.loader import load_model
from tiny import tiny_checkpoint

from tests.sm90 import run_child

if torch.cuda.is_available():
    pytest.skip("the interpreter takes CPU tensors: tests/test_kernels_gpu.py runs these", allow_module_level=True)

pytestmark = pytest.mark.usefixtures("interpreted_loop_bounds")

CPU = torch.device("cpu")
LANES = 3
WINDOW = 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), seed=4, mtp=False, vocab_size=256)


def backend(ckpt: Path, drafter: Path) -> DFlash2:
    overrides = {"model.path": str(ckpt), "spec.backend": "dflash2", "spec.draft_tokens": 7,
                 "spec.drafter": str(drafter), "engine.lanes": LANES}
    config = load_config(profile="cpu", overrides=overrides)
    model = load_model(ckpt, device=CPU, dtype=torch.float32, exact=False)
    be = DFlash2(BackendContext(model, config, ckpt, LANES, 256, CPU, torch.float32))
    assert not be.ring  # the switch is CUDA's: here the test turns it on
    return be


def drafter(tmp: Path, ckpt: Path, is_causal: bool | None) -> Path:
    from ignis.model.config import ModelConfig

    return save_random_drafter(tmp, ModelConfig.from_dir(ckpt), seed=1, sliding_window=WINDOW, is_causal=is_causal,
                               layer_types=["sliding_attention", "full_attention"])


def fill(be: DFlash2, seed: int) -> None:
    """Lane 2 beyond the sliding window, lane 0 short, lane 1 reset after a finished request."""
    g = torch.Generator().manual_seed(seed)
    width = len(be.tap_layers) * be.target.config.hidden_size

    def obs(lane: int, start: int, n: int) -> Observation:
        return Observation(lane=lane, start=start, tokens=torch.zeros(n, dtype=torch.long), following=0,
                           hidden=torch.zeros(n, 1), taps=torch.randn(n, width, generator=g))

    be.observe([obs(1, 0, 20)])
    be.reset(1)
    be.observe([obs(2, 0, 30), obs(0, 0, 5), obs(1, 0, 3)])
    be.observe([obs(2, 30, 7)])


# Each span (a short last tile, whole tiles) and each causal setting once: every pair ran the Triton interpreter for
# about 10 s on the CPU, and the two are independent switches of the kernel.
@pytest.mark.parametrize("span,is_causal", [(37, False), (64, None)])
def test_block_rows_from_the_rings_equal_the_gathered_torch_path(ckpt: Path, tmp_path: Path, is_causal: bool | None,
                                                                  span: int) -> None:
    be = backend(ckpt, drafter(tmp_path / "d", ckpt, is_causal))
    assert be.cfg.causal == ((True, False) if is_causal is None else (False, False))
    with torch.inference_mode():
        fill(be, seed=3)
        lanes, anchors, positions = torch.tensor([2, 0, 1]), torch.tensor([5, 6, 7]), torch.tensor([37, 5, 3])
        want = be.hidden(lanes, anchors, positions, 7, span)
        be.ring = True
        got = be.hidden(lanes, anchors, positions, 7, span)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # The same drafts come out of the selector.
        choice = Choice(torch.zeros(3), None)
        assert torch.equal(be.propose_lanes(lanes, anchors, positions, 7, choice, span).tokens,
                           be.propose_lanes(lanes, anchors, positions, 7, choice, span).tokens)
        be.ring = False
        reference = be.propose_lanes(lanes, anchors, positions, 7, choice, span).tokens
        be.ring = True
        assert torch.equal(be.propose_lanes(lanes, anchors, positions, 7, choice, span).tokens, reference)


def test_a_block_sees_neither_unset_slots_nor_its_own_future_context(ckpt: Path, tmp_path: Path) -> None:
    """A lane whose ring holds rows at or past the block's anchor (a rejected future the round has not overwritten)
    and slots never set: the ring kernel must mask them as the torch path does."""
    be = backend(ckpt, drafter(tmp_path / "d", ckpt, False))
    with torch.inference_mode():
        fill(be, seed=5)
        lanes, anchors = torch.tensor([2]), torch.tensor([9])
        for anchor_at in (33, 36):  # rows 33..36 of lane 2 exist: the block at 33 must not see them
            positions = torch.tensor([anchor_at])
            be.ring = False
            want = be.hidden(lanes, anchors, positions, 7, 64)
            be.ring = True
            got = be.hidden(lanes, anchors, positions, 7, 64)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_committed_rows_written_by_the_kernel_equal_write_rows(ckpt: Path, tmp_path: Path) -> None:
    be = backend(ckpt, drafter(tmp_path / "d", ckpt, False))
    g = torch.Generator().manual_seed(9)
    width = len(be.tap_layers) * be.target.config.hidden_size
    cols = 8
    start = torch.tensor([12, 3, 0])  # lane 2's rows wrap the sliding layer's 15-slot ring
    rows = Committed(
        lanes=torch.tensor([2, 1, LANES]),  # the third row is padding: the scratch lane
        positions=start[:, None] + torch.arange(cols),
        tokens=torch.zeros(3, cols, dtype=torch.long),
        following=torch.zeros(3, cols, dtype=torch.long),
        hidden=torch.zeros(3, cols, 1),
        taps=torch.randn(3, cols, width, generator=g),
        accepted=torch.tensor([4, 7, 0]),
    )
    with torch.inference_mode():
        fill(be, seed=7)
        before = [tuple(t.clone() for t in ring) for ring in be.cache.rings()]
        be.observe_lanes(rows, 64)
        want = [tuple(t.clone() for t in ring) for ring in be.cache.rings()]
        for ring, saved in zip(be.cache.rings(), before):
            for t, s in zip(ring, saved):
                t.copy_(s)
        be.ring = True
        be.observe_lanes(rows, 64)
        for layer, (got, expected) in enumerate(zip(be.cache.rings(), want)):
            k, v, pos = (t[:LANES] for t in got)  # the scratch lane's rows are garbage by design
            k_want, v_want, pos_want = (t[:LANES] for t in expected)
            assert torch.equal(pos, pos_want), layer
            torch.testing.assert_close(k, k_want, rtol=1e-5, atol=1e-5)  # the hidden norm's sum order differs
            torch.testing.assert_close(v, v_want, rtol=1e-5, atol=1e-5)
            assert not torch.equal(pos, before[layer][2][:LANES])  # something was written


COMPILE = r"""
from ignis.kernels.drafter_triton import KEYS, _ring_partial, _ring_write, warps
from tests.sm90 import build, spills

bf = "*bf16"
partial = {"qkv": bf, "qw": bf, "kw": bf, "cos": bf, "sin": bf, "kc": bf, "vc": bf, "kpos": "*i64", "lanes": "*i64",
           "qpos": "*i64", "opart": "*fp32", "mpart": "*fp32", "lpart": "*fp32", "eps": "fp32", "qk_scale": "fp32"}
write = {"kv": bf, "kw": bf, "cos": bf, "sin": bf, "lane_ix": "*i64", "positions": "*i64", "kc": bf, "vc": bf,
         "kpos": "*i64", "eps": "fp32"}
# the 27B drafter (32 heads, 8 KV heads, full and partial rotary) and the built-in one (6 and 2 heads of 64)
for nh, nkv, hd, rot in ((32, 8, 128, 128), (32, 8, 128, 32), (6, 2, 64, 64)):
    rows = nh // nkv * 8
    for causal in (False, True):
        block_m = max(16, 1 << (rows - 1).bit_length())
        consts = {"NH": nh, "NKV": nkv, "B": 8, "HD": hd, "ROT": rot, "CAUSAL": causal, "BLOCK_M": block_m,
                  "BLOCK_B": 16, "BLOCK_N": KEYS, "PRECISION": "tf32"}
        kernel = build(_ring_partial, partial, consts, (), warps(block_m, hd), 2)
        assert ".target sm_90a" in kernel.asm["ptx"] and spills(kernel) == 0, (nh, hd, rot, causal)
        print("ok partial", nh, rot, causal)
    kernel = build(_ring_write, write, {"NKV": nkv, "HD": hd, "ROT": rot}, (), 1, 1)
    assert spills(kernel) == 0, (nh, hd, rot)
    print("ok write", nh, rot)
"""


def test_kernels_compile_for_sm90_without_spills() -> None:
    assert run_child(COMPILE).count("ok") == 9
