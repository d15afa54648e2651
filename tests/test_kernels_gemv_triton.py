"""The weight-streaming Triton products (ignis.kernels.gemv_triton: fp8 codes with row scales, and a dense weight)
against the float64 product of their operands, and the CPU's choice of the references.

Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET) on CPU tensors with
fp32 activations: one and several row tiles, splits of the input and none, output rows that are and are not whole
tiles. It also compiles for sm_90 here, in a child interpreter without TRITON_INTERPRET, for bf16 activations without
register spills. The GPU run (bf16, the 27B shapes, graph replay, rows independent of the batch) is in
tests/test_quant_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from ignis.kernels.gemv_triton import Config, choose, dense_gemv, fp8_gemv
from ignis.quant.fp8 import quantize_fp8
from tests.sm90 import run_child

if torch.cuda.is_available():
    pytest.skip("the interpreter takes CPU tensors: tests/test_quant_gpu.py runs these", allow_module_level=True)

pytestmark = pytest.mark.usefixtures("interpreted_loop_bounds", "interpreted_dot_by_rows")


def operands(rows: int, nout: int, ncols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = quantize_fp8(torch.randn(nout, ncols, generator=g) * 0.05)
    return torch.randn(rows, ncols, generator=g), w.weight, w.scale


def expected(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.double() @ (codes.double() * scale.double()[:, None]).T


@pytest.mark.parametrize("rows,nout,ncols,config", [
    (1, 96, 512, None), (7, 80, 1024, Config(64, 128, 2, 4, 1)), (20, 64, 1024, Config(64, 128, 8, 4, 1)),
    (3, 200, 256, Config(64, 128, 1, 4, 1)), (64, 96, 512, Config(64, 128, 2, 4, 1, block_m=64)),
    (40, 80, 256, Config(32, 128, 1, 4, 1, block_m=32)),
])
def test_kernel_equals_the_product_of_its_operands(rows: int, nout: int, ncols: int, config: Config | None) -> None:
    x, codes, scale = operands(rows, nout, ncols, seed=rows + nout)
    got = fp8_gemv(x, codes, scale, config)
    assert got.dtype == torch.float32 and got.shape == (rows, nout)
    torch.testing.assert_close(got.double(), expected(x, codes, scale), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,nout", [(1, 96), (8, 96), (64, 200)])
def test_dense_gemv_equals_the_product(rows: int, nout: int) -> None:
    """The dense form, at the shape of a quantized Gated DeltaNet's gates (2 x 48 rows) and one of several tiles."""
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 1024, generator=g), torch.randn(nout, 1024, generator=g) * 0.05
    got = dense_gemv(x, w)
    torch.testing.assert_close(got.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-5)
    assert choose(nout, 1024, 132).split_k > 1  # too few output tiles to fill the device alone
    with pytest.raises(ValueError, match="of x's dtype"):
        dense_gemv(x, w.double())


def test_gate_linear_keeps_f_linear_on_the_cpu() -> None:
    from ignis.model.ops import gate_linear

    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(3, 256, generator=g), torch.randn(96, 256, generator=g)
    assert torch.equal(gate_linear(x, w), torch.nn.functional.linear(x, w))


def test_a_rows_result_does_not_depend_on_the_batch() -> None:
    x, codes, scale = operands(20, 64, 1024, seed=3)
    cfg = Config(64, 128, 4, 4, 1)
    assert torch.equal(fp8_gemv(x[5:6], codes, scale, cfg)[0], fp8_gemv(x, codes, scale, cfg)[5])


def test_the_split_depends_on_the_shape_and_fills_the_device() -> None:
    for nout, ncols in ((34816, 5120), (5120, 17408), (16384, 5120), (14336, 5120), (5120, 6144)):
        c = choose(nout, ncols, 132)
        steps = ncols // c.block_k
        assert steps % c.split_k == 0 and steps // c.split_k >= 4
        assert c.split_k == 1 or -(-nout // c.block_n) * c.split_k >= 4 * 132 or c.split_k == 16
    assert choose(5120, 17408, 132).split_k > 1  # 80 output tiles alone would leave most SMs idle
    assert choose(34816, 5120, 132).split_k == 1  # 544 tiles fill them


def test_bad_inputs_are_refused() -> None:
    x, codes, scale = operands(2, 64, 256, seed=1)
    with pytest.raises(ValueError, match="e4m3 weight"):
        fp8_gemv(x, codes.float(), scale)
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8_gemv(x[:, :200], codes[:, :200], scale)
    with pytest.raises(ValueError, match="block_k must divide"):
        fp8_gemv(x, codes, scale, Config(64, 128, 3, 4, 1))


def test_fp8_linear_keeps_the_reference_on_the_cpu() -> None:
    """On the CPU the reference runs whatever is installed; the choice by rows is tests/test_quant_gpu.py's."""
    from ignis.quant import fp8

    x, codes, scale = operands(2, 64, 256, seed=4)
    w = fp8.Fp8Weight(codes, scale)
    assert torch.equal(fp8.fp8_linear(x, w), fp8.fp8_linear_reference(x, w))


COMPILE = r"""
from ignis.kernels.gemv_triton import _gemv_kernel, choose, plan
from tests.sm90 import build, spills

for nout, ncols in ((34816, 5120), (5120, 17408)):
    c = choose(nout, ncols, 132)
    types = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "out_ptr": "*bf16", "ws_ptr": "*fp32",
             "cnt_ptr": "*i32"}
    consts = {"BLOCK_M": 16, "BLOCK_N": c.block_n, "BLOCK_K": c.block_k, "STEPS": ncols // c.block_k // c.split_k,
              "SPLIT_K": c.split_k, "SCALED": True, "PRECISION": "tf32", "PDL": False}
    kernel = build(_gemv_kernel, types, consts, ("stride_xm", "stride_wn"), c.warps, c.stages)
    ptx = kernel.asm["ptx"]
    assert ".target sm_90a" in ptx and "mma.sync" in ptx and spills(kernel) == 0, (nout, ncols)
    print("ok", nout, ncols)

# a verify's 64 rows in one row tile, on a dense bf16 weight (o_proj / gdn out_proj)
c = plan(5120, 6144, 132, block_m=64)
types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "s_ptr": "*bf16", "out_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32"}
consts = {"BLOCK_M": 64, "BLOCK_N": c.block_n, "BLOCK_K": c.block_k, "STEPS": 6144 // c.block_k // c.split_k,
          "SPLIT_K": c.split_k, "SCALED": False, "PRECISION": "tf32", "PDL": False}
kernel = build(_gemv_kernel, types, consts, ("stride_xm", "stride_wn"), c.warps, c.stages)
assert "mma" in kernel.asm["ptx"] and spills(kernel) == 0
print("ok", "block_m 64")

# launched ahead of the kernel before (launch.PDL): mlp down's dense bf16 weight, its first tile loaded before the wait
c = choose(5120, 17408, 132)
consts = {"BLOCK_M": 16, "BLOCK_N": c.block_n, "BLOCK_K": c.block_k, "STEPS": 17408 // c.block_k // c.split_k,
          "SPLIT_K": c.split_k, "SCALED": False, "PRECISION": "tf32", "PDL": True}
kernel = build(_gemv_kernel, types, consts, ("stride_xm", "stride_wn"), c.warps, c.stages)
ptx = kernel.asm["ptx"]
wait = ptx.index("griddepcontrol.wait")
assert ptx.count("griddepcontrol.wait") == 1 and "griddepcontrol.launch_dependents" in ptx[wait:]
assert "ld.global" in ptx[:wait] and "mma" in ptx[wait:] and spills(kernel) == 0
print("ok", "pdl")
"""


def test_kernel_compiles_for_sm90_on_tensor_cores_without_spills() -> None:
    """Also with programmatic dependent launch: one wait, the weight's first load ahead of it."""
    assert run_child(COMPILE).count("ok") == 4
