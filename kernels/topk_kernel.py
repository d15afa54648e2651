"""The numba-cuda top-k kernel: each block scans a chunk of a row into per-warp register lists, folds them, and the last
block of the row merges the blocks' lists.

Owns: the kernel source for each (dtype, list size, block size) and its numba signature. Does not own: the key order
and the list operations (ignis.kernels.topk_warp), when it is launched, with which grid, on which stream or over which
workspace (ignis.kernels.topk_launch), nor argument checking (ignis.kernels.topk).

Importing this module imports numba.cuda (or, with NUMBA_ENABLE_CUDASIM=1, the simulator), so only the launcher and
the tests import it, on first use; nothing here touches the driver. docs/adr/0001-topk-kernel.md has the why.

Grid (nblk, R), one block per chunk of a row:
1. Scan: each warp takes 32 consecutive words per tile, UNROLL tiles per step. An element is tested against the warp's
   k-th key in int32 (`passes`); one ballot per tile, and only when some lane passes are 64-bit keys built and
   inserted. After the first tiles almost nothing passes, so the scan costs a few integer ops per element.
2. Fold: the 8 warp lists are merged pairwise in shared memory (bitonic merges, 3 rounds) into warp 0.
3. nblk == 1: warp 0 writes the row's result. Otherwise it stores the block's k keys in the workspace, and the last
   block of the row to finish (threadfence + atomic counter) offers the row's nblk * k keys the same way, folds, writes
   the result and zeroes the row's counter, so the next launch or CUDA-graph replay starts clean.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
from numba import cuda

from ignis.kernels.topk_warp import EMPTY, FULL, HI16, I32, filter_of, insert_all, key_of, kth, merge, offer_key, passes

UNROLL = 4  # words loaded per thread before any is tested: four independent loads in flight


@cuda.jit(device=True, inline="always")
def _element(v, h, half):
    # Element h of word v as fp32 bits: the word itself (fp32), or its lower / upper bf16 (the lower column is low).
    if half:
        return I32(v << 16) if h == 0 else I32(v & HI16)
    return I32(v)


@cuda.jit(device=True, inline="always")
def _masks(v, w, end, ncols32, ts, tcol, half):
    # Ballots of the lanes whose element of word w may enter the list: (lower or only element, upper bf16 or 0).
    ok = (w < end) & passes(_element(v, 0, half), I32(2 * w) if half else w, ts, tcol)
    m = np.int64(cuda.ballot_sync(FULL, ok)) & 0xFFFFFFFF  # the ballot is a signed int32: keep 32 bits
    n = np.int64(0)
    if half:
        ok = (w < end) & (I32(2 * w + 1) < ncols32) & passes(_element(v, 1, half), I32(2 * w + 1), ts, tcol)
        n = np.int64(cuda.ballot_sync(FULL, ok)) & 0xFFFFFFFF  # an odd bf16 row ends in half a word
    return m, n


@cuda.jit(device=True, inline="always")
def _fold(lists, a, b, warp, lane, warps, two):
    """Merge the block's warp lists pairwise into warp 0 (registers a, b); every thread of the block calls this."""
    lists[warp, lane] = a
    if two:
        lists[warp, 32 + lane] = b
    cuda.syncthreads()
    step = warps // 2
    while step >= 1:
        if warp < step:
            ra = lists[warp + step, 31 - lane]
            rb = lists[warp + step, 63 - lane] if two else ra
            a, b = merge(a, b, ra, rb, lane, two)
            lists[warp, lane] = a
            if two:
                lists[warp, 32 + lane] = b
        cuda.syncthreads()
        step //= 2
    return a, b


@cuda.jit(device=True, inline="always")
def _emit(x, base, a, b, lane, k, two, half, out_val, out_idx, obase):
    # The value is re-read from the input, so -0.0 and NaN payloads come out with their own bits.
    for r in range(2 if two else 1):
        key = a if r == 0 else b
        j = 32 * r + lane
        if j < k:
            col = 0xFFFFFFFF - (key & 0xFFFFFFFF)
            out_idx[obase + j] = col
            if half:
                h = (np.int64(x[base + (col >> 1)]) >> (16 * (col & 1))) & 0xFFFF
                out_val[obase + j] = np.int16(h - ((h & 0x8000) << 1))  # in int16 range: no overflow on the cast
            else:
                out_val[obase + j] = x[base + col]


def make_kernel(half: bool, two: bool, block: int) -> Callable[..., None]:
    """The kernel's Python source for bf16 (`half`) or fp32 input, k <= 64 (`two`) or k <= 32, `block` threads.

    Arguments, all flat (row-major) so that the same body runs on pointers (GPU) and on NumPy arrays (simulator):
    x [R * row_words] int32: the rows as 32-bit words (one fp32, or two bf16 elements each); row_words, ncols
    (elements), k, chunk (words per block), ws_row int64; ws [R * ws_row] int64: the block lists, row after row;
    counters [>= R] int32, zero between launches; out_val [R * k] int32 (fp32 bits) or int16 (bf16 bits);
    out_idx [R * k] int64.
    """
    warps = block // 32
    width = 64 if two else 32
    halves = 2 if half else 1  # elements per word
    step = block * UNROLL

    def topk_kernel(x, row_words, ncols, k, chunk, ws, ws_row, counters, out_val, out_idx):
        row = np.int64(cuda.blockIdx.y)
        blk = np.int64(cuda.blockIdx.x)
        nblk = np.int64(cuda.gridDim.x)
        tid = np.int64(cuda.threadIdx.x)
        lane = tid & 31
        warp = tid >> 5
        lists = cuda.shared.array((warps, width), np.int64)
        last = cuda.shared.array(1, np.int32)
        base = row * row_words
        start = blk * chunk
        end = I32(min(start + chunk, (ncols + 1) // 2 if half else ncols))
        ncols32 = I32(ncols)
        a = EMPTY
        b = EMPTY
        thr = EMPTY
        ts, tcol = filter_of(thr)

        # 1. Scan this block's words [start, end): four ballots (eight for bf16) of int32 tests per step; only in the
        # rare step where some lane passes are the elements tested again, one by one, keyed and inserted.
        for t0 in range(start, end, step):
            w0 = I32(t0 + tid)
            w1 = I32(w0 + block)
            w2 = I32(w0 + 2 * block)
            w3 = I32(w0 + 3 * block)
            v0 = x[base + w0] if w0 < end else I32(0)
            v1 = x[base + w1] if w1 < end else I32(0)
            v2 = x[base + w2] if w2 < end else I32(0)
            v3 = x[base + w3] if w3 < end else I32(0)
            m0, n0 = _masks(v0, w0, end, ncols32, ts, tcol, half)
            m1, n1 = _masks(v1, w1, end, ncols32, ts, tcol, half)
            m2, n2 = _masks(v2, w2, end, ncols32, ts, tcol, half)
            m3, n3 = _masks(v3, w3, end, ncols32, ts, tcol, half)
            if (m0 | n0 | m1 | n1 | m2 | n2 | m3 | n3) != 0:
                for j in range(UNROLL * halves):
                    u = j // halves
                    h = j % halves
                    v = v0 if u == 0 else (v1 if u == 1 else (v2 if u == 2 else v3))
                    m = (m0 if u == 0 else (m1 if u == 1 else (m2 if u == 2 else m3))) if h == 0 else (
                        n0 if u == 0 else (n1 if u == 1 else (n2 if u == 2 else n3)))
                    if m != 0:
                        # Test again against the list as it is now: earlier insertions of this step raised it.
                        w = I32(w0 + u * block)
                        col = I32(2 * w + h) if half else w
                        e = _element(v, h, half)
                        ok = (w < end) & (col < ncols32) & passes(e, col, ts, tcol)
                        m = np.int64(cuda.ballot_sync(FULL, ok)) & 0xFFFFFFFF
                        if m != 0:
                            a, b = insert_all(m, key_of(e, np.int64(col)), a, b, lane, two)
                            thr = kth(a, b, k, two)
                            ts, tcol = filter_of(thr)

        # 2. Fold the warps; 3. write the row, or publish the block's keys and let the row's last block merge them.
        a, b = _fold(lists, a, b, warp, lane, warps, two)
        if nblk == 1:
            if warp == 0:
                _emit(x, base, a, b, lane, k, two, half, out_val, out_idx, row * k)
            return
        if warp == 0:
            wb = row * ws_row + blk * k
            if lane < k:
                ws[wb + lane] = a
            if two and 32 + lane < k:
                ws[wb + 32 + lane] = b
            cuda.threadfence()  # every writer publishes its keys before the block counts itself done
        cuda.syncthreads()
        if tid == 0:
            last[0] = 1 if cuda.atomic.add(counters, row, 1) == nblk - 1 else 0
        cuda.syncthreads()
        if last[0] == 0:
            return
        cuda.threadfence()  # acquire side: the other blocks' keys are visible from here on
        a = EMPTY
        b = EMPTY
        thr = EMPTY
        n = nblk * k
        for t0 in range(0, n, block):
            i = t0 + tid
            a, b, thr = offer_key(ws[row * ws_row + i] if i < n else EMPTY, a, b, thr, lane, k, two)
        a, b = _fold(lists, a, b, warp, lane, warps, two)
        if warp == 0:
            _emit(x, base, a, b, lane, k, two, half, out_val, out_idx, row * k)
            if tid == 0:
                counters[row] = 0  # self-reset: the next launch and every graph replay start from zero

    return topk_kernel


def signature(half: bool) -> tuple[object, ...]:
    """numba argument types of `make_kernel(half, ...)`: raw pointers for per-call tensors (no array marshalling at
    launch), a 1-D array for the counters (numba's atomics take arrays only)."""
    from numba.cuda import types as numba_types

    types: Any = numba_types  # numba builds its type objects at run time; nothing for a type checker to see
    return (
        types.CPointer(types.int32),  # x, as words
        types.int64,  # row_words
        types.int64,  # ncols
        types.int64,  # k
        types.int64,  # chunk
        types.CPointer(types.int64),  # ws
        types.int64,  # ws_row
        types.Array(types.int32, 1, "C"),  # counters
        types.CPointer(types.int16 if half else types.int32),  # out_val
        types.CPointer(types.int64),  # out_idx
    )
