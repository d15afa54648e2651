"""The 4-bit GEMV/GEMM for 1 to 64 rows: x [rows, in] @ W^T for a packed ignis-int4 W, in one pass over the weight.

Owns: `int4_gemv` (the numba-cuda kernel on CUDA tensors, launched on torch's current stream, so a CUDA graph captures
it), its torch reference `int4_gemv_reference`, the grid `plan`, and each device's static workspace and self-resetting
counters. Does not own: the format (ignis.quant.format), when the kernel is used (ignis.quant.linear.packed_linear)
or the kernel body (ignis.kernels.int4_gemv_kernel). docs/adr/0005-int4-gemv.md has the why and the measurements.

Importing this module imports neither numba nor CUDA: the kernel for an (activation dtype, scale dtype, row tile) is
compiled on its first call, which must therefore happen before a CUDA graph captures it (the engine's warm-up does).

Numerics: the kernel multiplies in fp32 the exact values (q - z) * s and x and adds in fp32, then rounds once to the
activation dtype; the reference does the same with torch (a dequantized fp32 weight), so the two differ only by the
order of fp32 additions. A row's result does not depend on how many rows share the call (the plan depends on the
weight's shape only, and rows never mix).
"""

from __future__ import annotations

import math
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ignis.quant.format import dequantize

MAX_ROWS = 64  # rows the kernel takes; packed_linear sends more to the reference (a dequantized weight and F.linear)
MIN_SPLIT_WORDS = 128  # 64-bit words of a row a K split gets at least (four a lane)
_KINDS = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class Tuning:
    """The kernel's shape: output rows a warp, warps a block, and the blocks a SM the grid aims at before it splits
    the input dimension. tools.bench_quant measures the alternatives."""

    ot: int = 4
    warps: int = 4
    blocks_per_sm: int = 8

    @property
    def bo(self) -> int:  # output rows a block
        return self.ot * self.warps


TUNING = Tuning()


def int4_gemv_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                        qzeros: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ W^T -> [..., out] in x.dtype, computed in fp32 from the fp32 dequantized weight (what the kernel
    computes, up to the order of additions)."""
    return F.linear(x.float(), dequantize(qweight, scales, qzeros, torch.float32)).to(x.dtype)


@dataclass(frozen=True)
class Plan:
    splits: int  # K splits (blocks along the input dimension)
    split_words: int  # 64-bit words of a row each split reads (the last may read fewer)


def plan(nout: int, ncols: int, sms: int, tuning: Tuning = TUNING) -> Plan:
    """Enough blocks to fill the device from the output tiles alone when the weight has enough rows; otherwise split
    the input dimension, no split shorter than MIN_SPLIT_WORDS. Depends on the weight's shape only."""
    kwords = ncols // 16
    tiles = math.ceil(nout / tuning.bo)
    want = min(math.ceil(tuning.blocks_per_sm * sms / tiles), max(1, kwords // MIN_SPLIT_WORDS))
    split_words = math.ceil(kwords / max(1, want))
    return Plan(math.ceil(kwords / split_words), split_words)


def row_tile(rows: int) -> int:
    """Activation rows a block takes (its accumulators live in registers): 1, 2, 4, or 8 for more."""
    return 1 if rows == 1 else 2 if rows == 2 else 4 if rows <= 4 else 8


def workspace_len(sms: int, tuning: Tuning = TUNING) -> int:
    """fp32 entries covering splits * rows * out for every shape: splits > 1 only while tiles < blocks_per_sm * sms,
    and then splits * tiles < 2 * blocks_per_sm * sms."""
    return 2 * tuning.blocks_per_sm * sms * tuning.bo * MAX_ROWS


class _Device:
    """One device's static workspace and counters for one tuning (allocated once: CUDA graphs keep their addresses)."""

    def __init__(self, device: torch.device, tuning: Tuning) -> None:
        from numba import cuda

        self.sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.ws = torch.empty(workspace_len(self.sms, tuning), dtype=torch.float32, device=device)  # [n] float32
        # Split weights have fewer than blocks_per_sm * sms tiles, times at most MAX_ROWS / 8 row tiles.
        self.counters = torch.zeros(MAX_ROWS // 8 * tuning.blocks_per_sm * self.sms, dtype=torch.int32,
                                    device=device)  # [n] int32, cuda
        self.counters_nb = cuda.as_cuda_array(self.counters)  # numba's atomics want an array argument
        self.plans: dict[tuple[int, int], Plan] = {}


_lock = threading.Lock()
_devices: dict[tuple[int, Tuning], _Device] = {}
_kernels: dict[tuple[str, str, int, int, int], Any] = {}
_launchers: dict[tuple[Any, ...], Any] = {}


def kernel(xkind: str, skind: str, rt: int, ot: int, warps: int) -> Any:
    """The compiled dispatcher (compiled on first use)."""
    with _lock:
        key = (xkind, skind, rt, ot, warps)
        if key not in _kernels:
            from numba import cuda
            from numba.cuda import types as numba_types

            from ignis.kernels.int4_gemv_kernel import make_kernel, signature

            types: Any = numba_types
            _kernels[key] = cuda.jit(types.void(*signature(xkind, skind)), cache=True)(make_kernel(*key))
        return _kernels[key]


def _device(device: torch.device, tuning: Tuning) -> _Device:
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        if (index, tuning) not in _devices:
            _devices[index, tuning] = _Device(device, tuning)
        return _devices[index, tuning]


def _launcher(key: tuple[str, str, int, int, int], grid: tuple[int, int, int], device: torch.device) -> Any:
    """`kernel[grid, threads, stream]` for torch's current stream, read at every call (under torch.cuda.graph it is
    the capture stream) and configured once per key."""
    handle = torch.cuda.current_stream(device).cuda_stream
    full = (*key, grid, handle)
    config = _launchers.get(full)
    if config is None:
        from numba import cuda

        disp = kernel(*key)
        stream = 0 if handle == 0 else cuda.external_stream(handle)
        with _lock, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # numba warns about grids under 128 blocks
            if len(_launchers) > 1024:
                _launchers.clear()
            config = _launchers[full] = disp[grid, 32 * key[4], stream]
    return config


def int4_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
              tuning: Tuning = TUNING) -> torch.Tensor:
    """x [..., in] (bf16, fp16 or fp32, cuda; at most MAX_ROWS rows) @ W^T -> [..., out] in x.dtype, for W given as
    qweight uint8 [out, in/2], scales [out, in/group] (bf16, fp16 or fp32) and qzeros uint8 [out, in/group], all on
    x's device. Asynchronous, on torch's current stream; no allocation besides the output and no host read."""
    ncols = x.shape[-1]
    nout = qweight.shape[0]
    lead = x.shape[:-1]
    rows = x.reshape(-1, ncols)
    nrows = rows.shape[0]
    if nrows > MAX_ROWS or ncols % 16 or qweight.shape[1] * 2 != ncols:
        raise ValueError(f"int4_gemv takes [<= {MAX_ROWS}, in] rows with in a multiple of 16 matching the weight; got "
                         f"x {tuple(x.shape)}, qweight {tuple(qweight.shape)}")
    if not rows.is_contiguous() or rows.data_ptr() % 8:
        rows = rows.contiguous() if not rows.is_contiguous() else rows.clone()
    out = torch.empty((nrows, nout), dtype=x.dtype, device=x.device)  # [rows, out] x.dtype, cuda
    if nrows == 0 or nout == 0:
        return out.reshape(*lead, nout)
    qweight, scales, qzeros = qweight.contiguous(), scales.contiguous(), qzeros.contiguous()
    dev = _device(x.device, tuning)
    p = dev.plans.get((nout, ncols))
    if p is None:
        p = dev.plans[nout, ncols] = plan(nout, ncols, dev.sms, tuning)
    rt = row_tile(nrows)
    grid = (math.ceil(nrows / rt), math.ceil(nout / tuning.bo), p.splits)
    _launcher((_KINDS[x.dtype], _KINDS[scales.dtype], rt, tuning.ot, tuning.warps), grid, x.device)(
        qweight.data_ptr(), scales.data_ptr(), qzeros.data_ptr(), rows.data_ptr(), out.data_ptr(), dev.ws.data_ptr(),
        dev.counters_nb, nrows, nout, ncols, ncols // scales.shape[1], p.split_words, p.splits,
    )
    return out.reshape(*lead, nout)
