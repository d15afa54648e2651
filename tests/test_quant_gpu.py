"""The quantized products on a real GPU at the Qwen3.5-27B shapes: the numba 4-bit GEMV and the Triton 4-bit
GEMV/GEMM on tensor cores against their reference (under CUDA-graph replay, on a side stream, a row's result
independent of the batch), the fp8 product against the product of its operands, and the quantized built-in model
against its CPU reference. Needs CUDA; CI has none."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)


# The 4-bit GEMV (ignis.kernels.int4_gemv) at the Qwen3.5-27B shapes: (out, in) of the fused MLP gate/up, the MLP
# down, the Gated DeltaNet qkv + z and output, the attention q/gate + k + v and output projections.
INT4_SHAPES = [(34816, 5120), (5120, 17408), (16384, 5120), (5120, 6144), (14336, 5120), (19, 128)]


def _int4_weight(nout: int, ncols: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from ignis.quant.format import quantize

    g = torch.Generator(device="cuda").manual_seed(seed)
    qw, s, z = quantize(torch.randn(nout, ncols, device="cuda", generator=g) * 0.02, group)
    return qw, s.bfloat16(), z


def _int4_check(got: torch.Tensor, x: torch.Tensor, qw: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> None:
    """got is the fp32 product rounded once to bf16: within half a unit of the last place of the reference's fp32
    sums, plus what another order of fp32 additions may change (relative to the sum of the terms' magnitudes)."""
    from ignis.kernels.int4_gemv import int4_gemv_reference
    from ignis.quant.format import dequantize

    ref = int4_gemv_reference(x.float(), qw, s, z)
    mag = torch.nn.functional.linear(x.float().abs(), dequantize(qw, s, z, torch.float32).abs())
    _, e = torch.frexp(ref)
    bound = torch.ldexp(torch.ones_like(ref), e - 9) + 1e-5 * mag + 1e-30
    err = (got.float() - ref).abs()
    assert got.dtype == x.dtype and got.shape == ref.shape
    assert bool((err <= bound).all()), float((err / bound).max())


@pytest.mark.parametrize("shape", INT4_SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 16, 64])
def test_int4_gemv_equals_its_reference(shape: tuple[int, int], rows: int) -> None:
    from ignis.kernels.int4_gemv import int4_gemv

    nout, ncols = shape
    qw, s, z = _int4_weight(nout, ncols, 128 if ncols % 128 == 0 else 64, seed=nout + ncols)
    x = torch.randn(rows, ncols, device="cuda", generator=torch.Generator(device="cuda").manual_seed(rows)).bfloat16()
    _int4_check(int4_gemv(x, qw, s, z), x, qw, s, z)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_int4_gemv_group_64_and_other_dtypes(dtype: torch.dtype) -> None:
    from ignis.kernels.int4_gemv import int4_gemv, int4_gemv_reference

    qw, s, z = _int4_weight(5120, 6144, 64, seed=3)
    x = torch.randn(5, 6144, device="cuda").to(dtype)
    tol = 1e-3 if dtype == torch.float16 else 1e-5
    torch.testing.assert_close(int4_gemv(x, qw, s.to(dtype), z), int4_gemv_reference(x, qw, s.to(dtype), z),
                               rtol=tol, atol=tol)


def test_int4_gemv_rows_do_not_depend_on_the_batch() -> None:
    from ignis.kernels.int4_gemv import int4_gemv

    for nout, ncols in ((5120, 17408), (14336, 5120)):
        qw, s, z = _int4_weight(nout, ncols, 128, seed=7)
        x = torch.randn(64, ncols, device="cuda").bfloat16()
        alone = torch.cat([int4_gemv(x[i : i + 1], qw, s, z) for i in range(64)])
        for rows in (2, 3, 8, 64):
            assert torch.equal(int4_gemv(x[:rows], qw, s, z), alone[:rows])


def _replayed_then_side(kernel: Callable[..., torch.Tensor], rows: int, qw: torch.Tensor, s: torch.Tensor,
                        z: torch.Tensor, check: Callable[[torch.Tensor, torch.Tensor], None]
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kernel(x, qw, s, z) captured in a CUDA graph (after a first call outside it: compile, load, counters), replayed
    on three new inputs with check(out, x) after each, then run on a side stream: (x, replayed out, side out)."""
    ncols = 2 * qw.shape[1]
    static_x = torch.randn(rows, ncols, device="cuda").bfloat16()
    kernel(static_x, qw, s, z)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = kernel(static_x, qw, s, z)
    for seed in range(3):
        static_x.copy_(torch.randn(rows, ncols, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
        graph.replay()
        check(static_out, static_x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = kernel(static_x, qw, s, z)
    side.synchronize()
    return static_x, static_out, out


def test_int4_gemv_under_cuda_graph_replay_and_on_a_side_stream() -> None:
    from ignis.kernels.int4_gemv import _devices, int4_gemv

    for (nout, ncols), rows in (((5120, 17408), 8), ((34816, 5120), 1), ((16384, 5120), 64)):
        qw, s, z = _int4_weight(nout, ncols, 128, seed=11)
        x, _, out = _replayed_then_side(int4_gemv, rows, qw, s, z, lambda out, x: _int4_check(out, x, qw, s, z))
        _int4_check(out, x, qw, s, z)
    torch.cuda.synchronize()
    assert all(bool((d.counters == 0).all()) for d in _devices.values())


def test_int4_packed_linear_uses_the_kernel_up_to_64_rows() -> None:
    from ignis.quant.linear import PackedWeight, packed_linear

    qw, s, z = _int4_weight(1024, 2048, 128, seed=5)
    w = PackedWeight(qw, s, z)
    for shape in ((1, 2048), (4, 8, 2048), (64, 2048), (65, 2048), (3, 100, 2048)):
        x = torch.randn(*shape, device="cuda").bfloat16()
        got = packed_linear(x, w)
        assert got.shape == (*shape[:-1], 1024)
        if x.numel() <= 64 * 2048:
            _int4_check(got.reshape(-1, 1024), x.reshape(-1, 2048), qw, s, z)
        else:  # the reference: the bf16 dequantized weight through F.linear
            torch.testing.assert_close(got, torch.nn.functional.linear(x, w.dequantize()))


def _fp8_expected(x: torch.Tensor, w: object) -> torch.Tensor:
    """The product of the quantized operands in fp64: x quantized per row as fp8_scaled_linear does."""
    from ignis.quant.fp8 import E4M3_MAX, FP8, Fp8Weight

    assert isinstance(w, Fp8Weight)
    rows = x.reshape(-1, x.shape[-1]).double()
    sa = rows.abs().amax(-1, keepdim=True).clamp(min=1e-30) / E4M3_MAX
    xq = (rows / sa).float().clamp(-E4M3_MAX, E4M3_MAX).to(FP8).double() * sa
    return (xq @ w.dequantize(torch.float64).T).reshape(*x.shape[:-1], -1)


@pytest.mark.skipif(torch.cuda.get_device_capability() < (8, 9), reason="fp8 matmuls need sm_89 or newer")
@pytest.mark.parametrize("shape", INT4_SHAPES[:5])
@pytest.mark.parametrize("rows", [1, 7, 16, 64, 65])
def test_fp8_linear_equals_the_product_of_its_operands(shape: tuple[int, int], rows: int) -> None:
    """Up to 64 rows the Triton kernel (x unquantized: within bf16's rounding of the fp64 product); more rows
    _scaled_mm (x quantized per row to e4m3, as `_fp8_expected` does)."""
    from ignis.quant.fp8 import fp8_linear, quantize_fp8

    nout, ncols = shape
    g = torch.Generator(device="cuda").manual_seed(nout + rows)
    w = quantize_fp8(torch.randn(nout, ncols, device="cuda", generator=g) * 0.02)
    x = torch.randn(rows, ncols, device="cuda", generator=g).bfloat16()
    got = fp8_linear(x, w)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, nout)
    if rows <= 64:
        want = x.double() @ w.dequantize(torch.float64).T
        torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-3 * float(want.abs().max()))
        assert torch.equal(fp8_linear(x[rows // 2 : rows // 2 + 1], w)[0], got[rows // 2])  # a row alone: same bits
    else:
        want = _fp8_expected(x, w)
        torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=4e-3 * float(want.abs().max()))


@pytest.mark.parametrize("rows", [1, 8, 64])
def test_the_gates_dense_product_equals_f_linear_and_replays(rows: int) -> None:
    """A quantized Gated DeltaNet's gates (b | a, 96 x 5,120 at the 27B shape) through ignis.model.ops.gate_linear:
    the Triton kernel's split sum against the fp64 product within bf16's rounding, a row alone the same bits, and the
    split counters reset under graph replay."""
    from ignis.model.ops import gate_linear

    g = torch.Generator(device="cuda").manual_seed(rows)
    w = (torch.randn(96, 5120, device="cuda", generator=g) * 0.02).bfloat16()
    x = torch.randn(rows, 5120, device="cuda", generator=g).bfloat16()
    got = gate_linear(x, w)
    want = x.double() @ w.double().T
    torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-3 * float(want.abs().max()))
    assert torch.equal(gate_linear(x[rows // 2 : rows // 2 + 1], w)[0], got[rows // 2])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gate_linear(x, w)
    for _ in range(3):
        graph.replay()
        assert torch.equal(out, got)


@pytest.mark.skipif(torch.cuda.get_device_capability() < (8, 9), reason="fp8 matmuls need sm_89 or newer")
def test_fp8_linear_under_cuda_graph_replay() -> None:
    from ignis.quant.fp8 import fp8_linear, quantize_fp8

    w = quantize_fp8(torch.randn(5120, 17408, device="cuda") * 0.02)
    static_x = torch.randn(3, 17408, device="cuda").bfloat16()
    fp8_linear(static_x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fp8_linear(static_x, w)
    for seed in range(3):
        static_x.copy_(torch.randn(3, 17408, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)) * 4)
        graph.replay()
        assert torch.equal(static_out, fp8_linear(static_x, w))  # the split kernel's counters reset under replay


@pytest.mark.parametrize("form", ["int4", "fp8"])
def test_quantized_builtin_on_the_gpu_tracks_its_cpu_reference(form: str, tmp_path: Path) -> None:
    """The built-in model with int4 (the kernel: 48 rows) or fp8 (the Triton kernel) projections, bf16 on the GPU, against
    the same weights on the CPU in fp32 through the references (measured on the CPU with _scaled_mm's CPU build: fp8's
    per-row activation quantization moves the logits 3.8% of their norm, bf16 alone 0.6%)."""
    from ignis.artifact import BUILTIN
    from ignis.model.batch import Batch, Segment
    from ignis.model.cache import LaneCache
    from ignis.model.loader import load_model
    from ignis.quant.convert import convert

    if form == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 matmuls need sm_89 or newer")
    path = BUILTIN
    if form == "int4":
        path = tmp_path / "int4"
        convert(BUILTIN, path, group=128)

    def logits(device: str, dtype: torch.dtype, ids: torch.Tensor) -> torch.Tensor:
        model = load_model(path, device=device, dtype=dtype, exact=False, fp8=form == "fp8")
        ids = ids.to(device)
        n = ids.shape[0]
        cache = LaneCache(model.config, lanes=1, context=256, max_cols=1, device=device, dtype=dtype)
        pos = torch.arange(n, device=device)
        return model(Batch(ids, pos, (Segment(0, 0, 0, n, prefill=True),), pos), cache).logits.float().cpu()

    ids = torch.randint(3, 1000, (48,), generator=torch.Generator().manual_seed(0))
    ref, got = logits("cpu", torch.float32, ids), logits("cuda", torch.bfloat16, ids)
    err = float((got - ref).norm() / ref.norm())
    assert err < (3e-2 if form == "int4" else 6e-2), err
    assert float((got.argmax(-1) == ref.argmax(-1)).float().mean()) > 0.85


# The Triton 4-bit GEMV/GEMM on tensor cores (ignis.kernels.int4_triton) at the 27B shapes: the table's launch shapes,
# bf16 activations through the PTX dequantization, the split-K sum under graph replay, batch invariance.
def _rel(got: torch.Tensor, x: torch.Tensor, qw: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> float:
    from ignis.kernels.int4_gemv import int4_gemv_reference

    ref = int4_gemv_reference(x.float(), qw, s, z)
    assert got.dtype == x.dtype and got.shape == ref.shape
    return float((got.float() - ref).norm() / ref.norm())


@pytest.mark.parametrize("shape", INT4_SHAPES)
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_int4_triton_equals_its_reference_at_the_27b_shapes(shape: tuple[int, int], rows: int) -> None:
    from ignis.kernels.int4_triton import int4_triton

    nout, ncols = shape
    qw, s, z = _int4_weight(nout, ncols, 128 if ncols % 128 == 0 else 64, seed=nout + ncols)
    x = torch.randn(rows, ncols, device="cuda", generator=torch.Generator(device="cuda").manual_seed(rows)).bfloat16()
    assert _rel(int4_triton(x, qw, s, z), x, qw, s, z) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_int4_triton_group_64_and_other_dtypes(dtype: torch.dtype) -> None:
    from ignis.kernels.int4_triton import int4_triton

    qw, s, z = _int4_weight(5120, 6144, 64, seed=3)
    x = torch.randn(5, 6144, device="cuda").to(dtype)
    assert _rel(int4_triton(x, qw, s.to(dtype), z), x, qw, s.to(dtype), z) < (1e-2 if dtype == torch.float16 else 1e-5)


def test_int4_triton_rows_do_not_depend_on_the_batch() -> None:
    from ignis.kernels.int4_triton import int4_triton

    for nout, ncols in ((5120, 17408), (14336, 5120)):  # split over K, and not
        qw, s, z = _int4_weight(nout, ncols, 128, seed=7)
        x = torch.randn(64, ncols, device="cuda").bfloat16()
        alone = torch.cat([int4_triton(x[i : i + 1], qw, s, z) for i in range(64)])
        for rows in (2, 8, 17, 33, 64):
            assert torch.equal(int4_triton(x[:rows], qw, s, z), alone[:rows]), (nout, rows)


def test_int4_triton_under_cuda_graph_replay_and_on_a_side_stream() -> None:
    from ignis.kernels.int4_triton import int4_triton
    from ignis.kernels.launch import _counters

    def replayed(out: torch.Tensor, x: torch.Tensor) -> None:
        assert _rel(out, x, qw, s, z) < 1e-2
        assert torch.equal(out, int4_triton(x, qw, s, z))  # eager and replayed alike

    for (nout, ncols), rows in (((5120, 17408), 8), ((34816, 5120), 1), ((5120, 6144), 64)):
        qw, s, z = _int4_weight(nout, ncols, 128, seed=11)
        _, static_out, out = _replayed_then_side(int4_triton, rows, qw, s, z, replayed)
        assert torch.equal(out, static_out)
    torch.cuda.synchronize()
    assert all(not bool(c.any()) for c in _counters.values())


def test_packed_linear_runs_the_triton_kernel_when_chosen() -> None:
    from ignis.kernels.int4_triton import int4_triton
    from ignis.quant.linear import PackedWeight, packed_linear, set_kernel

    qw, s, z = _int4_weight(1024, 2048, 128, seed=5)
    w = PackedWeight(qw, s, z)
    x = torch.randn(4, 8, 2048, device="cuda").bfloat16()
    set_kernel("triton")
    try:
        assert torch.equal(packed_linear(x, w), int4_triton(x, qw, s, z))
        assert packed_linear(x[:1, :1].expand(3, 100, 2048), w).shape == (3, 100, 1024)  # past 64 rows: reference
    finally:
        set_kernel("auto")
