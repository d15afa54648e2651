"""Exact top-k over the last dimension of logits: the numba-cuda kernel on CUDA tensors, the torch reference on CPU.

Owns: the public `topk(x, k)`, the reference `topk_reference(x, k)`, the order both follow and the argument checks.
Does not own: the kernel (ignis.kernels.topk_kernel) or how it is launched (ignis.kernels.topk_launch); nor sampling
from the result (ignis.engine / ignis.backends).

The order, identical on every device and for every way the kernel splits a row:
- larger value first; equal values by smaller column (a stable descending sort);
- -0.0 and +0.0 are equal (so they tie, and the smaller column wins);
- every NaN ranks above +inf (as in torch.topk), NaNs among themselves by smaller column;
- returned values are the input's own elements, bit for bit (a -0.0 stays -0.0, NaN payloads are kept).
torch.topk gives the same values but leaves the order of tied columns unspecified.
"""

from __future__ import annotations

import torch

from ignis.errors import InputError

MAX_K = 64  # the kernel keeps at most two list registers (ranks 0..63) per lane
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def topk_reference(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., V] floating, any device. Returns (values [..., k] x.dtype, ids [..., k] int64) in the order above.

    A stable descending sort of float64 copies: every fp32/bf16/fp16 value is exact there, -0.0 is folded into +0.0,
    +inf moves to the largest finite float64 (still above every fp32) so that NaN can take +inf's place.
    """
    v = x.to(torch.float64)  # [..., V] float64, x.device
    v = torch.where(v == 0, 0.0, v)
    v = torch.where(v == torch.inf, torch.finfo(torch.float64).max, v)
    v = torch.where(torch.isnan(v), torch.inf, v)
    ids = torch.sort(v, dim=-1, descending=True, stable=True).indices[..., :k]  # [..., k] int64, x.device
    return x.gather(-1, ids), ids


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries of every row of x [..., V], any floating dtype, any device.

    Returns values [..., k] x.dtype and ids [..., k] int64, largest first, ties to the smaller id; exactly what
    `topk_reference` returns, on every device. 1 <= k <= min(V, MAX_K). float32 and bfloat16 CUDA tensors go to the
    kernel, everything else to the reference. The kernel call is asynchronous, runs on torch's current stream, and
    may be captured in a CUDA graph once it has run outside capture for that dtype and for k <= 32 or k > 32 (the
    first such call compiles the kernel and loads it on the device).
    """
    if not x.is_floating_point() or x.dim() == 0:
        raise InputError("x", f"top-k needs a floating tensor of at least one dimension, got {x.dtype} {tuple(x.shape)}")
    ncols = x.shape[-1]
    if not 1 <= k <= min(ncols, MAX_K):
        raise InputError("k", f"must be in 1..{min(ncols, MAX_K)} (the row length {ncols}, at most {MAX_K}), got {k}")
    if not x.is_cuda or x.dtype not in _KERNEL_DTYPES:
        return topk_reference(x, k)
    from ignis.kernels.topk_launch import topk_cuda

    lead = x.shape[:-1]
    rows = x.reshape(-1, ncols)  # a view whenever the leading dims allow one
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if x.device.index is not None and x.device.index != torch.cuda.current_device():
        with torch.cuda.device(x.device):
            vals, ids = topk_cuda(rows, k, MAX_K)
    else:
        vals, ids = topk_cuda(rows, k, MAX_K)
    return vals.reshape(*lead, k), ids.reshape(*lead, k)
