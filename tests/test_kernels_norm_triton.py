"""The Triton residual add + RMSNorm (ignis.kernels.norm_triton) against the torch reference, and `fused.add_rms_norm`'s
choice of it.

Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET) on CPU tensors, in
fp32 (the interpreter mishandles bf16 loads), at widths that are and are not powers of two, with and without the
residual add. It also compiles for sm_90 here, in a child interpreter without TRITON_INTERPRET: for bf16 rows of the
27B's 5,120 values, 16-byte loads and stores and no register spills. The GPU run (bf16, the 27B shape, graph replay)
is in tests/test_kernels_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from ignis.kernels import fused, norm_triton
from ignis.kernels.fused import add_rms_norm_reference

from tests.sm90 import run_child

if torch.cuda.is_available():
    pytest.skip("the interpreter takes CPU tensors: tests/test_kernels_gpu.py runs these", allow_module_level=True)


def rows(t: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, n, generator=g) * 3.0
    d = torch.randn(t, n, generator=g)
    scale = torch.rand(n, generator=g) + 0.5
    return x, d, scale


@pytest.mark.parametrize("t,n", [(1, 384), (3, 100), (8, 5120), (2, 33)])
@pytest.mark.parametrize("add", [True, False])
def test_matches_the_reference(t: int, n: int, add: bool) -> None:
    x, d, scale = rows(t, n, seed=t * 1000 + n)
    resid, normed = norm_triton.add_rms_norm(x, d if add else None, scale, 1e-6)
    want_resid, want_normed = add_rms_norm_reference(x, d if add else None, scale, 1e-6)
    assert torch.equal(resid, want_resid)  # an fp32 add is an fp32 add
    torch.testing.assert_close(normed, want_normed, rtol=2e-6, atol=2e-6)  # only the sum of squares' order differs
    if not add:
        assert resid is x


def test_a_row_does_not_depend_on_the_others() -> None:
    x, d, scale = rows(6, 384, seed=7)
    _, alone = norm_triton.add_rms_norm(x[4:5].contiguous(), d[4:5].contiguous(), scale, 1e-6)
    _, together = norm_triton.add_rms_norm(x, d, scale, 1e-6)
    assert torch.equal(alone[0], together[4])


def test_empty_and_bad_inputs() -> None:
    x, d, scale = rows(0, 64, seed=1)
    resid, normed = norm_triton.add_rms_norm(x, d, scale, 1e-6)
    assert resid.shape == normed.shape == (0, 64)
    x, d, scale = rows(2, 64, seed=1)
    with pytest.raises(ValueError, match="contiguous x and d"):
        norm_triton.add_rms_norm(x[:, ::2], None, scale[::2].contiguous(), 1e-6)
    with pytest.raises(ValueError, match="float32 scale"):
        norm_triton.add_rms_norm(x, d, scale.double(), 1e-6)
    with pytest.raises(ValueError, match="contiguous x and d"):
        norm_triton.add_rms_norm(x, d[:1], scale, 1e-6)


@pytest.mark.parametrize("add", [True, False])
def test_round_first_is_the_qwen3_norm_of_the_drafter(add: bool) -> None:
    """round_first: w * (x / rms(x)) with the normalised row rounded before the weight, as the dflash2 drafter's
    Qwen3 norm computes it (the weight in the model dtype)."""
    from ignis.backends.dflash2.model import Norm

    x, d, _ = rows(3, 384, seed=11)
    norm = Norm(384, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(384) + 0.5)
    resid, normed = norm_triton.add_rms_norm(x, d if add else None, norm.weight.detach(), 1e-6, round_first=True)
    want = x + d if add else x
    assert torch.equal(resid, want)
    with torch.no_grad():
        torch.testing.assert_close(normed, norm(want), rtol=2e-6, atol=2e-6)
    with pytest.raises(ValueError, match="float32 scale"):
        norm_triton.add_rms_norm(x, None, norm.weight.detach().double(), 1e-6, round_first=True)


@pytest.mark.parametrize("rows_per_block,group", [(8, 16), (3, 4)])
def test_conv_of_d_joined_to_the_norm_is_the_grouped_conv_then_the_norm(rows_per_block: int, group: int) -> None:
    """conv: d first takes DFlash2's side-1 grouped conv over its block's rows (fused.grouped_conv's arithmetic), the
    dyn coefficients read through the strided view GroupedConv.prepare leaves; the result is the grouped conv's
    output added and normed, bit for bit in the residual."""
    from ignis.backends.dflash2.model import Norm
    from ignis.kernels.fused import grouped_conv_reference

    blocks, n = 2, 64
    t = blocks * rows_per_block
    x, d, _ = rows(t, n, seed=rows_per_block)
    g = torch.Generator().manual_seed(5)
    base = torch.randn(2, 2, n, generator=g) * 0.5 + 1.0  # [side, tap, n], as GroupedConv.base_kernel
    dyn = torch.randn(blocks, rows_per_block, 2, 2, n // group, generator=g)  # [n, B, side, tap, groups]
    norm = Norm(n, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(n, generator=g) + 0.5)
    conv = norm_triton.Conv(base[1], dyn[:, :, 1], group, rows_per_block)
    resid, normed = norm_triton.add_rms_norm(x, d, norm.weight.detach(), 1e-6, round_first=True, conv=conv)
    convolved = grouped_conv_reference(d.view(blocks, rows_per_block, n), base[1], dyn[:, :, 1], group).view(t, n)
    want_resid, want_normed = norm_triton.add_rms_norm(x, convolved.contiguous(), norm.weight.detach(), 1e-6,
                                                       round_first=True)
    assert torch.equal(resid, want_resid) and torch.equal(normed, want_normed)
    # a block's first row sees no row before it: the rows of the first block alone give the same
    alone = norm_triton.add_rms_norm(x[:rows_per_block].contiguous(), d[:rows_per_block].contiguous(),
                                     norm.weight.detach(), 1e-6, round_first=True,
                                     conv=norm_triton.Conv(base[1], dyn[:1, :, 1], group, rows_per_block))
    assert torch.equal(alone[0], resid[:rows_per_block])


def test_conv_shapes_are_checked() -> None:
    x, d, _ = rows(8, 64, seed=2)
    weight = torch.rand(64) + 0.5
    dyn = torch.randn(1, 8, 2, 2, 4)
    with pytest.raises(ValueError, match="conv convolves d"):
        norm_triton.add_rms_norm(x, None, weight, 1e-6, round_first=True,
                                 conv=norm_triton.Conv(torch.ones(2, 64), dyn[:, :, 1], 16, 8))
    with pytest.raises(ValueError, match="base \\[2, 64\\]"):  # three taps: not this kernel's
        norm_triton.add_rms_norm(x, d, weight, 1e-6, round_first=True,
                                 conv=norm_triton.Conv(torch.ones(3, 64), dyn[:, :, 1], 16, 8))
    with pytest.raises(ValueError, match="group 16, rows 3"):  # 8 rows are not blocks of 3
        norm_triton.add_rms_norm(x, d, weight, 1e-6, round_first=True,
                                 conv=norm_triton.Conv(torch.ones(2, 64), dyn[:, :, 1], 16, 3))


def test_warps_grow_with_the_row() -> None:
    assert [norm_triton.warps(n) for n in (33, 384, 1024, 2048, 5120, 8192, 65536)] == [1, 2, 4, 8, 16, 16, 16]


def test_cpu_tensors_keep_the_reference() -> None:
    """fused.add_rms_norm runs the reference on the CPU (the exact mode's arithmetic), whatever is installed."""
    x, d, scale = rows(2, 64, seed=3)
    got = fused.add_rms_norm(x, d, scale, 1e-6)
    want = add_rms_norm_reference(x, d, scale, 1e-6)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("t,n", [(1, 384), (5, 100), (8, 64)])
def test_the_pair_is_both_norms_side_by_side(t: int, n: int) -> None:
    """rms_norm_pair: the MTP layer's two input norms and their concatenation in one launch, each half the reference
    norm of its rows with its own scale, a row's result its own whatever rows share the call."""
    a, b, scale_a = rows(t, n, seed=n + t)
    scale_b = torch.rand(n, generator=torch.Generator().manual_seed(t)) + 0.5
    got = norm_triton.rms_norm_pair(a, b, scale_a, scale_b, 1e-6)
    want = fused.rms_norm_pair_reference(a, b, scale_a, scale_b, 1e-6)
    assert got.shape == (t, 2 * n)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    _, alone_a = norm_triton.add_rms_norm(a, None, scale_a, 1e-6)
    _, alone_b = norm_triton.add_rms_norm(b, None, scale_b, 1e-6)
    assert torch.equal(got, torch.cat([alone_a, alone_b], dim=-1))  # add_rms_norm's arithmetic, bit for bit
    last = norm_triton.rms_norm_pair(a[-1:].contiguous(), b[-1:].contiguous(), scale_a, scale_b, 1e-6)
    assert torch.equal(last[0], got[-1])
    assert norm_triton.rms_norm_pair(a[:0], b[:0], scale_a, scale_b, 1e-6).shape == (0, 2 * n)
    with pytest.raises(ValueError, match="of one dtype"):
        norm_triton.rms_norm_pair(a, b.double(), scale_a, scale_b, 1e-6)
    with pytest.raises(ValueError, match="float32"):
        norm_triton.rms_norm_pair(a, b, scale_a, scale_b.double(), 1e-6)
    assert torch.equal(fused.rms_norm_pair(a, b, scale_a, scale_b, 1e-6), want)  # the CPU keeps the reference


def test_the_pairs_first_half_may_be_rows_of_a_table() -> None:
    """With ids, rms_norm_pair reads row ids[t] of a table for its first half (the MTP layer's embedding lookup in
    the norms' launch): bit for bit the pair of the gathered rows, repeated and unordered ids included."""
    table, b, scale_a = rows(11, 100, seed=3)
    b = b[:6].contiguous()
    scale_b = torch.rand(100, generator=torch.Generator().manual_seed(4)) + 0.5
    ids = torch.tensor([7, 0, 7, 10, 3, 3])
    got = norm_triton.rms_norm_pair(table, b, scale_a, scale_b, 1e-6, ids=ids)
    assert torch.equal(got, norm_triton.rms_norm_pair(table[ids].contiguous(), b, scale_a, scale_b, 1e-6))
    want = fused.rms_norm_pair_reference(table[ids], b, scale_a, scale_b, 1e-6)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    assert torch.equal(fused.rms_norm_pair(table, b, scale_a, scale_b, 1e-6, ids=ids), want)  # the CPU: reference
    with pytest.raises(ValueError, match="ids"):
        norm_triton.rms_norm_pair(table, b, scale_a, scale_b, 1e-6, ids=ids[:5])
    with pytest.raises(ValueError, match="ids"):
        norm_triton.rms_norm_pair(table, b, scale_a, scale_b, 1e-6, ids=ids.int())


COMPILE = r"""
import triton
from ignis.kernels.norm_triton import _add_rms_norm, warps
from tests.sm90 import build, spills

for elt, n in (("bf16", 5120), ("bf16", 384), ("fp32", 5120)):
    for add in (True, False):
        types = {"x_ptr": "*" + elt, "d_ptr": "*" + elt, "scale_ptr": "*fp32", "resid_ptr": "*" + elt,
                 "normed_ptr": "*" + elt, "eps": "fp32"}
        for pdl in (False, True):
            consts = {"ADD": add, "ROUND_FIRST": False, "BLOCK": triton.next_power_of_2(n), "PDL": pdl, "CONV": False}
            kernel = build(_add_rms_norm, types, consts, ("n",), warps(n), 3)
            ptx = kernel.asm["ptx"]
            assert ".target sm_90a" in ptx
            if n == 5120:
                assert "ld.global.v4" in ptx and "st.global.v4" in ptx, (elt, add)  # 16-byte accesses
            assert ("griddepcontrol.wait" in ptx) == pdl and spills(kernel) == 0, (elt, n, add, pdl)
            if pdl:  # the scale ahead of the wait, the stores after it
                wait = ptx.index("griddepcontrol.wait")
                assert "ld.global" in ptx[:wait] and "st.global" not in ptx[:wait]
            print("ok", elt, n, add, pdl)
# the drafter's norms with the side-1 conv of d joined (27B drafter width, bf16)
types = {"x_ptr": "*bf16", "d_ptr": "*bf16", "scale_ptr": "*bf16", "resid_ptr": "*bf16", "normed_ptr": "*bf16",
         "eps": "fp32", "base_ptr": "*bf16", "dyn_ptr": "*bf16"}
for pdl in (False, True):
    consts = {"ADD": True, "ROUND_FIRST": True, "BLOCK": 8192, "PDL": pdl, "CONV": True}
    kernel = build(_add_rms_norm, types, consts, ("n", "dyn_stride"), warps(5120), 3)
    assert ("griddepcontrol.wait" in kernel.asm["ptx"]) == pdl and spills(kernel) == 0, pdl
    print("ok conv", pdl)
# the MTP layer's two input norms side by side (27B hidden size, bf16)
from ignis.kernels.norm_triton import _rms_norm_pair
types = {"a_ptr": "*bf16", "b_ptr": "*bf16", "scale_a_ptr": "*fp32", "scale_b_ptr": "*fp32", "out_ptr": "*bf16",
         "eps": "fp32"}
for ids in (False, True):
    kernel = build(_rms_norm_pair, types | {"ids_ptr": "*i64"}, {"BLOCK": 8192, "IDS": ids}, ("n",), warps(5120), 3)
    ptx = kernel.asm["ptx"]
    assert "ld.global.v4" in ptx and "st.global.v4" in ptx and spills(kernel) == 0
    print("ok pair", ids)
"""


def test_kernel_compiles_for_sm90_with_vector_accesses() -> None:
    assert run_child(COMPILE).count("ok") == 16
