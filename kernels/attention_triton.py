"""Paged attention on tensor cores, in Triton, for verify rounds (any 1..64 query rows a KV head): `attend`.

Owns: two Triton kernels and their launches, on torch's current stream (Triton launches there), with nothing allocated
but the outputs and the splits' partials (torch.empty), so a CUDA graph captures them:
- `_partial`: a program per (context split, KV head, lane). It loads the KV head's R query rows once (padded to
  BLOCK_M >= 16 rows for tl.dot), walks its split's key slots BLOCK_N at a time, looking each slot's page up in the
  table (slot s of lane l: page table[l, s // page], row s % page, so a tile may straddle pages of any size), takes
  the scores and P @ V on tensor cores (tl.dot) with an online softmax in fp32, and writes per row the unnormalised
  output o, the running max m (in log2 units) and the sum l.
- `_combine`: a program per (row of the round, query head): merges the splits' (m, l, o) and applies the output gate,
  rounding where the torch path (attention output in the model dtype, then o * sigmoid(gate)) rounds.
Does not own: the choice of path and the split plan (ignis.kernels.attention: `attend`, `splits`), the torch
reference (`attend_reference`) or the numba decode kernel. docs/adr/0009-triton-paged-attention.md has the why.

Importing this module imports triton; ignis.kernels.attention imports it only when a call takes this path. Without
a GPU, TRITON_INTERPRET=1 runs the same kernels in Triton's interpreter on CPU tensors (fp32: the interpreter
mishandles bf16 loads).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

NEG = tl.constexpr(-1.0e30)  # the running max before any visible key: finite, so exp2(NEG - NEG) is 1, not NaN


@dataclass(frozen=True)
class Tiles:
    """How `_partial` cuts its work: key slots a tile (BLOCK_N), warps a program, pipeline stages of K/V tiles."""

    keys: int
    warps: int
    stages: int


def tiles(rows: int, hd: int, dtype: torch.dtype) -> Tiles:
    """The tiles for R = `rows` query rows of head width hd (compiled for sm_90: no spills in bf16, shared memory
    within an SM's). bf16 at hd 256: 32 keys keep K and V of two stages (64 KiB) beside the queries (up to 32 KiB);
    one warpgroup (4 warps) holds 64 rows x 256 fp32 accumulators without spilling, and on the H200 at a 1,024-key
    span ran 8 lanes x 8 columns in 33.8 µs against 45.9 with 8 warps (1 x 8: 17.6 against 17.9). fp32 (a correctness
    path: its products are IEEE FMAs, not tensor cores) takes 16 keys and one stage."""
    if dtype == torch.float32:
        return Tiles(16, 8, 1)
    return Tiles(64 if hd <= 128 else 32, 4, 2)


def rows_block(rows: int) -> int:
    """BLOCK_M: the rows padded to a power of two of at least 16 (tl.dot's smallest)."""
    return max(16, triton.next_power_of_2(rows))


@triton.jit
def _partial(
    q,  # [B, nkv, R, HD] model dtype, last dim contiguous
    kc,  # [pages, page, nkv, HD] model dtype, last dim contiguous
    vc,  # as kc, same strides
    table,  # [L, width] int64
    lanes,  # [B] int64
    positions,  # [B, C] int64
    opart,  # [B, nkv, NS, R, HD] f32 contiguous: unnormalised
    mpart,  # [B, nkv, NS, R] f32 contiguous: running max, log2 units
    lpart,  # [B, nkv, NS, R] f32 contiguous
    q_b, q_h, q_r, k_p, k_s, k_h, table_l, table_i, pos_b, pos_c,  # strides
    rows, cols, page, per_split, qk_scale,  # R, C, slots a page, slots a split, scale * log2(e)
    HD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    split, kv, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ns, nkv = tl.num_programs(0), tl.num_programs(1)
    lane = tl.load(lanes + b)
    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HD)
    live = r < rows
    qt = tl.load(q + b * q_b + kv * q_h + r[:, None] * q_r + d[None, :], mask=live[:, None], other=0.0)
    # row r is column r % C of its query head; padding rows see nothing
    pos = tl.load(positions + b * pos_b + (r % cols) * pos_c, mask=live, other=-1)  # [BLOCK_M] int64
    start = split * per_split  # a multiple of BLOCK_N: a tile never crosses into the next split
    end = tl.minimum(start + per_split, tl.max(pos, 0) + 1)  # no row sees past the furthest column
    m = tl.full([BLOCK_M], NEG, tl.float32)
    lsum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HD], tl.float32)
    for k0 in range(start, end, BLOCK_N):
        slot = k0 + tl.arange(0, BLOCK_N)
        inside = slot < end  # also keeps the table read inside the lane's row
        pg = tl.load(table + lane * table_l + (slot // page) * table_i, mask=inside, other=0)  # [BLOCK_N] int64
        at = pg * k_p + (slot % page) * k_s + kv * k_h
        kt = tl.load(kc + at[:, None] + d[None, :], mask=inside[:, None], other=0.0)  # [BLOCK_N, HD]
        s = tl.dot(qt, tl.trans(kt), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N] f32
        seen = slot[None, :] <= pos[:, None]
        s = tl.where(seen, s, NEG)
        m_new = tl.maximum(m, tl.max(s, 1))
        # masked, not only small: a row with nothing visible yet has m_new = NEG, where exp2(s - m_new) would be 1
        p = tl.where(seen, tl.exp2(s - m_new[:, None]), 0.0)
        alpha = tl.exp2(m - m_new)
        lsum = lsum * alpha + tl.sum(p, 1)
        vt = tl.load(vc + at[:, None] + d[None, :], mask=inside[:, None], other=0.0)  # [BLOCK_N, HD]
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
        m = m_new
    at = ((b * nkv + kv) * ns + split) * rows + r  # [BLOCK_M]: the row's index in mpart, lpart
    tl.store(opart + at[:, None] * HD + d[None, :], acc, mask=live[:, None])
    tl.store(mpart + at, m, mask=live)
    tl.store(lpart + at, lsum, mask=live)


@triton.jit
def _combine(
    opart,  # [B, nkv, NS, R, HD] f32 contiguous
    mpart,  # [B, nkv, NS, R] f32 contiguous, log2 units
    lpart,  # [B, nkv, NS, R] f32 contiguous
    qkv,  # [T, ...] model dtype, last dim contiguous: query head h's gate is qkv[t, h * 2 HD + HD :][:HD]
    y,  # [T, nh * HD] model dtype contiguous
    qkv_t, ns, rows, cols, group, nkv,  # qkv's row stride, NS, R, C, query heads a KV head, KV heads
    HD: tl.constexpr, BLOCK_S: tl.constexpr,
):
    t, h = tl.program_id(0), tl.program_id(1)
    nh = tl.num_programs(1)
    b, kv = t // cols, h // group
    r = (h % group) * cols + t % cols
    base = (b * nkv + kv) * ns
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, HD)
    top = tl.full([BLOCK_S], NEG, tl.float32)
    for s0 in range(0, ns, BLOCK_S):
        top = tl.maximum(top, tl.load(mpart + (base + s0 + sp) * rows + r, mask=s0 + sp < ns, other=NEG))
    big = tl.max(top, 0)  # split 0 holds slot 0, which every row sees: a real score
    num = tl.zeros([HD], tl.float32)
    den = tl.zeros([BLOCK_S], tl.float32)
    for s0 in range(0, ns, BLOCK_S):
        ok = s0 + sp < ns
        at = (base + s0 + sp) * rows + r
        w = tl.where(ok, tl.exp2(tl.load(mpart + at, mask=ok, other=NEG) - big), 0.0)
        o = tl.load(opart + at[:, None] * HD + d[None, :], mask=ok[:, None], other=0.0)
        num += tl.sum(w[:, None] * o, 0)
        den += w * tl.load(lpart + at, mask=ok, other=0.0)
    out = y.dtype.element_ty
    att = (num / tl.sum(den, 0)).to(out).to(tl.float32)
    g = tl.load(qkv + t * qkv_t + h * 2 * HD + HD + d).to(tl.float32)
    gate = (1.0 / (1.0 + tl.exp(-g))).to(out).to(tl.float32)
    tl.store(y + t * (nh * HD) + h * HD + d, (att * gate).to(out))


def attend(
    q: torch.Tensor,  # [B, nkv, R, hd] model dtype: rows g * C + c (query head g of the KV head, column c)
    kc: torch.Tensor,  # [pages, page, nkv, hd] model dtype: the K pages
    vc: torch.Tensor,  # as kc: the V pages
    table: torch.Tensor,  # [L, width] int64: the page of each lane's slots i*page..(i+1)*page-1
    lanes: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B, C] int64: column c sees key slots 0..positions[b, c]
    span: int,  # key slots each lane's row may read (the round's bound on positions)
    scale: float,
    qkv: torch.Tensor,  # [T, ...] model dtype: the projection the gates are read from
    nh: int,
    per_split: int | None = None,  # key slots a split, a multiple of the tile; None: ignis.kernels.attention.splits
    tile: Tiles | None = None,  # None: `tiles`
) -> torch.Tensor:
    """softmax(q k^T * scale) v over each lane's visible slots, times sigmoid(gate): [T, nh * hd] model dtype, as
    ignis.kernels.attention.attend_reference computes it."""
    from ignis.kernels.attention import TRITON_ROWS, splits, triton_fits

    if not triton_fits(q):
        raise ValueError(f"the Triton attention takes 1..{TRITON_ROWS} rows a KV head, a power-of-two head width "
                         f">= 16 and bf16 or fp32; got {tuple(q.shape)} {q.dtype}")
    if kc.stride() != vc.stride() or {q.stride(-1), kc.stride(-1), qkv.stride(-1)} != {1}:
        raise ValueError("q, the K and V pages (of equal strides) and qkv need contiguous last dims")
    b, nkv, rows, hd = q.shape
    cols, group = positions.shape[1], nh // nkv
    if rows != group * cols:
        raise ValueError(f"{rows} query rows a KV head are not {group} query heads x {cols} columns")
    tile = tile or tiles(rows, hd, q.dtype)
    if per_split is None:
        ns, per = splits(span, b, nkv, tile.keys)
    else:
        if per_split % tile.keys:
            raise ValueError(f"per_split {per_split} is not a multiple of the key tile {tile.keys}")
        ns, per = -(-span // per_split), per_split
    opart = torch.empty((b, nkv, ns, rows, hd), dtype=torch.float32, device=q.device)
    mpart = torch.empty((b, nkv, ns, rows), dtype=torch.float32, device=q.device)
    lpart = torch.empty_like(mpart)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 is ignored for bf16 operands
    _partial[(ns, nkv, b)](
        q, kc, vc, table, lanes, positions, opart, mpart, lpart,
        *q.stride()[:3], *kc.stride()[:3], *table.stride(), *positions.stride(),
        rows, cols, kc.shape[1], per, float(scale) * math.log2(math.e),
        HD=hd, BLOCK_M=rows_block(rows), BLOCK_N=tile.keys, PRECISION=precision, num_warps=tile.warps,
        num_stages=tile.stages,
    )
    t = b * cols
    y = torch.empty((t, nh * hd), dtype=q.dtype, device=q.device)
    _combine[(t, nh)](opart, mpart, lpart, qkv, y, qkv.stride(0), ns, rows, cols, group, nkv,
                      HD=hd, BLOCK_S=16, num_warps=4)
    return y
