"""The top-k kernel on a real GPU: bit-identical to the reference and equal in value to torch.topk over the
vocabulary grid, on hard data, on views, on a side stream and under CUDA-graph replay. Needs CUDA; CI has none."""

from __future__ import annotations

import pytest
import torch

from ignis.kernels.topk import topk, topk_reference

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _check(x: torch.Tensor, k: int) -> None:
    vals, ids = topk(x, k)
    ref_vals, ref_ids = topk_reference(x, k)
    assert torch.equal(ids, ref_ids)
    assert torch.equal(_bits(vals), _bits(ref_vals))  # the input's own bits
    tk = torch.topk(x, k)
    torch.testing.assert_close(vals, tk.values, rtol=0, atol=0, equal_nan=True)  # -0.0 == +0.0 here


def _counters_zero() -> bool:
    from ignis.kernels.topk_launch import _devices

    return all(bool((d.counters == 0).all()) for d in _devices.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [8, 16, 64])
@pytest.mark.parametrize("ncols", [151936, 262144])
@pytest.mark.parametrize("rows", [1, 8, 64, 256])
def test_vocabulary_grid(rows: int, ncols: int, k: int, dtype: torch.dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(rows + ncols + k)
    _check(torch.randn(rows, ncols, device="cuda", generator=g).to(dtype), k)


@pytest.mark.parametrize("k", [1, 15, 32, 33, 64])
@pytest.mark.parametrize("rows", [1, 7, 256])
@pytest.mark.parametrize("ncols", [4099, 100003, 248046])
def test_heavy_ties(rows: int, ncols: int, k: int) -> None:
    # Integers in [0, 4): the k-th value is shared by tens of thousands of columns, across every block boundary.
    g = torch.Generator(device="cuda").manual_seed(rows * k + ncols)
    x = torch.randint(0, 4, (rows, ncols), device="cuda", generator=g).float()
    _check(x, k)
    _check(x.bfloat16(), k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_special_values_and_masked_rows(dtype: torch.dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(6, 248320, device="cuda", generator=g)
    x[0] = 0.7  # all equal
    x[1] = -torch.inf
    x[1, [17, 200000, 5]] = torch.tensor([1.0, 2.0, 1.0], device="cuda")  # fewer finite values than k
    x[2, ::3] = -0.0
    x[2, 1::3] = 0.0
    x[3, [9, 99999]] = torch.nan
    x[3, [10, 11]] = torch.inf
    x[4] *= 1e-39  # subnormals (bf16 has fp32's exponent range)
    x[5] = torch.arange(248320, device="cuda", dtype=torch.float32)  # ascending: every element beats the list
    for k in (1, 16, 33, 64):
        _check(x.to(dtype), k)


def test_views_odd_rows_and_leading_dims() -> None:
    g = torch.Generator(device="cuda").manual_seed(6)
    wide = torch.randn(8, 151937, device="cuda", generator=g)
    _check(wide[:, :151936], 16)  # row stride > row length
    _check(wide.bfloat16()[:, 1:], 16)  # bf16 rows that start on an odd element
    _check(wide.bfloat16()[:, :-2], 16)  # odd bf16 row length
    _check(wide.t().contiguous().t(), 8)  # column-major: copied to rows
    x = torch.randn(2, 3, 50000, device="cuda", generator=g)
    vals, ids = topk(x, 12)
    ref_vals, ref_ids = topk_reference(x, 12)
    assert ids.shape == (2, 3, 12) and torch.equal(ids, ref_ids) and torch.equal(vals, ref_vals)


def test_repeated_calls_are_identical_and_reset_the_counters() -> None:
    x = torch.randint(0, 3, (7, 248320), device="cuda").bfloat16()
    first = topk(x, 16)
    for _ in range(5):
        again = topk(x, 16)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    torch.cuda.synchronize()
    assert _counters_zero()


def test_side_stream() -> None:
    x = torch.randn(56, 248320, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        vals, ids = topk(x, 8)
    s.synchronize()
    ref_vals, ref_ids = topk_reference(x, 8)
    assert torch.equal(ids, ref_ids) and torch.equal(vals, ref_vals)


@pytest.mark.parametrize(("rows", "k", "dtype"), [(1, 8, torch.float32), (56, 16, torch.bfloat16), (8, 40, torch.float32)])
def test_cuda_graph_replay(rows: int, k: int, dtype: torch.dtype) -> None:
    static_x = torch.randn(rows, 248320, device="cuda").to(dtype)
    topk(static_x, k)  # compile and load outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_vals, static_ids = topk(static_x, k)
    for seed in range(4):
        new = torch.randint(-50, 50, static_x.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        static_x.copy_(new.to(dtype))
        graph.replay()
        ref_vals, ref_ids = topk_reference(static_x, k)
        assert torch.equal(static_ids, ref_ids) and torch.equal(_bits(static_vals), _bits(ref_vals))
    torch.cuda.synchronize()
    assert _counters_zero()
