"""The Triton SwiGLU (ignis.kernels.swiglu_triton) against the torch reference.

Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET) on CPU tensors in
fp32, at widths that are and are not multiples of the program's block. It also compiles for sm_90 here, in a child
interpreter without TRITON_INTERPRET, with 16-byte loads and stores of bf16. The GPU run (bf16, the 27B shape, graph
replay) is tests/test_kernels_gpu.py's fused-kernel test, through ignis.kernels.fused.swiglu.
"""

from __future__ import annotations

import pytest
import torch
from ignis.kernels import swiglu_triton
from ignis.kernels.fused import swiglu_reference

from tests.sm90 import run_child

if torch.cuda.is_available():
    pytest.skip("the interpreter takes CPU tensors: tests/test_kernels_gpu.py runs these", allow_module_level=True)


@pytest.mark.parametrize("t,inner", [(1, 1024), (3, 1500), (8, 2048 + 7), (2, 5)])
def test_matches_the_reference(t: int, inner: int) -> None:
    g = torch.Generator().manual_seed(t * 100 + inner)
    gu = torch.randn(t, 2 * inner, generator=g) * 4.0
    torch.testing.assert_close(swiglu_triton.swiglu(gu), swiglu_reference(gu), rtol=2e-6, atol=2e-6)


def test_empty_and_bad_inputs() -> None:
    assert swiglu_triton.swiglu(torch.zeros(0, 8)).shape == (0, 4)
    with pytest.raises(ValueError, match="gate | up"):
        swiglu_triton.swiglu(torch.zeros(2, 7))
    with pytest.raises(ValueError, match="contiguous"):
        swiglu_triton.swiglu(torch.zeros(8, 2).t())


COMPILE = r"""
from ignis.kernels.swiglu_triton import BLOCK, _swiglu
from tests.sm90 import build, spills

for pdl in (False, True):
    kernel = build(_swiglu, {"gu": "*bf16", "y": "*bf16"}, {"BLOCK": BLOCK, "PDL": pdl}, ("inner",), 4, 3)
    ptx = kernel.asm["ptx"]
    assert "ld.global.v4" in ptx and "st.global.v4" in ptx and spills(kernel) == 0
    if pdl:  # the next kernel released first, then the wait, then every access
        trigger, wait = ptx.index("griddepcontrol.launch_dependents"), ptx.index("griddepcontrol.wait")
        assert trigger < wait < ptx.index("ld.global")
    else:
        assert "griddepcontrol" not in ptx
    print("ok", pdl)
"""


def test_kernel_compiles_for_sm90_with_vector_accesses() -> None:
    assert run_child(COMPILE).count("ok") == 2
