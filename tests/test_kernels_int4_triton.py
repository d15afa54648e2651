"""The Triton 4-bit GEMV/GEMM (ignis.kernels.int4_triton) against its torch reference, in Triton's interpreter.

fp32 activations (the interpreter mishandles bf16 loads), tiny shapes: rows 1 to 17 (one row tile, a row tile's end,
two row tiles), both group sizes, output counts that are not a multiple of BLOCK_N, the input dimension split over
programs (the partials, the last split's ordered sum and the counter reset) and not; a row's result alone and in a
batch; the table's order-fixing choices depend on the weight's shape only. The GPU path dequantizes in PTX, which
the interpreter cannot run: its text is interpreted here instruction by instruction over every byte and zero point.
The GPU run at the 27B shapes is in tests/test_quant_gpu.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ignis.kernels.int4_gemv import int4_gemv_reference
from ignis.kernels.int4_triton import _ASM, Config, check, choose, int4_triton
from ignis.kernels.launch import SPLIT_COUNTERS
from ignis.quant.format import dequantize, quantize

pytestmark = pytest.mark.usefixtures("interpreted_dot_by_rows")  # a row's bits alone and in a batch: tests/conftest.py


def _weight(nout: int, ncols: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(nout, ncols, generator=g) * 0.05, group)


def _close(got: torch.Tensor, x: torch.Tensor, qw: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> None:
    """Equal to the fp32 reference up to the order of fp32 additions: within 2^-20 of the terms' magnitudes."""
    ref = int4_gemv_reference(x, qw, s, z)
    mag = torch.nn.functional.linear(x.abs(), dequantize(qw, s, z, torch.float32).abs())
    assert got.shape == ref.shape and got.dtype == x.dtype
    err = (got - ref).abs()
    assert bool((err <= 2.0**-20 * mag + 1e-30).all()), float((err / (mag + 1e-30)).max())


# (rows, out, in, group, config or None for the table): block_k 64 within group 128, splits of 2 and 4 steps,
# two row tiles (17 rows at block_m 16), output counts past a block's end, the table's 16- and 32-row tiles
CASES = [
    (1, 37, 256, 64, Config(16, 16, 64, 1, 4, 2)),
    (3, 19, 512, 128, Config(16, 32, 64, 4, 4, 2)),
    (8, 45, 256, 128, Config(16, 16, 128, 2, 4, 2)),
    (16, 33, 512, 64, Config(16, 32, 64, 2, 4, 3)),
    (17, 40, 256, 64, Config(16, 16, 64, 4, 4, 2)),
    (17, 21, 256, 128, Config(32, 16, 128, 1, 4, 2)),
    (5, 24, 384, 128, None),
    (33, 20, 256, 64, None),
]


@pytest.mark.parametrize(("rows", "nout", "ncols", "group", "config"), CASES)
def test_kernel_equals_the_reference(rows: int, nout: int, ncols: int, group: int, config: Config | None) -> None:
    qw, s, z = _weight(nout, ncols, group, seed=rows + nout)
    x = torch.randn(rows, ncols, generator=torch.Generator().manual_seed(rows))
    _close(int4_triton(x, qw, s, z, config), x, qw, s, z)


@pytest.mark.parametrize(("rows", "nout", "ncols", "group", "config"), CASES)
def test_the_k_blocked_layout_gives_the_same_bits(rows: int, nout: int, ncols: int, group: int,
                                                  config: Config | None) -> None:
    """The same codes k-blocked (a step's rows contiguous) run the same sums in the same order: equal bits."""
    from ignis.kernels.int4_triton import choose, k_blocked

    qw, s, z = _weight(nout, ncols, group, seed=rows + nout)
    x = torch.randn(rows, ncols, generator=torch.Generator().manual_seed(rows))
    cfg = config or choose(rows, nout, ncols, group, 132)
    blocked = k_blocked(qw, cfg.block_k)
    assert blocked.shape == (ncols // cfg.block_k, nout, cfg.block_k // 2)
    assert torch.equal(blocked[1, 3], qw[3, cfg.block_k // 2 : cfg.block_k])
    assert torch.equal(int4_triton(x, blocked, s, z, config), int4_triton(x, qw, s, z, config))
    with pytest.raises(ValueError, match="k-blocked"):
        int4_triton(x, k_blocked(qw, cfg.block_k // 2), s, z, cfg)


def test_scale_dtypes_and_leading_dims() -> None:
    qw, s, z = _weight(20, 256, 64, seed=1)
    x = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(1))
    for scales in (s, s.bfloat16(), s.float()):
        got = int4_triton(x, qw, scales, z, Config(16, 16, 64, 2, 4, 2))
        assert got.shape == (2, 3, 20)
        _close(got.reshape(6, 20), x.reshape(6, 256), qw, scales, z)


def test_repeated_split_calls_reset_the_counters() -> None:
    from ignis.kernels.launch import _counters

    qw, s, z = _weight(37, 512, 128, seed=2)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(2))
    cfg = Config(16, 16, 64, 4, 4, 2)
    first = int4_triton(x, qw, s, z, cfg)
    assert torch.equal(int4_triton(x, qw, s, z, cfg), first)
    assert all(not bool(c.any()) for c in _counters.values())


def test_a_rows_result_does_not_depend_on_the_batch() -> None:
    # The table's choice (block_m 16 alone, 32 for the batch) and an explicit split: the rows' sums keep their order.
    qw, s, z = _weight(24, 512, 64, seed=3)
    x = torch.randn(17, 512, generator=torch.Generator().manual_seed(3))
    for cfg in (None, Config(16, 16, 64, 4, 4, 2)):
        alone = torch.cat([int4_triton(x[i : i + 1], qw, s, z, cfg) for i in range(17)])
        for rows in (2, 17):
            assert torch.equal(int4_triton(x[:rows], qw, s, z, cfg), alone[:rows])


def test_the_table_fixes_the_order_of_the_sums_by_shape() -> None:
    shapes = [(34816, 5120), (5120, 17408), (16384, 5120), (5120, 6144), (14336, 5120), (19, 128)]
    for nout, ncols in shapes:
        for group in (64, 128):
            configs = [choose(rows, nout, ncols, group, 132) for rows in range(1, 65)]
            assert len({(c.block_k, c.split_k) for c in configs}) == 1
            for c in configs:
                check(c, ncols, group)
                assert c.split_k == 1 or 2 * -(-nout // c.block_n) <= SPLIT_COUNTERS  # row tiles x output tiles
    assert choose(1, 5120, 17408, 128, 132).split_k > 1  # 40 output tiles alone would leave most SMs idle
    assert choose(1, 34816, 5120, 128, 132).split_k == 1
    # no 64-row tile: its wgmma rounds unlike the mma.sync of 16 and 32 rows, and rows must not depend on the batch
    assert [choose(r, 34816, 5120, 128, 132).block_m for r in (1, 16, 17, 32, 33, 64)] == [16, 16, 32, 32, 32, 32]


def test_bad_configs_and_inputs_are_refused() -> None:
    qw, s, z = _weight(16, 256, 64, seed=4)
    x = torch.randn(2, 256)
    for cfg in (Config(16, 16, 128, 1, 4, 2),  # a step across two groups
                Config(8, 16, 64, 1, 4, 2),  # tl.dot needs 16 rows
                Config(16, 16, 64, 3, 4, 2),  # 3 splits of 4 steps
                Config(16, 24, 64, 1, 4, 2)):  # not a power of two
        with pytest.raises(ValueError):
            int4_triton(x, qw, s, z, cfg)
    with pytest.raises(ValueError):
        int4_triton(torch.randn(2, 128), qw, s, z)
    with pytest.raises(ValueError):
        int4_triton(x.to(torch.int32), qw, s, z)


def test_packed_linear_kernel_choice() -> None:
    # On the CPU every choice is the reference; an unknown name is refused (the GPU test runs "triton" through it).
    from ignis.quant.linear import PackedWeight, packed_linear, set_kernel

    qw, s, z = _weight(16, 256, 64, seed=5)
    x = torch.randn(3, 256)
    want = torch.nn.functional.linear(x, dequantize(qw, s, z, torch.float32))
    try:
        for kernel in ("triton", "numba", "reference", "auto"):
            set_kernel(kernel)  # type: ignore[arg-type]
            torch.testing.assert_close(packed_linear(x, PackedWeight(qw, s.float(), z)), want)
        with pytest.raises(ValueError):
            set_kernel("cutlass")  # type: ignore[arg-type]
    finally:
        set_kernel("auto")


def test_importing_the_package_does_not_import_triton() -> None:
    code = "import sys, ignis.kernels, ignis.quant.linear; assert 'triton' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, check=False).returncode == 0


def _run_ptx(asm: str, regs: dict[str, int], half: torch.dtype) -> dict[str, int]:
    """Interprets the few PTX instructions the dequantization uses (PTX ISA semantics of prmt's default mode, lop3's
    truth table, logical shr, fma.rn on 16-bit float pairs) over 32-bit register values."""
    def val(tok: str) -> int:
        return regs[tok] if tok in regs else int(tok, 0)

    def halves(v: int) -> torch.Tensor:
        return torch.tensor([v & 0xFFFF, v >> 16], dtype=torch.int32).to(torch.int16).view(half).double()

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}.":
            continue
        op, args = line.split(None, 1)
        d, *src = [a.strip() for a in args.split(",")]
        if op == "mov.b32":
            regs[d] = val(src[0])
        elif op == "prmt.b32":
            a, b, sel = val(src[0]), val(src[1]), val(src[2])
            pool = (a | b << 32).to_bytes(8, "little")
            out = 0
            for i in range(4):
                n = sel >> 4 * i & 0xF
                byte = pool[n & 7]
                out |= (0xFF if n & 8 and byte & 0x80 else 0 if n & 8 else byte) << 8 * i
            regs[d] = out
        elif op == "shr.b32":
            regs[d] = val(src[0]) >> val(src[1])
        elif op == "lop3.b32":
            a, b, c, lut = (val(t) for t in src)
            regs[d] = sum(((lut >> ((a >> i & 1) << 2 | (b >> i & 1) << 1 | (c >> i & 1))) & 1) << i for i in range(32))
        elif op.startswith("fma.rn."):
            r = (halves(val(src[0])) * halves(val(src[1])) + halves(val(src[2]))).to(half).view(torch.int16)
            lo, hi = (int(v) & 0xFFFF for v in r)
            regs[d] = lo | hi << 16
        else:
            raise AssertionError(f"unexpected PTX {line!r}")
    return regs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ptx_dequantization_gives_q_minus_z_for_every_byte(dtype: torch.dtype) -> None:
    asm, magic = _ASM[dtype]

    def pair(v: float) -> int:
        bits = int(torch.tensor([v], dtype=dtype).view(torch.int16)) & 0xFFFF
        return bits | bits << 16

    def decode(v: int) -> list[float]:
        return torch.tensor([v & 0xFFFF, v >> 16], dtype=torch.int32).to(torch.int16).view(dtype).tolist()

    for z in range(16):
        for word in range(64):  # bytes 4 * word .. 4 * word + 3: every byte value once
            data = list(range(4 * word, 4 * word + 4))
            regs = _run_ptx(asm, {"$4": int.from_bytes(bytes(data), "little"), "$5": pair(-(magic + z)),
                                  "$6": pair(-(magic + z))}, dtype)
            lo = decode(regs["$0"]) + decode(regs["$1"])
            hi = decode(regs["$2"]) + decode(regs["$3"])
            assert lo == [(b & 15) - z for b in data] and hi == [(b >> 4) - z for b in data], (z, data, lo, hi)
