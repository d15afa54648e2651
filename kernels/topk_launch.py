"""Launching the top-k kernel: the grid plan, the per-device workspace, the stream, the compiled kernels.

Owns: how rows are split into blocks (`plan`), the static workspace and self-resetting counters of each device, the
numba dispatchers (compiled on first use, one per dtype and list size), and `topk_cuda`, which launches on torch's
current stream. Does not own: argument checking or the CPU path (ignis.kernels.topk), the kernel body
(ignis.kernels.topk_kernel).

Importing this module imports neither numba nor CUDA; `plan` is plain arithmetic and is shared with the CPU model of
the kernel in the tests.

CUDA graphs: the workspace and counters are allocated once per device and never freed or moved, the counters are
zero again when a launch ends, and the stream is read from torch at every call, so a call made once before capture
(which compiles and loads the module) can be captured and replayed. Calls on one device must not overlap across
streams: they share that device's workspace (the engine drives each GPU from one stream).
"""

from __future__ import annotations

import math
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import torch

BLOCK = 256  # threads per block: 8 warps, each with its own register list
BLOCKS_PER_SM = 2  # measured on the H200 against 1, 4 and 8 (docs/adr/0001-topk-kernel.md): best or tied at 1-256 rows
MIN_WORDS = 2048  # a block gets at least this many 32-bit words (two load steps per thread) before rows are split


@dataclass(frozen=True)
class Plan:
    nblk: int  # blocks per row; 1 means each block writes its row's result itself
    chunk: int  # 32-bit words of the row per block; every block gets at least one
    ws_row: int  # int64 workspace entries per row (0 when nblk == 1); a multiple of 16 so rows share no 128 B line


def words(ncols: int, half: bool) -> int:
    return (ncols + 1) // 2 if half else ncols


def split(nwords: int, want: int) -> tuple[int, int]:
    """(nblk, chunk): at most `want` blocks of equal chunks, none empty."""
    chunk = math.ceil(nwords / max(1, min(want, nwords)))
    return math.ceil(nwords / chunk), chunk


def plan(rows: int, ncols: int, k: int, half: bool, sms: int) -> Plan:
    """About BLOCKS_PER_SM blocks per SM over all rows, but no block smaller than MIN_WORDS: one fp32 row of a 248k
    vocabulary gets 122 blocks, 8 rows 33 each, 256 rows 2 each, a short row one."""
    nwords = words(ncols, half)
    want = min(math.ceil(BLOCKS_PER_SM * sms / rows), math.ceil(nwords / MIN_WORDS))
    nblk, chunk = split(nwords, want)
    ws_row = 0 if nblk == 1 else 16 * math.ceil(nblk * k / 16)
    return Plan(nblk, chunk, ws_row)


def workspace_len(sms: int, max_k: int) -> int:
    """int64 entries that cover `rows * ws_row` for every shape: rows split over several blocks only while
    rows < BLOCKS_PER_SM * sms, and then with at most ceil(BLOCKS_PER_SM * sms / rows) blocks."""
    target = BLOCKS_PER_SM * sms
    return max([16] + [r * 16 * math.ceil(math.ceil(target / r) * max_k / 16) for r in range(1, target)])


class _Device:
    """One device's static buffers and SM count."""

    def __init__(self, device: torch.device, max_k: int) -> None:
        from numba import cuda

        self.sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.ws = torch.empty(workspace_len(self.sms, max_k), dtype=torch.int64, device=device)  # [n] int64, device
        # Rows split over several blocks are fewer than BLOCKS_PER_SM * sms; each keeps one counter.
        self.counters = torch.zeros(BLOCKS_PER_SM * self.sms, dtype=torch.int32, device=device)  # [n] int32, device
        self.counters_nb = cuda.as_cuda_array(self.counters)  # numba's atomics want an array argument


_lock = threading.Lock()
_devices: dict[int, _Device] = {}
_kernels: dict[tuple[bool, bool], Any] = {}
_launchers: dict[tuple[bool, bool, tuple[int, int], int], Any] = {}


def kernel(half: bool, two: bool) -> Any:
    """The compiled dispatcher for bf16/fp32 input and k <= 64/32 (compiled on first use, for the current device)."""
    with _lock:
        if (half, two) not in _kernels:
            from numba import cuda
            from numba.cuda import types as numba_types

            from ignis.kernels.topk_kernel import make_kernel, signature

            types: Any = numba_types
            sig = types.void(*signature(half))
            _kernels[half, two] = cuda.jit(sig, cache=True)(make_kernel(half, two, BLOCK))
        return _kernels[half, two]


def _device(device: torch.device, max_k: int) -> _Device:
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        if index not in _devices:
            _devices[index] = _Device(device, max_k)
        return _devices[index]


def _launcher(half: bool, two: bool, grid: tuple[int, int], device: torch.device) -> Any:
    """The configured launch (`kernel[grid, BLOCK, stream]`) for torch's current stream, built once per key: numba's
    per-launch configuration work (stream wrapping, grid checks) is then paid once, not on every call."""
    # Read torch's current stream at every call: under torch.cuda.graph it is the capture stream.
    handle = torch.cuda.current_stream(device).cuda_stream
    key = (half, two, grid, handle)
    config = _launchers.get(key)
    if config is None:
        from numba import cuda

        disp = kernel(half, two)
        stream = 0 if handle == 0 else cuda.external_stream(handle)
        with _lock, warnings.catch_warnings():
            # numba warns about grids under 128 blocks; for short rows a small grid is this kernel's normal case.
            warnings.simplefilter("ignore")
            if len(_launchers) > 1024:  # shapes x streams seen in one process; keep the table bounded
                _launchers.clear()
            config = _launchers[key] = disp[grid, BLOCK, stream]
    return config


def topk_cuda(x: torch.Tensor, k: int, max_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, V] float32 or bfloat16, cuda, last dim contiguous; 1 <= k <= min(V, max_k).

    Returns values [R, k] x.dtype (the input's own bits) and ids [R, k] int64, in the reference order.
    """
    rows, ncols = x.shape
    half = x.dtype == torch.bfloat16
    if half and (ncols % 2 or x.data_ptr() % 4 or (rows > 1 and x.stride(0) % 2)):
        # Rows are read as 32-bit words (two bf16 each): give odd or unaligned rows an even, aligned copy.
        x = torch.nn.functional.pad(x, (0, ncols % 2))
    vals = torch.empty((rows, k), dtype=x.dtype, device=x.device)  # [R, k] x.dtype, cuda
    ids = torch.empty((rows, k), dtype=torch.int64, device=x.device)  # [R, k] int64, cuda
    if rows:
        dev = _device(x.device, max_k)
        launch(x, ncols, k, plan(rows, ncols, k, half, dev.sms), dev.ws, dev.counters_nb, vals, ids)
    return vals, ids


def launch(
    x: torch.Tensor,  # [R, >= V] float32 or bfloat16, cuda; bf16 rows 4-byte aligned with an even row stride
    ncols: int,
    k: int,
    p: Plan,
    ws: torch.Tensor,  # [>= R * p.ws_row] int64, cuda
    counters: Any,  # numba view of [>= R] int32, cuda, all zero
    vals: torch.Tensor,  # [R, k] x.dtype, cuda, contiguous
    ids: torch.Tensor,  # [R, k] int64, cuda, contiguous
) -> None:
    """Enqueue the kernel with plan `p` on torch's current stream (topk_cuda's last step; the benchmark's too)."""
    rows = x.shape[0]
    half = x.dtype == torch.bfloat16
    row_words = x.stride(0) // 2 if half else x.stride(0)
    xp, vp, ip, wp = x.data_ptr(), vals.data_ptr(), ids.data_ptr(), ws.data_ptr()
    for r0 in range(0, rows, 65535):  # gridDim.y limit; this many rows always have p.nblk == 1
        r1 = min(rows, r0 + 65535)
        _launcher(half, k > 32, (p.nblk, r1 - r0), x.device)(
            xp + 4 * r0 * row_words,  # x: rows as 32-bit words
            row_words,
            ncols,
            k,
            p.chunk,
            wp,
            p.ws_row,
            counters,
            vp + r0 * k * vals.element_size(),
            ip + 8 * r0 * k,
        )
