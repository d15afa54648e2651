"""The numba-cuda top-k kernel body: unique 64-bit keys, per-warp sorted lists in registers, a last-block merge.

Owns: the key encoding, the warp-level insertion, the kernel source for each (dtype, list size, block size) and its
numba signature. Does not own: when it is launched, with which grid, on which stream or over which workspace
(ignis.kernels.topk_launch), nor argument checking (ignis.kernels.topk).

Importing this module imports numba.cuda (and with NUMBA_ENABLE_CUDASIM=1 the simulator), so only the launcher and
the tests import it, on first use. Nothing here touches the driver: the kernels are plain Python functions until the
launcher passes them to `cuda.jit` with a signature.

Algorithm (docs/adr/0001-topk-kernel.md has the why):
- Every element maps to a key `((hi - 2**31) << 32) | (0xFFFFFFFF - col)`, where `hi` is the float's bit pattern made
  order-preserving (-0.0 counts as +0.0, every NaN ranks above +inf). Keys are unique per row and their order is the
  reference order (larger value first, smaller column on ties), so any split and any merge order give the same result.
- Grid (nblk, R): block `blk` of row `row` scans its column chunk. Lane j of each warp holds the warp's j-th best key
  (ranks 32..63 in a second register `b` when k > 32); a tile of 32 keys is offered to the list only for lanes whose
  key beats the current k-th key (one ballot per tile), so after the first tiles almost nothing is inserted.
- Warp 0 folds the other warps' lists into its own; with nblk == 1 it writes the result. Otherwise it stores the
  block's k keys in the workspace, and the last block of the row to finish (threadfence + atomic counter) folds the
  nblk lists the same way, writes the result and zeroes the row's counter, so the next launch or graph replay starts
  clean.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from numba import cuda

FULL = 0xFFFFFFFF  # every lane takes part in every warp intrinsic: all loops and branches around them are warp-uniform
EMPTY = -(2**63)  # below every real key (a real key's high word is never 0), so it never enters a list
UNROLL = 4  # tiles loaded before any is consumed: four independent loads in flight per thread


@cuda.jit(device=True, inline="always")
def _key(b, col):
    # b: the value's fp32 bit pattern as a non-negative int64 (a bf16 value is exact as the top 16 bits).
    if b == 0x80000000:
        b = 0  # -0.0 == +0.0, as in the stable-sort reference; the output value keeps the input's own bits
    hi = b ^ (0x80000000 + (b >> 31) * 0x7FFFFFFF)  # negative: flip all bits; positive: set the sign bit
    if (b & 0x7FFFFFFF) > 0x7F800000:
        hi = 0xFFFFFFFF  # every NaN ranks first, as in torch.topk; ties among NaNs go to the smaller column
    # Signed int64 because numba's shuffles reject uint64; subtracting 2**31 keeps unsigned order.
    return ((hi - 0x80000000) << 32) | (0xFFFFFFFF - col)


@cuda.jit(device=True, inline="always")
def _insert(c, lst, lane):
    # Lane j holds rank j (descending, unique). c goes to the first rank it beats; the ranks below shift down one lane.
    up = cuda.shfl_up_sync(FULL, lst, 1)
    if lst > c:
        return lst
    if lane == 0 or up > c:
        return c
    return up


@cuda.jit(device=True, inline="always")
def _offer(key, a, b, thr, lane, k, two):
    """Offer one key per lane to the warp's list (a; and b for ranks 32..63 when `two`). thr is the k-th key."""
    m = np.int64(cuda.ballot_sync(FULL, key > thr)) & 0xFFFFFFFF  # the ballot is a signed int32: keep 32 bits
    while m != 0:
        c = cuda.shfl_sync(FULL, key, cuda.popc((m & -m) - 1))  # lowest lane in m
        if c > thr:  # thr may have risen since the ballot
            if two:
                a_last = cuda.shfl_sync(FULL, a, 31)
                up_b = cuda.shfl_up_sync(FULL, b, 1)
                if c > a_last:
                    a = _insert(c, a, lane)
                    b = a_last if lane == 0 else up_b  # a's evicted last rank is above every rank in b
                else:
                    b = _insert(c, b, lane)
                thr = cuda.shfl_sync(FULL, b, k - 33)
            else:
                a = _insert(c, a, lane)
                thr = cuda.shfl_sync(FULL, a, k - 1)
        m &= m - 1
    return a, b, thr


@cuda.jit(device=True, inline="always")
def _word_key(v, w, h, end, ncols, half):
    # Word w of the row holds one fp32 element (column w) or two bf16 elements (columns 2w, 2w+1, the lower column in
    # the low half). Words past `end` and the padding half of an odd bf16 row give EMPTY.
    u = np.int64(v) & 0xFFFFFFFF
    if half:
        col = 2 * w + h
        b = ((u >> (16 * h)) & 0xFFFF) << 16
    else:
        col = w
        b = u
    if w < end and col < ncols:
        return _key(b, col)
    return EMPTY


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
    ranks = 2 if two else 1  # list registers per lane
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
        end = min(start + chunk, (ncols + 1) // 2 if half else ncols)
        clamp = end - 1  # the plan gives every block at least one word
        final = nblk == 1

        for phase in range(2):
            a = EMPTY
            b = EMPTY
            thr = EMPTY
            if phase == 0:
                # This block's words, UNROLL tiles of `block` words a step. The next step is loaded before this one
                # is offered, so loads stay in flight during the ballots; loads past the end are clamped to the last
                # word (valid memory) and never offered.
                w0 = start + tid
                v0 = x[base + min(w0, clamp)]
                v1 = x[base + min(w0 + block, clamp)]
                v2 = x[base + min(w0 + 2 * block, clamp)]
                v3 = x[base + min(w0 + 3 * block, clamp)]
                for t0 in range(start, end, step):
                    w0 = t0 + tid
                    n0 = x[base + min(w0 + step, clamp)]
                    n1 = x[base + min(w0 + step + block, clamp)]
                    n2 = x[base + min(w0 + step + 2 * block, clamp)]
                    n3 = x[base + min(w0 + step + 3 * block, clamp)]
                    for u in range(UNROLL):
                        v = v0 if u == 0 else (v1 if u == 1 else (v2 if u == 2 else v3))
                        for h in range(halves):
                            key = _word_key(v, w0 + u * block, h, end, ncols, half)
                            a, b, thr = _offer(key, a, b, thr, lane, k, two)
                    v0 = n0
                    v1 = n1
                    v2 = n2
                    v3 = n3
            else:
                # Last block of the row: the nblk block lists of k keys each.
                n = nblk * k
                for t0 in range(0, n, block):
                    i = t0 + tid
                    key = EMPTY
                    if i < n:
                        key = ws[row * ws_row + i]
                    a, b, thr = _offer(key, a, b, thr, lane, k, two)

            # Warp 0 folds in the first k ranks of every other warp's list (deeper lanes hold no exact ranks).
            lists[warp, lane] = a
            if two:
                lists[warp, 32 + lane] = b
            cuda.syncthreads()
            if warp == 0:
                for w in range(1, warps):
                    for r in range(ranks):
                        key = EMPTY
                        if 32 * r + lane < k:
                            key = lists[w, 32 * r + lane]
                        a, b, thr = _offer(key, a, b, thr, lane, k, two)
                if final:
                    _emit(x, base, a, b, lane, k, two, half, out_val, out_idx, row * k)
                    if phase == 1 and tid == 0:
                        counters[row] = 0  # self-reset: the next launch and every graph replay start from zero
                else:
                    wb = row * ws_row + blk * k
                    if lane < k:
                        ws[wb + lane] = a
                    if two and 32 + lane < k:
                        ws[wb + 32 + lane] = b
                    cuda.threadfence()  # every writer publishes its keys before the block counts itself done
            if final:
                return
            cuda.syncthreads()
            if tid == 0:
                last[0] = 1 if cuda.atomic.add(counters, row, 1) == nblk - 1 else 0
            cuda.syncthreads()
            if last[0] == 0:
                return
            cuda.threadfence()  # acquire side: the other blocks' keys are visible from here on
            final = True

    return topk_kernel


def signature(half: bool) -> tuple[object, ...]:
    """numba argument types of `make_kernel(half, ...)`: raw pointers for per-call tensors (no array marshalling at
    launch), a 1-D array for the counters (numba's atomics take arrays only)."""
    from numba.cuda import types

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
