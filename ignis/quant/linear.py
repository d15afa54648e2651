"""The packed 4-bit linear: `PackedWeight` (what a quantized projection's `.weight` is), `QuantLinear` (the module
that holds it under the checkpoint's names) and `packed_linear`, the one function every product with a packed
weight goes through, on the host round and the device round alike.

Owns: the product x @ W^T for a packed W, and joining packed weights by rows (`fuse_rows` for quantized models).
Does not own: the format (ignis.quant.format) or deciding which layers are packed (ignis.model.loader).

`packed_linear` on CUDA with at most 64 rows runs a 4-bit GEMV/GEMM kernel (one pass over the packed weight, fp32
sums, capturable): `KERNEL` says which, numba-cuda on CUDA cores (ignis.kernels.int4_gemv) or Triton on tensor cores
(ignis.kernels.int4_triton, imported only when chosen); elsewhere (the CPU, prefill-sized inputs) it dequantizes the
weight and calls F.linear, the reference (exact by construction, on any device, capturable since nothing is read back).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn

from ignis.kernels.int4_gemv import MAX_ROWS, int4_gemv
from ignis.kernels.launch import triton_installed
from ignis.quant.format import dequantize

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
Kernel = Literal["auto", "numba", "triton", "reference"]
KERNEL: Kernel = "auto"


def set_kernel(kernel: Kernel) -> None:
    """Which product `packed_linear` runs for CUDA inputs of at most MAX_ROWS rows, for the whole process
    (tools.bench_quant compares them): "auto" (`auto_kernel`), "numba", "triton", or "reference" (dequantize +
    F.linear)."""
    global KERNEL
    if kernel not in get_args(Kernel):
        raise ValueError(f"kernel must be one of {', '.join(get_args(Kernel))}, got {kernel!r}")
    KERNEL = kernel


@dataclass(frozen=True)
class PackedWeight:
    """A 4-bit weight [out, in]: codes, scales and zero points (ignis.quant.format), rows views of one storage when
    fused."""

    qweight: torch.Tensor  # [out, in/2] uint8
    scales: torch.Tensor  # [out, in/group] model dtype
    qzeros: torch.Tensor  # [out, in/group] uint8

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.qweight.shape[0], 2 * self.qweight.shape[1]))

    @property
    def dtype(self) -> torch.dtype:
        return self.scales.dtype

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.qweight, self.scales, self.qzeros, self.scales.dtype)

    def __getitem__(self, rows: slice) -> PackedWeight:
        return PackedWeight(self.qweight[rows], self.scales[rows], self.qzeros[rows])


def auto_kernel() -> Kernel:
    """The Triton kernel where triton is installed: on the H200 at the 27B shapes it ran 1.1-1.2x the numba kernel's
    speed at one row, 3.2-3.5x at 8 and 5.6-6.6x at 16 (BENCHMARKS.md); the numba kernel otherwise."""
    return "triton" if triton_installed() else "numba"


def packed_linear(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """x [..., in] @ W^T -> [..., out] for a packed W: the chosen kernel (`set_kernel`) for CUDA inputs of at most
    MAX_ROWS rows (both sum the exact (q - z) * x in fp32), otherwise F.linear on the weight dequantized to its
    dtype."""
    kernel = auto_kernel() if KERNEL == "auto" else KERNEL
    if kernel != "reference" and x.is_cuda and x.dtype in KERNEL_DTYPES and x.numel() <= MAX_ROWS * x.shape[-1]:
        if kernel == "triton":
            from ignis.kernels.int4_triton import int4_triton

            return int4_triton(x, weight.qweight, weight.scales, weight.qzeros)
        return int4_gemv(x, weight.qweight, weight.scales, weight.qzeros)
    return F.linear(x, weight.dequantize())


class QuantLinear(nn.Module):
    """A bias-free linear whose weight is stored packed (state dict: qweight, scales, qzeros)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    qzeros: torch.Tensor

    def __init__(self, in_features: int, out_features: int, group: int) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.register_buffer("qweight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.zeros(out_features, in_features // group, dtype=torch.float16))
        self.register_buffer("qzeros", torch.zeros(out_features, in_features // group, dtype=torch.uint8))

    @property
    def weight(self) -> PackedWeight:
        return PackedWeight(self.qweight, self.scales, self.qzeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.weight)


def fuse_packed(linears: tuple[QuantLinear, ...]) -> PackedWeight:
    """One packed weight holding the rows of `linears`, which keep their buffers as views of it (no extra memory)."""
    joined = PackedWeight(*(torch.cat([getattr(m, name) for m in linears]) for name in ("qweight", "scales", "qzeros")))
    offset = 0
    for m in linears:
        rows = slice(offset, offset + m.out_features)
        m.qweight, m.scales, m.qzeros = joined.qweight[rows], joined.scales[rows], joined.qzeros[rows]
        offset += m.out_features
    return joined
