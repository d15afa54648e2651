"""The packed 4-bit linear: `PackedWeight` (what a quantized projection's `.weight` is), `Permuted` (one whose input
columns are held in another order, an act-order checkpoint's), `QuantLinear` (the module that holds it under the
checkpoint's names) and `packed_linear`, the one function every product with a packed weight goes through, on the
host round and the device round alike.

Owns: the product x @ W^T for a packed W, and joining packed weights by rows (`fuse_rows` for quantized models).
Does not own: the format (ignis.quant.format) or deciding which layers are packed (ignis.model.loader).

`packed_linear` on CUDA with at most 64 rows runs a 4-bit GEMV/GEMM kernel (one pass over the packed weight, fp32
sums, capturable): `KERNEL` says which. "mma" (the default where cuda-python's NVRTC is installed) needs the weight
repacked into the tensor cores' register order (`repack`, which the loader runs on a CUDA model, so the weight is held
once, in that order: ignis.kernels.int4_mma); the others take the format's codes: Triton on tensor cores
(ignis.kernels.int4_triton, imported only when chosen) or numba-cuda on CUDA cores (ignis.kernels.int4_gemv).
Elsewhere (the CPU, prefill-sized inputs) it dequantizes the weight and calls F.linear, the reference (exact by
construction, on any device, capturable since nothing is read back).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn

from ignis.kernels import int4_mma
from ignis.kernels.int4_gemv import MAX_ROWS, int4_gemv
from ignis.kernels.int4_mma import MmaCodes
from ignis.kernels.launch import nvrtc_installed, sm_count, triton_installed
from ignis.quant.format import dequantize, pack, unpack

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
Kernel = Literal["auto", "mma", "numba", "triton", "reference"]
KERNEL: Kernel = "auto"


def set_kernel(kernel: Kernel) -> None:
    """Which product `packed_linear` runs for CUDA inputs of at most MAX_ROWS rows, for the whole process
    (tools.bench_quant compares them): "auto" (`auto_kernel`), "mma" (for weights `repack`ed: a model loads repacked
    when this is the kernel), "numba", "triton", or "reference" (dequantize + F.linear)."""
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


@dataclass(frozen=True)
class Permuted:
    """A packed weight [out, in] whose held input column j is the checkpoint's column `order[j]` (an act-order
    checkpoint's columns sorted by group, ignis.quant.published.act_order): its product takes x's columns in that
    order first, one gather ahead of the 4-bit kernel."""

    weight: PackedWeight | MmaCodes
    order: torch.Tensor  # int32 [in], on the weight's device

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    def dequantize(self) -> torch.Tensor:
        """The weight [out, in] with its columns in the checkpoint's order."""
        held = self.weight.dequantize()
        w = torch.empty_like(held)
        w[:, self.order.long()] = held
        return w

    def __getitem__(self, rows: slice) -> Permuted:
        return Permuted(self.weight[rows], self.order)


PACKED = (PackedWeight, MmaCodes, Permuted)  # the 4-bit weights `packed_linear` takes


def auto_kernel() -> Kernel:
    """The mma kernel where cuda-python's NVRTC is installed: on the H200 at the 27B shapes it ran 1.2-2.2x the
    floor at 1 to 8 rows against the Triton kernel's 2.3-3.3x (BENCHMARKS.md); else the Triton kernel where triton is
    installed (1.1-1.2x the numba kernel's speed at one row, 3.2-3.5x at 8); else the numba kernel."""
    return "mma" if nvrtc_installed() else "triton" if triton_installed() else "numba"


def chosen() -> Kernel:
    return auto_kernel() if KERNEL == "auto" else KERNEL


def packed_linear(x: torch.Tensor, weight: PackedWeight | MmaCodes | Permuted) -> torch.Tensor:
    """x [..., in] @ W^T -> [..., out] for a packed W: the chosen kernel (`set_kernel`) for CUDA inputs of at most
    MAX_ROWS rows (every kernel sums the exact (q - z) * x in fp32), otherwise F.linear on the weight dequantized to
    its dtype. A repacked weight (MmaCodes) runs the mma kernel whatever the choice (it has no other layout); the
    format's codes with "mma" chosen (a shape it does not take) run the Triton kernel, or the numba one. A Permuted
    weight gathers x's columns into its order first."""
    if isinstance(weight, Permuted):
        return packed_linear(x.index_select(-1, weight.order), weight.weight)
    small = x.is_cuda and x.numel() <= MAX_ROWS * x.shape[-1]
    if isinstance(weight, MmaCodes):
        if small and x.dtype == weight.dtype:
            return int4_mma.int4_mma(x, weight)
        return F.linear(x, weight.dequantize().to(x.dtype))
    kernel = chosen()
    if kernel == "mma":  # the format's codes, not repacked (a shape the mma kernel does not take): the next best
        kernel = "triton" if triton_installed() else "numba"
    if kernel in ("numba", "triton") and small and x.dtype in KERNEL_DTYPES:
        if kernel == "triton":
            from ignis.kernels.int4_triton import int4_triton

            return int4_triton(x, weight.qweight, weight.scales, weight.qzeros)
        return int4_gemv(x, weight.qweight, weight.scales, weight.qzeros)
    return F.linear(x, weight.dequantize())


# Activation rows up to which an MLP's repacked gate | up runs SwiGLU in the 4-bit product's store
# (`packed_swiglu`): one launch instead of two a layer. 0 (never): on the H200 the store's launch (a warp a gate block
# and its up partner) took 32.5 us at one row and 36.9 at 8 against 27.8 and 30.3 for the product and the SwiGLU
# kernel apart, and the 27B decode step 6.31 ms against 6.05 (BENCHMARKS.md); tools.bench_quant --swiglu-rows sets it
# for a run.
SWIGLU_ROWS = 0


def packed_swiglu(x: torch.Tensor, weight: PackedWeight | MmaCodes) -> torch.Tensor | None:
    """silu(gate) * up [..., I] of x @ W^T for a repacked fused gate | up W [2 I, in] in one launch of the mma kernel
    (int4_mma's `swiglu`), where CUDA inputs have at most SWIGLU_ROWS rows and the launch fits; None elsewhere (the
    caller then runs `packed_linear` and the SwiGLU kernel)."""
    if (not isinstance(weight, MmaCodes) or not x.is_cuda or x.dtype != weight.dtype
            or x.numel() > min(SWIGLU_ROWS, MAX_ROWS) * x.shape[-1] or weight.shape[0] % 32):
        return None
    nout, ncols = weight.shape
    nt = int4_mma.row_tiles(max(1, x.numel() // x.shape[-1]))
    base = int4_mma.launch(int4_mma.split(nout, ncols, weight.group, sm_count(x.device)), nt)
    if int4_mma.swiglu_launch(base, nt) is None:
        return None
    return int4_mma.int4_mma(x, weight, swiglu=True)


class QuantLinear(nn.Module):
    """A bias-free linear whose weight is stored packed (state dict: qweight, scales, qzeros), or, once `repack`ed,
    held in the mma kernel's order only (buffers codes and zs)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    qzeros: torch.Tensor
    order: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, group: int) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.register_buffer("qweight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.zeros(out_features, in_features // group, dtype=torch.float16))
        self.register_buffer("qzeros", torch.zeros(out_features, in_features // group, dtype=torch.uint8))
        # an act-order checkpoint's held column order (`Permuted`), set by the loader; made from the checkpoint's
        # g_idx at load, so not part of the state dict
        self.register_buffer("order", None, persistent=False)
        self.mma: MmaCodes | None = None  # the weight in the mma kernel's order, once repacked (its tensors: buffers)

    @property
    def weight(self) -> PackedWeight | MmaCodes | Permuted:
        held = self.mma if self.mma is not None else PackedWeight(self.qweight, self.scales, self.qzeros)
        return held if self.order is None else Permuted(held, self.order)

    def repack(self, dtype: torch.dtype) -> bool:
        """Hold the weight in the mma kernel's order for activations of `dtype` (bf16 or fp16), freeing the format's
        codes; False (unchanged) where its shape does not fit the kernel (int4_mma.fits)."""
        if self.mma is not None:
            return True
        if dtype not in int4_mma.ACTIVATIONS or not int4_mma.fits(self.out_features, self.in_features, self.group):
            return False
        self._own(int4_mma.pack(self.qweight, self.scales, self.qzeros, dtype))
        return True

    def reorder(self, order: torch.Tensor) -> None:
        """Hold the weight with its input columns in `order` (held column j is column order[j]), each column kept in
        its group, as an act-order checkpoint loads (`Permuted`): the same function, each product gathering x first.
        tools.bench_quant times what the gathers cost a decode step."""
        cols = order.long().cpu()
        if self.order is not None or not torch.equal(cols // self.group, torch.arange(self.in_features) // self.group):
            raise ValueError("reorder takes, once, an order of the input columns that keeps each in its group")
        if self.mma is not None:
            qweight, scales, qzeros = int4_mma.unpack(self.mma)
            moved = pack(unpack(qweight)[:, cols.to(qweight.device)])
            self._own(int4_mma.pack(moved, scales, qzeros, self.mma.dtype))
        else:
            self.qweight = pack(unpack(self.qweight)[:, cols.to(self.qweight.device)])
        self.order = order.to(device=self.scales.device if self.mma is None else self.mma.codes.device,
                              dtype=torch.int32)

    def _own(self, mma: MmaCodes) -> None:
        for name in ("qweight", "scales", "qzeros"):
            self._buffers.pop(name, None)
            self.__dict__.pop(name, None)
        self.register_buffer("codes", mma.codes)
        self.register_buffer("zs", mma.zs)
        self.mma = mma

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.weight)


def to_mma(model: nn.Module, dtype: torch.dtype) -> int:
    """Every QuantLinear of `model` that fits, in the mma kernel's order (before fusing: `fuse_packed` joins repacked
    weights as they are). Returns how many."""
    return sum(m.repack(dtype) for m in model.modules() if isinstance(m, QuantLinear))


def repacked(model: nn.Module) -> bool:
    """Whether any projection of `model` holds its weight in the mma kernel's order (a 4-bit target loaded on a GPU
    that runs the mma kernel)."""
    return any(isinstance(m, QuantLinear) and m.mma is not None for m in model.modules())


def uses_mma(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model loading on `device` in `dtype` should be repacked: the mma kernel is the choice and runs
    there."""
    return device.type == "cuda" and dtype in int4_mma.ACTIVATIONS and chosen() == "mma"


def fuse_packed(linears: tuple[QuantLinear, ...]) -> PackedWeight | MmaCodes | Permuted | None:
    """One packed weight holding the rows of `linears`, which keep their buffers as views of it (no extra memory);
    None where some are repacked and some not, or where their input columns are not held in one order (act-order
    linears quantized apart). Repacked weights are whole 16-row blocks (int4_mma.fits), so their blocks join end to
    end."""
    first = linears[0].order
    for m in linears[1:]:
        if (m.order is None) != (first is None) or (m.order is not None and first is not None
                                                   and not torch.equal(m.order, first)):
            return None
    joined = _fuse_held(linears)
    if joined is None or first is None:
        return joined
    for m in linears:
        m.order = first  # one tensor for the fused rows
    return Permuted(joined, first)


def _fuse_held(linears: tuple[QuantLinear, ...]) -> PackedWeight | MmaCodes | None:
    mma = [m.mma for m in linears if m.mma is not None]
    if mma:
        if len(mma) != len(linears):
            return None
        joined = replace(mma[0], codes=torch.cat([w.codes for w in mma]), zs=torch.cat([w.zs for w in mma]))
        offset = 0
        for m, w in zip(linears, mma, strict=True):
            m._own(joined.rows(offset, offset + w.shape[0]))
            offset += w.shape[0]
        return joined
    packed = PackedWeight(*(torch.cat([getattr(m, name) for m in linears]) for name in ("qweight", "scales", "qzeros")))
    offset = 0
    for m in linears:
        rows = slice(offset, offset + m.out_features)
        m.qweight, m.scales, m.qzeros = packed.qweight[rows], packed.scales[rows], packed.qzeros[rows]
        offset += m.out_features
    return packed
