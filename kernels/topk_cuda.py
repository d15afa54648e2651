"""Exact top-k of up to 32 over wide rows as two CUDA C++ launches (NVRTC): `topk`, `fits`.

Owns: the launches of ignis.kernels.topk_cuda_kernel's `topk_chunks` and `topk_merge` on torch's current stream
(capturable: outputs and the chunks' keys are allocated here), the split of a row into chunks, and the calls they
take. Does not own: the source (ignis.kernels.topk_cuda_kernel), the order and its reference (ignis.kernels.topk:
larger value first, -0.0 equal to +0.0, every NaN above +inf, equal values by the smaller column, the input's own
elements returned), or which calls take this kernel rather than the numba one (its callers:
ignis.backends.dflash2.selector).

Why: the drafter's proposal head gives a few rows of 248,320 logits at the 27B shape, of which the selector wants the
16 or 32 best. The numba kernel ranks every element into per-lane lists: 23-32 µs for one row, 40-60 for seven,
55-71 for fourteen. Here each lane sorts what it loaded and the warp merges only the ranks that can still enter its
list: 21, 29 and 41 µs (BENCHMARKS.md, "The drafter's candidates"); slower than numba's from some 56 rows on, so the
selector sends it at most sixteen rows (two lanes' drafts).
"""

from __future__ import annotations

import math
import threading

import torch

from ignis.kernels.launch import nvrtc_installed, sm_count
from ignis.kernels.topk_cuda_kernel import SOURCE

MAX_K = 32  # one list entry a lane
UNROLL = 16  # elements a lane loads and sorts before the warp merges them (a power of two)
MIN_SHARE = 512  # columns a warp filters at least (32 x UNROLL: one load): fewer chunks on short rows
BLOCKS_PER_SM = 8  # the chunks aim at this many blocks of 8 warps an SM over all rows
_lock = threading.Lock()
_functions: dict[tuple[bool, torch.device], tuple[object, object]] = {}


def fits(x: torch.Tensor, k: int) -> bool:
    """Whether `topk` takes x [R, V] and k: float32 / bfloat16 on CUDA with contiguous columns, 1 <= k <=
    min(V, 32), V and the row stride below 2**31 (the kernels' int offsets), with NVRTC installed."""
    return (x.is_cuda and x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16) and x.stride(-1) == 1
            and 1 <= k <= min(x.shape[1], MAX_K) and max(x.shape[1], x.stride(0)) < 2**31 - 1 and nvrtc_installed())


def chunks(rows: int, ncols: int, sms: int) -> int:
    """Chunks a row splits into: about BLOCKS_PER_SM blocks an SM over all rows, each warp filtering at least
    MIN_SHARE columns."""
    return max(1, min(math.ceil(BLOCKS_PER_SM * sms / max(rows, 1)), math.ceil(ncols / (8 * MIN_SHARE))))


def _functions_for(bf16: bool, device: torch.device) -> tuple[object, object]:
    from ignis.kernels.nvrtc import Function, arch_of, compile_cubin

    key = (bf16, device)
    with _lock:
        if key not in _functions:
            cubin = compile_cubin(SOURCE, "topk", arch_of(device), (("BF16", int(bf16)), ("UNROLL", UNROLL)))
            _functions[key] = (Function(cubin, "topk_chunks", device), Function(cubin, "topk_merge", device))
        return _functions[key]


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, V] -> (values [R, k] x.dtype, ids [R, k] int64), largest first, ties to the smaller column: exactly
    ignis.kernels.topk.topk_reference(x, k). Asynchronous on torch's current stream; capturable in a CUDA graph once
    it has run outside capture for x's dtype on x's device (the first call compiles and loads the kernels)."""
    if not fits(x, k):
        raise ValueError(f"topk_cuda takes [R, V] float32/bfloat16 CUDA rows with contiguous columns and k in "
                         f"1..min(V, {MAX_K}); got {tuple(x.shape)} {x.dtype} on {x.device}, k {k}")
    rows, ncols = x.shape
    values = torch.empty((rows, k), dtype=x.dtype, device=x.device)
    ids = torch.empty((rows, k), dtype=torch.int64, device=x.device)
    if rows == 0:
        return values, ids
    n = chunks(rows, ncols, sm_count(x.device))
    chunk = math.ceil(ncols / n)
    n = math.ceil(ncols / chunk)
    keys = torch.empty((rows, n, MAX_K), dtype=torch.int64, device=x.device)
    first, merge = _functions_for(x.dtype == torch.bfloat16, x.device)
    first((n, rows, 1), 256, (x, keys, ncols, x.stride(0), chunk))  # type: ignore[operator]
    merge((rows, 1, 1), 256, (keys, x, values, ids, n * MAX_K, x.stride(0), k))  # type: ignore[operator]
    return values, ids
