"""The 4-bit GEMV kernel (ignis.kernels.int4_gemv) against its torch reference, and the reference against the format.

The kernel source runs in numba's CUDA simulator in a child interpreter (NUMBA_ENABLE_CUDASIM must be set before
numba.cuda is imported, and the rest of the suite keeps the real numba.cuda) on tiny shapes: several row counts (one
row tile and several, rows past a tile's end), both group sizes, output counts that are not a multiple of a block's,
the input dimension split over blocks (the last-block sum and the counter reset) and not, and each activation and
scale dtype. The GPU run at the 27B shapes is in tests/test_quant_gpu.py.
"""

from __future__ import annotations

import pytest
import simulator
import torch

from ignis.kernels.int4_gemv import Tuning, int4_gemv_reference, plan, row_tile, workspace_len
from ignis.quant.format import dequantize, quantize


def _weight(nout: int, ncols: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(nout, ncols, generator=g) * 0.05, group)


def test_reference_is_the_fp32_product_with_the_dequantized_weight() -> None:
    qw, s, z = _weight(24, 256, 64, seed=0)
    x = torch.randn(5, 256, dtype=torch.float64)
    exact = x @ dequantize(qw, s, z, torch.float64).T
    torch.testing.assert_close(int4_gemv_reference(x.float(), qw, s, z).double(), exact, rtol=1e-5, atol=1e-5)
    assert int4_gemv_reference(x.bfloat16(), qw, s, z).dtype == torch.bfloat16


@pytest.mark.parametrize("tuning", [Tuning(), Tuning(2, 4, 8), Tuning(8, 2, 4), Tuning(4, 8, 16)])
def test_plan_fills_the_device_and_bounds_the_workspace(tuning: Tuning) -> None:
    sms = 132
    for nout, ncols in ((34816, 5120), (5120, 17408), (5120, 6144), (16384, 5120), (14336, 5120), (48, 5120),
                        (248320, 5120), (19, 128)):
        p = plan(nout, ncols, sms, tuning)
        kwords = ncols // 16
        assert p.splits >= 1 and (p.splits - 1) * p.split_words < kwords <= p.splits * p.split_words
        tiles = -(-nout // tuning.bo)
        assert p.splits == 1 or (tiles < tuning.blocks_per_sm * sms and p.split_words >= 128)
        assert p.splits == 1 or p.splits * 64 * nout <= workspace_len(sms, tuning)
    if tuning == Tuning():
        assert plan(5120, 17408, sms).splits > 1  # 320 output tiles alone would leave most of the device idle
    assert [row_tile(r) for r in (1, 2, 3, 4, 5, 8, 9, 64)] == [1, 2, 4, 4, 8, 8, 8, 8]


# (rows, nout, ncols, group, split_words, x dtype, scale dtype, output rows a warp, warps): split_words < ncols / 16
# splits the input dimension; 8 output rows a warp with 8-row tiles hold 64 sums, two a lane in the reduction.
CASES = [
    (1, 19, 128, 64, 8, "float32", "float16", 4, 4),
    (2, 16, 256, 128, 16, "float32", "float32", 4, 4),
    (3, 37, 256, 64, 8, "float32", "float16", 2, 2),
    (8, 20, 128, 128, 8, "bfloat16", "bfloat16", 4, 4),
    (11, 17, 256, 64, 6, "bfloat16", "bfloat16", 4, 4),
    (5, 33, 128, 64, 4, "float16", "float16", 4, 4),
    (9, 21, 128, 64, 4, "bfloat16", "float16", 8, 1),
]

CHILD = r"""
import sys
import numpy as np, torch
from numba import cuda
from ignis.kernels.int4_gemv import int4_gemv_reference, row_tile
from ignis.kernels.int4_gemv_kernel import make_kernel
from tests.test_kernels_int4 import CASES, _weight

assert type(cuda.jit(lambda: None)).__name__ == "FakeCUDAKernel"  # the simulator, not a driver
KIND = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
BITS = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.int16}


def flat(t):
    return t.contiguous().view(BITS[str(t.dtype).removeprefix("torch.")]).reshape(-1).numpy().copy()


part, parts = int(sys.argv[1]), int(sys.argv[2])  # every parts-th case from the part-th (tests/simulator.py)
for i, (rows, nout, ncols, group, split_words, xd, sd, ot, warps) in enumerate(CASES):
    if i % parts != part:
        continue
    qw, s, z = _weight(nout, ncols, group, seed=10 + i)
    s = s.to(getattr(torch, sd))
    x = torch.randn(rows, ncols, generator=torch.Generator().manual_seed(i)).to(getattr(torch, xd))
    xa = x.contiguous().view(torch.int64).reshape(-1).numpy().copy() if xd == "bfloat16" else flat(x)
    kwords = ncols // 16
    splits = -(-kwords // split_words)
    rt = row_tile(rows)
    out = np.zeros(rows * nout, flat(x).dtype)
    ws = np.full(splits * rows * nout, np.nan, np.float32)
    grid = (-(-rows // rt), -(-nout // (ot * warps)), splits)
    counters = np.zeros(grid[0] * grid[1], np.int32)
    kern = cuda.jit(make_kernel(KIND[xd], KIND[sd], rt, ot, warps))
    for rep in range(2):  # the second launch starts from the counters the first left
        out[:] = 0
        kern[grid, 32 * warps](qw.view(torch.int64).reshape(-1).numpy().copy(), flat(s), z.reshape(-1).numpy().copy(),
                            xa, out, ws, counters, rows, nout, ncols, group, split_words, splits)
        got = torch.from_numpy(out).view(x.dtype).reshape(rows, nout)
        ref = int4_gemv_reference(x.float(), qw, s, z)  # the fp32 sums before the one rounding to x.dtype
        if xd == "float32":
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        else:  # rounded to nearest: within half a unit of the last place of the fp32 sum (fp32 order aside)
            _, e = torch.frexp(ref)
            half_ulp = torch.ldexp(torch.ones_like(ref), e - (9 if xd == "bfloat16" else 12))
            err = (got.float() - ref).abs()
            assert bool((err <= half_ulp + 1e-5 * ref.abs() + 1e-7).all()), (err / half_ulp).max()
        assert not counters.any(), counters
    print("case", i, "ok", flush=True)
print("ok")
"""


@pytest.mark.timeout(900)
def test_kernel_equals_the_reference_in_the_simulator() -> None:
    results = simulator.run_parts(CHILD, [["0", "2"], ["1", "2"]], timeout=900)
    failed = simulator.failures(results)
    assert not failed, failed
    assert sum(r.stdout.count(" ok") for r in results) == len(CASES)  # every case, once
