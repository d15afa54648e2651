"""A NumPy model of the top-k kernel's algorithm, step for step, fuzzed against the reference on full-size rows.

The simulator can only run the kernel on a few hundred columns. This model replays the same decomposition at vocabulary
scale: the launcher's own plan (blocks per row, chunks), the same word-to-warp assignment, the int32 filter with its
per-step masks, insertion of every masked key into 32-lane lists (two lists when k > 32), the pairwise bitonic fold,
the workspace and the last-block merge. All warps advance together as rows of NumPy arrays.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ignis.kernels.topk import topk_reference
from ignis.kernels.topk_launch import BLOCK, BLOCKS_PER_SM, plan, split, words

UNROLL = 4  # ignis.kernels.topk_kernel.UNROLL; checked below without importing numba in every test
EMPTY = np.int64(-(2**63))
S_NEG_INF, S_INF, S_MIN = -2139095041, 0x7F800000, -(2**31)
LANE = np.arange(32)


def bits_of(x: torch.Tensor) -> np.ndarray:
    """[R, V] float32/bfloat16 -> [R, V] int64 holding each element's fp32 bits as a signed int32 value."""
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().astype(np.int64) << 16
    return x.view(torch.int32).numpy().astype(np.int64)


def key_of(e: np.ndarray, col: np.ndarray) -> np.ndarray:
    """The kernel's key, written independently: canonical order-preserving high word, reversed column low word."""
    b = e & 0xFFFFFFFF
    b = np.where(b == 0x80000000, 0, b)
    hi = np.where(b >= 0x80000000, b ^ 0xFFFFFFFF, b | 0x80000000)
    hi = np.where((b & 0x7FFFFFFF) > 0x7F800000, 0xFFFFFFFF, hi)
    return ((hi - 0x80000000) << 32) | (0xFFFFFFFF - col)


def filter_of(thr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    hi = (thr >> 32) + 0x80000000
    b = np.where(hi >= 0x80000000, hi & 0x7FFFFFFF, ~hi & 0xFFFFFFFF)
    signed = b - ((b >> 31) << 32)
    ts = np.where(b == 0, -1, signed ^ ((signed >> 31) & 0x7FFFFFFF))
    ts = np.where(hi == 0xFFFFFFFF, S_INF, np.where(thr == EMPTY, S_MIN, ts))
    tcol = np.where((thr == EMPTY) | (hi == 0xFFFFFFFF), 0, 0xFFFFFFFF - (thr & 0xFFFFFFFF))
    return ts, tcol


def passes(e: np.ndarray, col: np.ndarray, ts: np.ndarray, tcol: np.ndarray) -> np.ndarray:
    s = e ^ ((e >> 31) & 0x7FFFFFFF)
    return (s > ts[:, None]) | ((s == ts[:, None]) & (col < tcol[:, None])) | (s < S_NEG_INF)


def _insert(lst: np.ndarray, c: np.ndarray) -> np.ndarray:
    up = np.concatenate([lst[:, :1], lst[:, :-1]], axis=1)  # shfl_up by one
    c = c[:, None]
    return np.where(lst > c, lst, np.where((LANE == 0) | (up > c), c, up))


def _sort_bitonic(c: np.ndarray) -> np.ndarray:
    for j in (16, 8, 4, 2, 1):
        p = c[:, LANE ^ j]  # shfl_xor
        c = np.where((LANE & j) == 0, np.maximum(c, p), np.minimum(c, p))
    return c


class Lists:
    """The register lists of n warps: a [n, 32] (ranks 0..31), b [n, 32] (ranks 32..63), the k-th key thr [n] and
    its filter (ts, tcol)."""

    def __init__(self, n: int, k: int) -> None:
        self.k = k
        self.a = np.full((n, 32), EMPTY)
        self.b = np.full((n, 32), EMPTY)
        self.inserts = np.zeros(n, np.int64)
        self.set_thr()

    def set_thr(self) -> None:
        self.thr = (self.a[:, self.k - 1] if self.k <= 32 else self.b[:, self.k - 33]).copy()
        self.ts, self.tcol = filter_of(self.thr)

    def insert_all(self, m: np.ndarray, keys: np.ndarray) -> None:
        """m [n, 32] bool, keys [n, 32]: insert every masked key in lane order, no threshold test (insert_all)."""
        for j in range(32):
            go = m[:, j]
            if not go.any():
                continue
            self.inserts += go
            c = keys[go, j]
            if self.k <= 32:
                self.a[go] = _insert(self.a[go], c)
                continue
            a, b = self.a[go], self.b[go]
            a_last = a[:, 31]
            to_a = c > a_last
            self.b[go] = np.where(to_a[:, None], np.concatenate([a_last[:, None], b[:, :-1]], axis=1), _insert(b, c))
            self.a[go] = np.where(to_a[:, None], _insert(a, c), a)
        self.set_thr()

    def top(self) -> np.ndarray:
        return np.concatenate([self.a, self.b], axis=1)[:, : self.k]


def fold(lists: Lists, groups: int, warps: int) -> Lists:
    """Pairwise bitonic merges in shared memory: warp w < step merges warp w + step, step = warps/2 .. 1."""
    k, two = lists.k, lists.k > 32
    a = lists.a.reshape(groups, warps, 32).copy()
    b = lists.b.reshape(groups, warps, 32).copy()
    step = warps // 2
    while step >= 1:
        for w in range(step):
            ra, rb = a[:, w + step, ::-1], b[:, w + step, ::-1]
            if two:
                ca, cb = np.maximum(a[:, w], rb), np.maximum(b[:, w], ra)
                a[:, w], b[:, w] = _sort_bitonic(np.maximum(ca, cb)), _sort_bitonic(np.minimum(ca, cb))
            else:
                a[:, w] = _sort_bitonic(np.maximum(a[:, w], ra))
        step //= 2
    out = Lists(groups, k)
    out.a, out.b = a[:, 0].copy(), b[:, 0].copy()
    out.set_thr()
    return out


def model_topk(x: torch.Tensor, k: int, sms: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """What the kernel computes for x [R, V] with the launcher's plan on `sms` SMs; also mean inserts per warp."""
    rows, ncols = x.shape
    half = x.dtype == torch.bfloat16
    p = plan(rows, ncols, k, half, sms)
    warps, nwords, halves = BLOCK // 32, words(ncols, half), 2 if half else 1
    bits = np.concatenate([bits_of(x), np.zeros((rows, 2), np.int64)], axis=1)  # invalid offers read the padding
    # Phase 1: warp (row, blk, w), lane l, step t0, word u reads word start + t0 + u*BLOCK + 32w + l.
    r_ix = np.arange(rows)[:, None, None, None]
    start = (np.arange(p.nblk) * p.chunk)[None, :, None, None]
    end = np.minimum(start + p.chunk, nwords)
    lane_word = start + (32 * np.arange(warps))[None, None, :, None] + LANE
    lists = Lists(rows * p.nblk * warps, k)
    for t0 in range(0, p.chunk, BLOCK * UNROLL):
        offers = []  # the step's first masks all use the filter as it was when the step began
        for u in range(UNROLL):
            word = lane_word + t0 + u * BLOCK
            for h in range(halves):
                col = 2 * word + h if half else word
                ok = np.broadcast_to((word < end) & (col < ncols), (rows, p.nblk, warps, 32))
                e = bits[r_ix, np.where(ok, col, ncols)].reshape(-1, 32)
                cols = np.broadcast_to(col, ok.shape).reshape(-1, 32)
                ok = ok.reshape(-1, 32)
                offers.append((ok & passes(e, cols, lists.ts, lists.tcol), ok, e, cols))
        for first, ok, e, cols in offers:
            # Warps whose first mask is not empty test again against their list as it is now.
            m = first.any(axis=1)[:, None] & ok & passes(e, cols, lists.ts, lists.tcol)
            lists.insert_all(m, key_of(e, cols))
    inserts = lists.inserts.mean()
    lists = fold(lists, rows * p.nblk, warps)
    if p.nblk > 1:
        # Phase 3: the row's nblk*k workspace keys, block after block; warp w lane l reads entry t0 + 32w + l.
        ws = np.concatenate([lists.top().reshape(rows, p.nblk * k), np.full((rows, BLOCK), EMPTY)], axis=1)
        merge = Lists(rows * warps, k)
        for t0 in range(0, p.nblk * k, BLOCK):
            keys = ws[:, t0 + 32 * np.arange(warps)[:, None] + LANE].reshape(-1, 32)  # past the lists: EMPTY
            merge.insert_all(keys > merge.thr[:, None], keys)
        lists = fold(merge, rows, warps)
    top = lists.top()
    ids = torch.from_numpy(0xFFFFFFFF - (top & 0xFFFFFFFF))
    return x.gather(1, ids), ids, float(inserts)


def _check(x: torch.Tensor, k: int, sms: int = 132) -> float:
    vals, ids, inserts = model_topk(x, k, sms)
    ref_vals, ref_ids = topk_reference(x, k)
    assert torch.equal(ids, ref_ids)
    bits = torch.int16 if x.dtype == torch.bfloat16 else torch.int32
    assert torch.equal(vals.view(bits), ref_vals.view(bits))
    return inserts


def test_model_unroll_matches_kernel() -> None:
    from ignis.kernels.topk_kernel import UNROLL as kernel_unroll

    assert kernel_unroll == UNROLL


@pytest.mark.parametrize(
    ("rows", "ncols", "k", "dtype"),
    [
        (1, 151936, 8, torch.float32),
        (7, 151936, 16, torch.bfloat16),
        (1, 248320, 64, torch.float32),
        (3, 248046, 33, torch.bfloat16),
        (256, 4099, 15, torch.float32),
        (7, 50001, 32, torch.bfloat16),
    ],
)
def test_model_matches_reference_on_vocabulary_rows(rows: int, ncols: int, k: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows * ncols + k)
    _check(torch.randn(rows, ncols, generator=g).to(dtype), k)


@pytest.mark.parametrize("k", [1, 8, 15, 16, 32, 33, 64])
def test_model_heavy_ties_and_equal_rows(k: int) -> None:
    g = torch.Generator().manual_seed(k)
    x = torch.randint(0, 4, (7, 30011), generator=g).float()  # thousands of columns tie at the k-th value
    x[1] = 0.5  # all equal: the first k columns
    x[2, ::2] = -0.0  # -0.0 ties with +0.0
    x[2, 1::2] = 0.0
    _check(x, k)
    _check(x.bfloat16(), k)


def test_model_masked_rows_and_special_values() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.full((4, 20000), -torch.inf)
    x[0, [5, 19999, 7000]] = torch.tensor([1.0, 2.0, 1.0])  # fewer finite values than k: -inf fills in column order
    x[1] = torch.randn(20000, generator=g)
    x[1, [3, 9000, 15000]] = torch.tensor([torch.nan, torch.inf, -torch.nan])
    x[2] = torch.randn(20000, generator=g) * 1e-40  # subnormals
    x[3, 123] = 0.0
    _check(x, 16)
    _check(x.bfloat16(), 16)


@pytest.mark.parametrize("sms", [1, 7, 132])
def test_model_is_independent_of_the_split(sms: int) -> None:
    # Any nblk gives the reference result: the row is split differently on every SM count.
    x = torch.randn(2, 100003, generator=torch.Generator().manual_seed(sms)).bfloat16()
    assert plan(2, 100003, 16, True, sms).nblk == min(math.ceil(BLOCKS_PER_SM * sms / 2), math.ceil(50002 / 2048))
    _check(x, 16, sms)


def test_split_never_leaves_a_block_empty() -> None:
    for nwords in (1, 31, 2048, 2049, 124160, 248320):
        for want in (1, 2, 3, 61, 121, 528):
            nblk, chunk = split(nwords, want)
            assert nblk <= want and (nblk - 1) * chunk < nwords <= nblk * chunk


def test_random_rows_insert_about_k_log_n_per_warp() -> None:
    # The speed argument: a warp that sees n random columns inserts ~k(1 + ln(n/k)) of them, not n.
    x = torch.randn(1, 248320, generator=torch.Generator().manual_seed(1))
    inserts = _check(x, 16)
    n = 2 * BLOCK * UNROLL / 8  # columns per warp: 2 steps of UNROLL tiles
    assert inserts < 2 * 16 * (1 + math.log(n / 16))
