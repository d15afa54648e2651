"""Warp-level pieces of the top-k kernel: the key order, the 32-bit pre-filter, insertion and bitonic merging of the
sorted lists that each warp keeps in registers.

Owns: the element key, the filter that decides cheaply which elements may enter a list, and the list operations.
Does not own: the kernel's loops, grid and cross-block merge (ignis.kernels.topk_kernel).

Every function is a numba-cuda device function inlined into its caller, and is also plain Python for the simulator.
All loops and branches around warp intrinsics are warp-uniform; every lane of the warp calls every intrinsic.

The key of an element: `((hi - 2**31) << 32) | (0xFFFFFFFF - col)`, hi = the fp32 bit pattern made order-preserving,
-0.0 folded into +0.0, every NaN mapped to the top. Keys are unique per row and their order is the reference order
(larger value first, smaller column on ties), so any split of a row and any merge order give the same top k.
A list: lane j holds rank j (and, with `two`, a second register holds rank 32 + j), descending, distinct keys, EMPTY
where nothing has arrived yet. Ranks 0..k-1 are exact; deeper ranks are real keys of the warp's elements, in order,
but may miss elements the filter turned away.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

FULL = 0xFFFFFFFF  # the full-warp mask
EMPTY = -(2**63)  # below every real key (a real key's high word is never 0)
I32 = np.int32
LOW31 = np.int32(0x7FFFFFFF)
HI16 = np.int32(-65536)  # 0xFFFF0000: the upper bf16 of a word
S_INF = np.int32(0x7F800000)  # filter image of +inf
S_NEG_INF = np.int32(-2139095041)  # filter image of -inf; images below it are negative NaNs
S_MIN = np.int32(-(2**31))


@cuda.jit(device=True, inline="always")
def key_of(e, col):
    """e: an element's fp32 bits as int32 (a bf16 element is its upper 16 bits); col: its column."""
    b = np.int64(e) & 0xFFFFFFFF
    if b == 0x80000000:
        b = 0  # -0.0 ranks as +0.0; the output value keeps the input's own bits
    hi = b ^ (0x80000000 + (b >> 31) * 0x7FFFFFFF)  # negative: flip all bits; positive: set the sign bit
    if (b & 0x7FFFFFFF) > 0x7F800000:
        hi = 0xFFFFFFFF  # every NaN ranks first, as in torch.topk
    # Signed int64 because numba's shuffles reject uint64; subtracting 2**31 keeps unsigned order.
    return ((hi - 0x80000000) << 32) | (0xFFFFFFFF - col)


@cuda.jit(device=True, inline="always")
def image(e):
    """The 32-bit filter image of fp32 bits e: signed order equals float order for non-NaN values (-0.0 just below
    +0.0); positive NaNs above +inf, negative NaNs below -inf."""
    return I32(e ^ ((e >> 31) & LOW31))


@cuda.jit(device=True, inline="always")
def passes(e, col, ts, tcol):
    """Whether an element may beat the list's k-th key. Exact except that a few keys equal to a NaN or zero threshold
    pass too (they then land below rank k): a superset is all the insertion needs, and all int32 is what the scan of
    every element can afford."""
    s = image(e)
    return (s > ts) | ((s == ts) & (I32(col) < tcol)) | (s < S_NEG_INF)


@cuda.jit(device=True, inline="always")
def filter_of(thr):
    """(ts, tcol) for `passes` from the k-th key thr."""
    if thr == EMPTY:
        return S_MIN, I32(0)  # not k keys yet: everything passes
    tcol = I32(0xFFFFFFFF - (thr & 0xFFFFFFFF))
    hi = (thr >> 32) + 0x80000000
    if hi == 0xFFFFFFFF:
        return S_INF, I32(0)  # a NaN threshold: only NaNs may beat it
    b = hi & 0x7FFFFFFF if hi >= 0x80000000 else ~hi & 0xFFFFFFFF  # back to the (canonical) fp32 bits
    if b == 0:
        return I32(-1), tcol  # a zero threshold: -0.0 elements tie with it, and their image is -1
    signed = b - ((b >> 31) << 32)  # as int32 without an overflowing cast
    return I32(signed ^ ((signed >> 31) & 0x7FFFFFFF)), tcol


@cuda.jit(device=True, inline="always")
def _insert(c, lst, lane):
    # c goes to the first rank it beats; the ranks below shift down one lane; lane 31's key drops out.
    up = cuda.shfl_up_sync(FULL, lst, 1)
    if lst > c:
        return lst
    if lane == 0 or up > c:
        return c
    return up


@cuda.jit(device=True, inline="always")
def insert_all(m, key, a, b, lane, two):
    """Insert the keys of the lanes set in m (lane order). A key below rank k only lands below rank k (or drops), so
    the k-th key is re-read once per ballot, not per insertion: the chain per key is one shuffle deep."""
    while m != 0:
        c = cuda.shfl_sync(FULL, key, cuda.popc((m & -m) - 1))  # the lowest lane left in m
        if two:
            a_last = cuda.shfl_sync(FULL, a, 31)
            up_b = cuda.shfl_up_sync(FULL, b, 1)
            if c > a_last:
                a = _insert(c, a, lane)
                b = a_last if lane == 0 else up_b  # a's evicted last rank is above every rank in b
            else:
                b = _insert(c, b, lane)
        else:
            a = _insert(c, a, lane)
        m &= m - 1
    return a, b


@cuda.jit(device=True, inline="always")
def kth(a, b, k, two):
    if two:
        return cuda.shfl_sync(FULL, b, k - 33)
    return cuda.shfl_sync(FULL, a, k - 1)


@cuda.jit(device=True, inline="always")
def offer_key(key, a, b, thr, lane, k, two):
    """Offer one key per lane (exact test against the k-th key); returns the list and its new k-th key."""
    m = np.int64(cuda.ballot_sync(FULL, key > thr)) & 0xFFFFFFFF  # the ballot is a signed int32: keep 32 bits
    if m != 0:
        a, b = insert_all(m, key, a, b, lane, two)
        thr = kth(a, b, k, two)
    return a, b, thr


@cuda.jit(device=True, inline="always")
def _sort_bitonic(c, lane):
    # A bitonic sequence over the 32 lanes, sorted descending by the usual half-cleaner stages.
    for j in (16, 8, 4, 2, 1):
        p = cuda.shfl_xor_sync(FULL, c, j)
        c = max(c, p) if (lane & j) == 0 else min(c, p)
    return c


@cuda.jit(device=True, inline="always")
def merge(a, b, ra, rb, lane, two):
    """Top 32 (64 with `two`) of this list and another, descending. ra, rb: the other list's registers read
    lane-reversed (lane j holds its rank 31 - j, resp. 63 - j). Elementwise max against the reversed list is a bitonic
    sequence holding the top half of the union (one compare-exchange stage between a and b first when `two`)."""
    if two:
        ca = max(a, rb)
        cb = max(b, ra)
        return _sort_bitonic(max(ca, cb), lane), _sort_bitonic(min(ca, cb), lane)
    return _sort_bitonic(max(a, ra), lane), b
