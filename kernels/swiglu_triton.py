"""SwiGLU in Triton: `swiglu`, silu(gate) * up over each row of a fused gate | up projection.

Owns: the kernel and its launch on torch's current stream (Triton launches there), allocating only the output, so a
CUDA graph captures it. Does not own: the torch reference (ignis.kernels.fused.swiglu_reference), the numba kernel it
replaces where Triton is installed (ignis.kernels.fused_kernel), or when it runs (ignis.kernels.fused).

Why: a verify round's MLP rows are a few thousand values wide and up to 64 deep; the numba kernel moves one value a
thread, so a launch is many small loads in flight per byte. Here a program moves BLOCK values of a row as 16-byte
vectors. Arithmetic is the reference's: silu of the gate in fp32 rounded to the model dtype (torch's silu on a bf16
tensor), then its product with up rounded. With ignis.kernels.launch.PDL on a Hopper GPU it launches programmatic-
dependent and lets the next kernel launch at once (ignis.kernels.gemv_triton loads its weight meanwhile).

Importing this module imports triton. Without a GPU, TRITON_INTERPRET=1 runs the kernel in Triton's interpreter on CPU
tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ignis.kernels.launch import pdl

BLOCK = 1024  # values of a row a program: 8 a thread over 4 warps (16-byte bf16 vectors)


@triton.jit
def _swiglu(gu, y, inner, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    # gu [T, 2 inner] model dtype contiguous: gate | up; y [T, inner] model dtype contiguous
    if PDL:  # the next kernel (the down projection, streaming its weight) may launch now; gu only after the wait
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    part, row = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i = part * BLOCK + tl.arange(0, BLOCK)
    ok = i < inner
    g = tl.load(gu + row * 2 * inner + i, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu + row * 2 * inner + inner + i, mask=ok, other=0.0).to(tl.float32)
    out = y.dtype.element_ty
    s = (g / (1.0 + tl.exp(-g))).to(out).to(tl.float32)
    tl.store(y + row * inner + i, (s * u).to(out), mask=ok)


def swiglu(gu: torch.Tensor) -> torch.Tensor:
    """gu [T, 2 I] contiguous (gate | up) -> silu(gate) * up [T, I], one launch."""
    t, width = gu.shape
    if width % 2 or not gu.is_contiguous():
        raise ValueError(f"swiglu takes a contiguous [T, 2 I] gate | up; got {tuple(gu.shape)}")
    inner = width // 2
    y = torch.empty((t, inner), dtype=gu.dtype, device=gu.device)
    if t and inner:
        early = {"PDL": True, "launch_pdl": True} if pdl(gu.device) else {}
        _swiglu[(triton.cdiv(inner, BLOCK), t)](gu, y, inner, BLOCK=BLOCK, num_warps=4, **early)
    return y
