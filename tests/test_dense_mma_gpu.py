"""The 16-bit weight-streaming product (ignis.kernels.dense_mma) on a real GPU at the Qwen3.5-27B shapes: against a
float64 reference within what the order of fp32 additions and one rounding allow, a row's result independent of the
batch and of the launch, its SwiGLU store, and under CUDA-graph replay with the split over blocks of threads. Needs
CUDA; CI has none."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from ignis.kernels.dense_mma import choose, dense_mma
from ignis.kernels.int4_mma import Shape, launch, row_tiles

# the 27B's products (gate_up, down, GDN in_proj, attention qkv, o_proj), a drafter-sized one and a small odd one
SHAPES = [(34816, 5120), (5120, 17408), (16480, 5120), (14336, 5120), (5120, 6144), (1024, 5120), (48, 192)]


def _weight(nout: int, ncols: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(nout, ncols, device="cuda", generator=g) * 0.02).to(dtype)


def _x(rows: int, ncols: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(1000 + seed)
    return torch.randn(rows, ncols, device="cuda", generator=g).to(dtype)


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """got is the fp32 sum rounded once to x's dtype: within half a unit in the last place of the exact product, plus
    what another order of fp32 additions (and the tensor cores' alignment of their addends) may move: 2^-16 of the sum of
    the terms' magnitudes."""
    ref = x.double() @ w.double().T
    mag = x.double().abs() @ w.double().abs().T
    ulp = 2.0 ** (-8 if x.dtype == torch.bfloat16 else -11)
    assert got.dtype == x.dtype and got.shape == ref.shape
    err = (got.double() - ref).abs()
    assert bool((err <= ref.abs() * ulp + mag * 2**-16 + 1e-30).all()), float((err - ref.abs() * ulp).max())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 33, 64])
def test_dense_mma_equals_the_exact_product_at_the_27b_shapes(shape: tuple[int, int], rows: int) -> None:
    nout, ncols = shape
    w = _weight(nout, ncols, seed=nout + ncols)
    x = _x(rows, ncols, seed=rows)
    _check(dense_mma(x, w), x, w)


def test_fp16_and_strided_rows() -> None:
    w = _weight(5120, 6144, seed=3, dtype=torch.float16)
    x = _x(5, 6144, seed=3, dtype=torch.float16)
    _check(dense_mma(x, w), x, w)
    wide = _x(8, 2 * 6144, seed=4)
    wb = w.bfloat16()
    _check(dense_mma(wide[:, 6144:], wb), wide[:, 6144:].contiguous(), wb)  # a column slice of a wider buffer


def test_a_rows_result_depends_on_neither_the_batch_nor_the_launch() -> None:
    """choose's split fixes the order of the sums; the rows, and F, U, RB, RG and AHEAD, must not change a bit."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for nout, ncols in ((5120, 17408), (14336, 5120), (5120, 6144)):
        w = _weight(nout, ncols, seed=7)
        base = choose(nout, ncols, sms)
        x = _x(64, ncols, seed=7)
        alone = torch.cat([dense_mma(x[i : i + 1], w) for i in range(64)])
        for rows in (2, 8, 9, 17, 33, 64):
            assert torch.equal(dense_mma(x[:rows], w), alone[:rows]), (nout, rows)
        for u, ahead, rb, f in ((1, 2, 2, 1), (base.unit, 1, 1, 2), (1, 1, 1, 4), (2, 3, 1, 1)):
            other = Shape(u, ahead, base.kw, rb, f, base.unit, base.ks)
            assert torch.equal(dense_mma(x[:8], w, other), alone[:8]), (nout, other)
        for rg in (2, 4, 8):
            for rows in (17, 33, 64):
                other = replace(launch(base, row_tiles(rows)), rg=rg)
                assert torch.equal(dense_mma(x[:rows], w, other), alone[:rows]), (nout, rows, other)


@pytest.mark.parametrize("shape", [(34816, 5120), (2048, 384)])
def test_the_swiglu_store_gives_the_product_then_swiglu(shape: tuple[int, int]) -> None:
    """dense_mma(..., swiglu=True) over a gate | up weight against the product then the SwiGLU kernel: the same bits
    but where the two exponentials round differently (one 16-bit step, rarely)."""
    from ignis.kernels import fused

    nout, ncols = shape
    w = _weight(nout, ncols, seed=5)
    for rows in (1, 8, 17, 64):
        x = _x(rows, ncols, seed=rows)
        chain = fused.swiglu(dense_mma(x, w))
        got = dense_mma(x, w, swiglu=True)
        assert got.shape == chain.shape == (rows, nout // 2)
        assert float((got != chain).float().mean()) <= 1e-3, (shape, rows)
        assert torch.allclose(got.float(), chain.float(), rtol=2**-7, atol=1e-6), (shape, rows)


def test_dense_mma_under_cuda_graph_replay() -> None:
    from ignis.kernels.launch import _counters

    for (nout, ncols), rows in (((5120, 17408), 8), ((34816, 5120), 1), ((5120, 6144), 64)):
        w = _weight(nout, ncols, seed=11)
        static_x = _x(rows, ncols, seed=0)
        dense_mma(static_x, w)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = dense_mma(static_x, w)
        for seed in range(3):
            static_x.copy_(_x(rows, ncols, seed=seed + 1))
            graph.replay()
            torch.cuda.synchronize()
            _check(static_out, static_x, w)
            assert torch.equal(static_out, dense_mma(static_x, w))
    torch.cuda.synchronize()
    assert all(not bool(c.any()) for c in _counters.values())  # every split call left its counters at zero


def test_bad_arguments_are_refused() -> None:
    w = _weight(5120, 6144, seed=1)
    with pytest.raises(ValueError, match="dense_mma takes"):
        dense_mma(_x(65, 6144, seed=1), w)
    with pytest.raises(ValueError, match="dense_mma takes"):
        dense_mma(_x(1, 6144, seed=1).half(), w)
    with pytest.raises(ValueError, match="dense_mma takes"):
        dense_mma(_x(1, 6144, seed=1), w.T.contiguous().T)
