"""The 16-bit weight-streaming product for the 1 to 64 rows of decode and verify rounds: x [rows, in] @ W^T for a bf16
or fp16 W as the model holds it (row-major, no repacking), on mma.sync with the weight as the 16-row operand.

Owns: `fits` (the weights it takes), `choose` (its split of the input) and `dense_mma` (the launch on torch's current
stream, capturable). Does not own: the kernel body (ignis.kernels.int4_mma_kernel, its DENSE form), the launch shape
and the launch it shares with the 4-bit product (ignis.kernels.int4_mma: `Shape`, `launch`, `product`), compiling
(ignis.kernels.nvrtc), or when this kernel runs (ignis.model.ops.linear).

Why: cuBLAS runs a round's products at 1.08-1.18x their bytes' time on the H200 (BENCHMARKS.md, "where an 8 x 8
verify's time goes"); the products are nine tenths of a 27B round. This kernel streams each weight once from DRAM with
its next steps' loads in flight, splits the input over warps and blocks where the weight has few output rows (the
split's partial sums meet in a workspace through self-resetting counters, no memset or reduction launch), and with
programmatic dependent launch loads its first steps of weight before the kernel ahead of it ends.

Numerics: every product of two 16-bit values is exact and every sum fp32 on the tensor cores; the result is rounded
once to x's dtype. It differs from F.linear only by the order of fp32 additions, and a row's result does not depend on
how many rows share the call (the split comes from the weight's shape alone).
"""

from __future__ import annotations

from functools import lru_cache

import torch
from ignis.kernels.int4_mma import MAX_ROWS, Shape, launch, product, row_tiles, swiglu_launch
from ignis.kernels.int4_mma import choose as split
from ignis.kernels.launch import sm_count

AIM_WARPS_PER_SM = 12  # what the input split aims at for a 16-bit weight (four times the bytes a chunk of the 4-bit)


def fits(nout: int, ncols: int) -> bool:
    """Whether a weight [nout, ncols] can stream through the kernel: whole 16-feature blocks and 64-column chunks."""
    return nout % 16 == 0 and ncols % 64 == 0 and nout > 0 and ncols > 0


@lru_cache(maxsize=1024)
def choose(nout: int, ncols: int, sms: int, aim: int = AIM_WARPS_PER_SM) -> Shape:
    """The split of the input for a weight's shape, which fixes the order of its sums: int4_mma.choose's for a weight
    without groups, aiming at `aim` warps an SM."""
    return split(nout, ncols, 64, sms, aim)


def dense_mma(x: torch.Tensor, weight: torch.Tensor, shape: Shape | None = None, swiglu: bool = False) -> torch.Tensor:
    """x [..., in] @ weight^T -> [..., out] for x and weight [out, in] of one 16-bit dtype on one CUDA device, at most
    MAX_ROWS rows; weight contiguous and `fits`. `shape` overrides the launch (benchmarks; its KW and unit change the
    order of the sums). With `swiglu`, weight is an MLP's fused gate | up [2 I, in] (I a multiple of 16) and the
    result is silu(gate) * up [..., I], as the SwiGLU kernel makes it from the product's output. Asynchronous, on
    torch's current stream; no host read; allocates the output."""
    nout, ncols = weight.shape
    if (x.dtype != weight.dtype or x.dtype not in (torch.bfloat16, torch.float16) or x.shape[-1] != ncols
            or not x.is_cuda or weight.device != x.device or x.numel() > MAX_ROWS * ncols or not fits(nout, ncols)
            or not weight.is_contiguous() or weight.data_ptr() % 16):
        raise ValueError(f"dense_mma takes x [..., {ncols}] of at most {MAX_ROWS} rows and a contiguous weight "
                         f"[out, in] (out % 16 == 0, in % 64 == 0) of one 16-bit dtype on one CUDA device; got x "
                         f"{tuple(x.shape)} {x.dtype} on {x.device}, weight {tuple(weight.shape)} {weight.dtype}")
    base = choose(nout, ncols, sm_count(x.device))
    return product(x, weight, weight, nout, 64, x.dtype, base, shape, swiglu, dense=True)


def swiglu_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `dense_mma(x, weight, swiglu=True)` has a launch at x's rows: the KW warps' partial sums of a gate block
    and its up partner fit in shared memory."""
    nout, ncols = weight.shape
    nt = row_tiles(max(1, x.numel() // ncols))
    return swiglu_launch(launch(choose(nout, ncols, sm_count(x.device)), nt), nt) is not None
