"""A NumPy model of the top-k kernel's algorithm, step for step, fuzzed against the reference on full-size rows.

The simulator can only run the kernel on a few hundred columns. This model replays the same decomposition at vocabulary
scale: the launcher's own plan (blocks per row, chunks), the same word-to-warp assignment and offer order, the same
ballot-and-insert rule on 32-lane lists (two lists when k > 32), the warp fold, the workspace and the last-block
merge. All warps advance together as rows of NumPy arrays.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ignis.kernels.topk import topk_reference
from ignis.kernels.topk_launch import BLOCK, plan, split, words

UNROLL = 4  # ignis.kernels.topk_kernel.UNROLL; checked below without importing numba in every test
EMPTY = np.int64(-(2**63))
LANE = np.arange(32)


def keys_of(x: torch.Tensor) -> np.ndarray:
    """[R, V] float32/bfloat16 -> [R, V] int64 keys, the kernel's encoding written independently in NumPy."""
    if x.dtype == torch.bfloat16:
        b = (x.view(torch.int16).numpy().astype(np.int64) & 0xFFFF) << 16
    else:
        b = x.view(torch.int32).numpy().astype(np.int64) & 0xFFFFFFFF
    b = np.where(b == 0x80000000, 0, b)
    hi = np.where(b >= 0x80000000, b ^ 0xFFFFFFFF, b | 0x80000000)
    hi = np.where((b & 0x7FFFFFFF) > 0x7F800000, 0xFFFFFFFF, hi)
    return ((hi - 0x80000000) << 32) | (0xFFFFFFFF - np.arange(x.shape[1], dtype=np.int64))


class Lists:
    """The register lists of n warps: a [n, 32] (ranks 0..31), b [n, 32] (ranks 32..63), thr [n] the k-th key."""

    def __init__(self, n: int, k: int) -> None:
        self.k = k
        self.a = np.full((n, 32), EMPTY)
        self.b = np.full((n, 32), EMPTY)
        self.thr = np.full(n, EMPTY)
        self.inserts = np.zeros(n, np.int64)

    @staticmethod
    def _insert(lst: np.ndarray, c: np.ndarray) -> np.ndarray:
        up = np.concatenate([lst[:, :1], lst[:, :-1]], axis=1)  # shfl_up by one
        c = c[:, None]
        return np.where(lst > c, lst, np.where((LANE == 0) | (up > c), c, up))

    def offer(self, keys: np.ndarray) -> None:
        """keys [n, 32]: lane j of each warp offers keys[:, j]; candidates in lane order, as ffs walks the ballot."""
        for j in range(32):
            c = keys[:, j]
            go = c > self.thr
            if not go.any():
                continue
            self.inserts += go
            if self.k <= 32:
                self.a[go] = self._insert(self.a[go], c[go])
                self.thr = self.a[:, self.k - 1].copy()
                continue
            a, b, cg = self.a[go], self.b[go], c[go]
            a_last = a[:, 31]
            to_a = cg > a_last
            new_a = np.where(to_a[:, None], self._insert(a, cg), a)
            shifted = np.concatenate([a_last[:, None], b[:, :-1]], axis=1)
            self.b[go] = np.where(to_a[:, None], shifted, self._insert(b, cg))
            self.a[go] = new_a
            self.thr = self.b[:, self.k - 33].copy()

    def top(self) -> np.ndarray:
        return np.concatenate([self.a, self.b], axis=1)[:, : self.k]


def fold(lists: Lists, groups: int, warps: int) -> Lists:
    """Warp 0 of each group offers the first k ranks of warps 1..warps-1, in warp order."""
    k = lists.k
    a = lists.a.reshape(groups, warps, 32)
    b = lists.b.reshape(groups, warps, 32)
    out = Lists(groups, k)
    out.a, out.b, out.thr = a[:, 0].copy(), b[:, 0].copy(), lists.thr.reshape(groups, warps)[:, 0].copy()
    for w in range(1, warps):
        for r, part in enumerate((a, b) if k > 32 else (a,)):
            out.offer(np.where(32 * r + LANE < k, part[:, w], EMPTY))
    return out


def model_topk(x: torch.Tensor, k: int, sms: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """What the kernel computes for x [R, V] with the launcher's plan on `sms` SMs; also mean inserts per warp."""
    rows, ncols = x.shape
    half = x.dtype == torch.bfloat16
    p = plan(rows, ncols, k, half, sms)
    warps, nwords, halves = BLOCK // 32, words(ncols, half), 2 if half else 1
    keys = np.concatenate([keys_of(x), np.full((rows, 2), EMPTY)], axis=1)  # padded: invalid offers index the end
    # Phase 1: warp (row, blk, w), lane l, step t0, tile u reads word start + t0 + u*BLOCK + 32w + l.
    r_ix = np.arange(rows)[:, None, None, None]
    start = (np.arange(p.nblk) * p.chunk)[None, :, None, None]
    end = np.minimum(start + p.chunk, nwords)
    lane_word = start + (32 * np.arange(warps))[None, None, :, None] + LANE
    lists = Lists(rows * p.nblk * warps, k)
    for t0 in range(0, p.chunk, BLOCK * UNROLL):
        for u in range(UNROLL):
            word = lane_word + t0 + u * BLOCK
            for h in range(halves):
                col = 2 * word + h if half else word
                ok = (word < end) & (col < ncols)
                lists.offer(keys[r_ix, np.where(ok, col, ncols)].reshape(-1, 32))
    inserts = lists.inserts.mean()
    lists = fold(lists, rows * p.nblk, warps)
    if p.nblk > 1:
        # Phase 3: the row's nblk*k workspace keys, block after block; warp w lane l reads entry t0 + 32w + l.
        ws = np.concatenate([lists.top().reshape(rows, p.nblk * k), np.full((rows, BLOCK), EMPTY)], axis=1)
        merge = Lists(rows * warps, k)
        for t0 in range(0, p.nblk * k, BLOCK):
            i = t0 + 32 * np.arange(warps)[:, None] + LANE
            merge.offer(ws[:, i].reshape(-1, 32))  # i < nblk*k + BLOCK: past the lists lies EMPTY padding
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
    assert plan(2, 100003, 16, True, sms).nblk == min(math.ceil(4 * sms / 2), math.ceil(50002 / 2048))
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
