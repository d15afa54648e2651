"""The FP8 product with the weight as the tensor cores' 16-row operand (ignis.kernels.fp8_mma) on a real GPU: every
e4m3 code widened exactly, the 27B shapes against the float64 product, a row's result independent of the batch, fp16
activations, the split over blocks of threads under CUDA-graph replay and programmatic dependent launch, and
fp8_linear's routing. Needs CUDA with e4m3 conversions (sm_89 or newer); CI has none."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("needs a CUDA device of sm_89 or newer", allow_module_level=True)

from ignis.kernels.fp8_mma import fp8_mma
from ignis.quant.fp8 import FP8, Fp8Weight, quantize_fp8

SHAPES = [(34816, 5120), (5120, 17408), (16384, 5120), (5120, 6144), (14336, 5120), (8192, 5120), (16, 64)]


def _weight(nout: int, ncols: int, seed: int) -> Fp8Weight:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return quantize_fp8(torch.randn(nout, ncols, device="cuda", generator=g) * 0.02)


def _close(got: torch.Tensor, x: torch.Tensor, w: Fp8Weight) -> None:
    """Within bf16's rounding of the float64 product of the operands (the codes times their scales, x as given)."""
    want = x.double() @ w.dequantize(torch.float64).T
    torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-3 * float(want.abs().max()))


def test_every_e4m3_code_is_widened_exactly() -> None:
    """A weight holding each of the 254 finite e4m3 codes once a row (the two NaNs left out, zeros there), scale 1:
    one-hot rows of x pick each column, and the product is the code's value, bit for bit, in bf16 and fp16."""
    codes = torch.arange(256, dtype=torch.uint8, device="cuda")
    codes[codes & 0x7F == 0x7F] = 0  # 0x7F and 0xFF are NaN in e4m3fn
    w = torch.zeros(16, 256, dtype=torch.uint8, device="cuda")
    for i in range(16):  # every row every code, each in another column than in the row before
        w[i] = codes.roll(i * 17)
    weight = w.view(FP8)
    scale = torch.ones(16, dtype=torch.float32, device="cuda")
    want = weight.float()
    for dtype in (torch.bfloat16, torch.float16):
        for start in range(0, 256, 64):
            x = torch.zeros(64, 256, dtype=dtype, device="cuda")
            x[torch.arange(64), start + torch.arange(64)] = 1
            got = fp8_mma(x, weight, scale)  # [64 one-hot rows, 16 features]: column start + r of each feature
            assert torch.equal(got.float(), want[:, start : start + 64].T.to(dtype).float()), dtype


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 33, 64])
def test_fp8_mma_equals_the_product_of_its_operands(shape: tuple[int, int], rows: int) -> None:
    nout, ncols = shape
    w = _weight(nout, ncols, seed=nout + ncols)
    x = torch.randn(rows, ncols, device="cuda", generator=torch.Generator(device="cuda").manual_seed(rows)).bfloat16()
    got = fp8_mma(x, w.weight, w.scale)
    assert got.shape == (rows, nout) and got.dtype == torch.bfloat16
    _close(got, x, w)
    for r in {0, rows // 2, rows - 1}:  # a row alone, and inside every other batch size: the same bits
        assert torch.equal(fp8_mma(x[r : r + 1], w.weight, w.scale)[0], got[r])
    if rows > 8:
        assert torch.equal(fp8_mma(x[:8], w.weight, w.scale), got[:8])


def test_fp8_mma_takes_fp16_activations_and_row_views_of_a_fused_weight() -> None:
    """fp16 x against the same product; a weight's row slice (a fused projection's view, as fuse_fp8 makes them)."""
    w = _weight(6144 + 2048, 5120, seed=5)
    x = torch.randn(5, 5120, device="cuda").half()
    _close(fp8_mma(x, w.weight, w.scale), x, w)
    part = w[6144:]
    got = fp8_mma(x.bfloat16(), part.weight, part.scale)
    assert torch.equal(got, fp8_mma(x.bfloat16(), w.weight, w.scale)[:, 6144:])


@pytest.mark.parametrize("rows", [1, 8, 64])
def test_fp8_mma_under_cuda_graph_replay_resets_its_split_counters(rows: int) -> None:
    """down (5,120 x 17,408) splits its input over blocks of threads that meet through counters; replayed on new
    inputs it gives the eager bits and leaves every counter at zero."""
    from ignis.kernels.launch import split_counters

    w = _weight(5120, 17408, seed=rows)
    static_x = torch.randn(rows, 17408, device="cuda").bfloat16()
    fp8_mma(static_x, w.weight, w.scale)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fp8_mma(static_x, w.weight, w.scale)
    for seed in range(3):
        static_x.copy_(torch.randn(rows, 17408, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
        graph.replay()
        assert torch.equal(static_out, fp8_mma(static_x, w.weight, w.scale))
    torch.cuda.synchronize()
    assert bool((split_counters(static_x.device) == 0).all())


@pytest.mark.parametrize("rows", [1, 8])
def test_programmatic_dependent_launch_keeps_the_fp8_chain_bit_for_bit(rows: int,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """gate_up, SwiGLU and down (split over blocks) in fp8, with PDL on (codes loaded before the wait): the bits of
    PDL off, eager and replayed on new inputs."""
    from ignis.kernels.swiglu_triton import swiglu
    from tests.pdl import same_bits_with_pdl

    g = torch.Generator(device="cuda").manual_seed(rows)
    w_gu, w_down = _weight(34816, 5120, seed=1), _weight(5120, 17408, seed=2)
    x = torch.randn(rows, 5120, device="cuda", generator=g).bfloat16()
    inputs = [torch.randn(rows, 5120, device="cuda", generator=g).bfloat16() for _ in range(3)]

    def chain() -> tuple[torch.Tensor]:
        return (fp8_mma(swiglu(fp8_mma(x, w_gu.weight, w_gu.scale)), w_down.weight, w_down.scale),)

    same_bits_with_pdl(chain, x, inputs, monkeypatch)
    same_bits_with_pdl(chain, x, inputs, monkeypatch, early=True)


def test_fp8_linear_routes_decode_rows_to_the_mma_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8_linear: up to 64 rows the mma kernel (its bits), FP8_KERNEL "triton" the Triton kernel (within rounding
    of it), a shape the mma kernel does not take (outputs not a multiple of 16) the Triton kernel."""
    from ignis.kernels.gemv_triton import fp8_gemv
    from ignis.quant import fp8

    w = _weight(5120, 6144, seed=9)
    x = torch.randn(8, 6144, device="cuda").bfloat16()
    assert torch.equal(fp8.fp8_linear(x, w), fp8_mma(x, w.weight, w.scale))
    monkeypatch.setattr(fp8, "FP8_KERNEL", "triton")
    assert torch.equal(fp8.fp8_linear(x, w), fp8_gemv(x, w.weight, w.scale))
    odd = _weight(40, 256, seed=10)
    xo = torch.randn(3, 256, device="cuda").bfloat16()
    monkeypatch.setattr(fp8, "FP8_KERNEL", "mma")
    assert torch.equal(fp8.fp8_linear(xo, odd), fp8_gemv(xo, odd.weight, odd.scale))
