"""The Gated DeltaNet's fused short conv of a decode or a verify as a CUDA C++ kernel (NVRTC): `conv`, `fits`.

Owns: the launch of ignis.kernels.conv_cuda_kernel's `gdn_conv` on torch's current stream (capturable), its argument
checks and which calls it takes (`fits`). Does not own: the source (ignis.kernels.conv_cuda_kernel), the numba kernel
it stands beside or the torch reference both are tested against (ignis.kernels.fused: `conv`, `conv_reference`), or
the switch that routes to it (`ignis.kernels.fused.CUDA_CONV`).
"""

from __future__ import annotations

import torch

from ignis.kernels.conv_cuda_kernel import CMAX, SOURCE
from ignis.kernels.launch import gdn_pdl, nvrtc_installed
from ignis.kernels.nvrtc import load


def threads(dk: int) -> int:
    """A block's threads: one a channel of a key head, a power of two of at least a warp."""
    return max(32, 1 << (dk - 1).bit_length())


def defines(dtype: torch.dtype, dk: int, taps: int, early: bool = False) -> tuple[tuple[str, int], ...]:
    """The source's sizes; early: launched programmatic-dependent (launch.gdn_pdl)."""
    return (("DKT", threads(dk)), ("KC", taps), ("CMAX", CMAX), ("BF16", int(dtype == torch.bfloat16)),
            ("PDL", int(early)))


def fits(raw: torch.Tensor, window: torch.Tensor, record: torch.Tensor | None, ba: torch.Tensor, weight: torch.Tensor,
         dk: int) -> bool:
    """The calls the kernel takes: CUDA bf16 or fp32 inputs of 1..CMAX columns whose last dimensions are contiguous
    (the weight wholly), key heads of at most 1,024 channels, with NVRTC installed."""
    c = raw.shape[1]
    return (raw.is_cuda and raw.dtype in (torch.bfloat16, torch.float32) and 1 <= c <= CMAX and dk <= 1024
            and all(t.stride(-1) == 1 for t in (raw, window, ba) + ((record,) if record is not None else ()))
            and weight.is_contiguous() and nvrtc_installed())


def conv(
    window: torch.Tensor,  # [L, Kc-1, D] model dtype
    lanes: torch.Tensor,  # [B] int64
    raw: torch.Tensor,  # [B, C, D] model dtype, last dim contiguous
    weight: torch.Tensor,  # [D, Kc] float32 contiguous
    ba: torch.Tensor,  # [B, C, 2 Hv] model dtype, last dim contiguous
    record: torch.Tensor | None,  # [L, C', D] model dtype, C' >= C: a verify's inputs; None: move the window
    *,
    key_heads: int,
    dk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ignis.kernels.fused.conv's result for `fits`'s calls: (mixed [B, C, D] float32, ba [B, C, 2 Hv] float32)."""
    b, c, dim = raw.shape
    if not fits(raw, window, record, ba, weight, dk):
        raise ValueError(f"conv_cuda.conv takes CUDA bf16 or fp32 inputs of 1..{CMAX} columns with contiguous last "
                         f"dimensions; got raw {tuple(raw.shape)} {raw.dtype} strides {raw.stride()}")
    mixed = torch.empty((b, c, dim), dtype=torch.float32, device=raw.device)
    ba_out = torch.empty(ba.shape, dtype=torch.float32, device=raw.device)
    rec = record if record is not None else window  # a placeholder of the right type when nothing is recorded
    strides = (*window.stride()[:2], *raw.stride()[:2], *rec.stride()[:2], *ba.stride()[:2])
    if max(strides) >= 2**31:
        raise ValueError(f"conv_cuda.conv takes strides below 2**31 (the kernel's int offsets); got {strides}")
    early = gdn_pdl(raw.device)
    kernel = load(SOURCE, "gdn_conv", defines(raw.dtype, dk, weight.shape[1], early), raw.device)
    kernel(((dim + dk - 1) // dk, b, 1), threads(dk),  # type: ignore[operator]
           (window, lanes, raw, weight, mixed, rec, ba, ba_out, c, dim, dk, 2 * key_heads, dk**-0.5,
            int(record is not None), *strides, ba.shape[2]), early)
    return mixed, ba_out
