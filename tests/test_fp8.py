"""FP8 weights (ignis.quant.fp8) on the CPU: the e4m3 codes and scales reproduce the weight, torch._scaled_mm with
our layouts and scales computes the product of the quantized operands (where the CPU build has it), the model
converted at load keeps its outputs, fuses, and plans what it holds. The CUDA comparison is in
tests/test_quant_gpu.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tiny import tiny_checkpoint

from ignis.config import load_config
from ignis.errors import ArtifactError
from ignis.model.loader import load_model
from ignis.model.ops import linear
from ignis.plan import memory_plan
from ignis.quant.convert import convert
from ignis.quant.fp8 import E4M3_MAX, FP8, Fp8Linear, Fp8Weight, fp8_linear_reference, fp8_scaled_linear, quantize_fp8
from tools.quant_quality import prefill_logits


def test_codes_and_scales_reproduce_the_weight() -> None:
    w = torch.randn(48, 96, dtype=torch.float64) * 0.02
    w[3] = 0.0  # a row of zeros stays zeros
    w[5, 7] = 3.0  # an outlier sets its row's scale, not the others'
    q = quantize_fp8(w)
    assert q.weight.dtype == FP8 and q.scale.dtype == torch.float32 and q.scale.shape == (48,)
    assert float(q.weight.float().abs().amax()) == E4M3_MAX
    back = q.dequantize(torch.float64)
    # e4m3: 3 mantissa bits (half a step is 2^-4 of the value); subnormal steps of 2^-9 times the scale
    bound = w.abs() * 2.0**-4 + q.scale.double()[:, None] * 2.0**-10
    assert bool(((back - w).abs() <= bound).all())
    assert torch.equal(back[3], torch.zeros(96, dtype=torch.float64))


def _scaled_mm_on_cpu() -> bool:
    try:
        a = torch.zeros(16, 16).to(FP8)
        torch._scaled_mm(a, a.t(), torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True


@pytest.mark.skipif(not _scaled_mm_on_cpu(), reason="this torch has no CPU _scaled_mm with row-wise scales")
@pytest.mark.parametrize("shape", [(1, 64), (5, 64), (16, 64), (17, 64), (2, 3, 64)])
def test_scaled_path_is_the_product_of_the_quantized_operands(shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    w = quantize_fp8(torch.randn(48, 64, generator=g) * 0.02)
    x = (torch.randn(*shape, generator=g) * torch.linspace(0.1, 30, shape[-1])).bfloat16()
    got = fp8_scaled_linear(x, w)
    assert got.shape == (*shape[:-1], 48) and got.dtype == torch.bfloat16
    # The same per-row quantization of x, then exact fp64 products of the quantized operands.
    rows = x.reshape(-1, 64).double()
    sa = rows.abs().amax(-1, keepdim=True) / E4M3_MAX
    xq = (rows / sa).float().clamp(-E4M3_MAX, E4M3_MAX).to(FP8).double() * sa
    want = (xq @ w.dequantize(torch.float64).T).reshape(*shape[:-1], 48)
    torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=1e-3)
    # and it stays close to the reference (unquantized x): x's rounding, 2^-4 of each term at most
    ref = fp8_linear_reference(x.double(), w)
    mag = F.linear(x.double().abs(), w.dequantize(torch.float64).abs())
    assert bool(((got.double() - ref).abs() <= 2.0**-4 * mag + 1e-2).all())


def test_linear_routes_fp8_weights_and_exact_mode_is_row_invariant() -> None:
    w = quantize_fp8(torch.randn(32, 64) * 0.05)
    x = torch.randn(20, 64)
    torch.testing.assert_close(linear(x, w, False), F.linear(x, w.dequantize(torch.float32)))
    alone = torch.cat([linear(x[i : i + 1], w, True) for i in range(20)])
    assert torch.equal(linear(x, w, True), alone)


def _tiny_pair(tmp_path: Path, exact: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    src = tiny_checkpoint(tmp_path / "src", seed=4)
    dense = load_model(src, device="cpu", dtype=torch.float32, exact=exact)
    fp8 = load_model(src, device="cpu", dtype=torch.float32, exact=exact, fp8=True)
    return dense, fp8


def test_a_model_converted_at_load_keeps_its_outputs_and_fuses(tmp_path: Path) -> None:
    dense, fp8 = _tiny_pair(tmp_path, exact=False)
    converted = [n for n, m in fp8.named_modules() if isinstance(m, Fp8Linear)]
    # 6 GDN layers x (qkv, z, out) + 2 attention layers x (q, k, v, o) + 8 MLPs x 3; the gates, head, MTP stay
    assert len(converted) == 6 * 3 + 2 * 4 + 8 * 3
    assert not any(n.startswith("mtp.") or n.endswith(("in_proj_a", "in_proj_b")) for n in converted)
    attn = fp8.layers[3].self_attn
    assert isinstance(attn.qkv_proj, Fp8Weight)  # q, k, v joined, their buffers views of it
    assert attn.q_proj.fp8_weight.untyped_storage().data_ptr() == attn.qkv_proj.weight.untyped_storage().data_ptr()
    assert isinstance(fp8.layers[0].mlp.gate_up, Fp8Weight)
    # A random 64-wide model amplifies weight noise (2.5% a matrix for e4m3): measured 0.11 of the logits' norm for
    # fp8 against 0.30 for int4 with groups of 64 on this model; fp8 must stay well under int4.
    convert(tmp_path / "src", tmp_path / "int4", group=64)
    int4 = load_model(tmp_path / "int4", device="cpu", dtype=torch.float32, exact=False)
    ids = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(0))
    a, b, c = prefill_logits(dense, ids), prefill_logits(fp8, ids), prefill_logits(int4, ids)
    err8, err4 = float((a - b).norm() / a.norm()), float((a - c).norm() / a.norm())
    assert err8 < 0.15 and err8 < err4 / 2, (err8, err4)


def test_exact_fp8_model_and_refusals(tmp_path: Path) -> None:
    dense, fp8 = _tiny_pair(tmp_path, exact=True)
    ids = torch.randint(3, 512, (24,), generator=torch.Generator().manual_seed(1))
    assert float((prefill_logits(dense, ids) - prefill_logits(fp8, ids)).abs().max()) < 0.5
    convert(tmp_path / "src", tmp_path / "int4", group=64)
    with pytest.raises(ArtifactError, match="fp8 weights are made from a checkpoint in its own precision"):
        load_model(tmp_path / "int4", device="cpu", dtype=torch.float32, exact=True, fp8=True)


def test_the_plan_counts_what_the_fp8_loader_holds(tmp_path: Path) -> None:
    src = tiny_checkpoint(tmp_path / "src", seed=3, mtp=True)
    model = load_model(src, device="cpu", dtype=torch.float32, exact=True, fp8=True)
    held = sum(t.nbytes for t in model.state_dict().values())
    plan = memory_plan(load_config(profile="cpu", overrides={"model.weights": "fp8"}), src)
    assert {i.name: i.nbytes for i in plan.items}["weights"] == held
    assert plan.weights.startswith("fp8")


@pytest.mark.parametrize("shape", [(34816, 5120), (5120, 17408), (12352, 5120), (5120, 6144)])
def test_the_fp8_mma_kernel_compiles_for_sm90_at_every_launch_of_the_27b_products(shape: tuple[int, int]) -> None:
    """ignis.kernels.fp8_mma at the 27B's products for one row and for 57-64 (one and eight tiles of 8), with and
    without programmatic dependent launch: NVRTC builds each for sm_90 (the GPU tests run them, fp16 among them)."""
    pytest.importorskip("cuda.bindings")
    from dataclasses import replace

    from ignis.kernels.fp8_mma import CHUNK, defines
    from ignis.kernels.fp8_mma_kernel import SOURCE
    from ignis.kernels.int4_mma import choose, launch
    from ignis.kernels.nvrtc import compile_cubin

    for nt in (1, 8):
        s = launch(choose(*shape, CHUNK, 132), nt)
        s = replace(s, rg=min(s.rg, nt))
        for early in (False, True):
            cubin = compile_cubin(SOURCE, "fp8_mma", "sm_90", defines(nt, s, torch.bfloat16, early))
            assert 0 < cubin.registers <= 255, (nt, s, cubin.registers)
