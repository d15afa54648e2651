"""The dflash2 drafter's attention and context writes in Triton: `ring_attention`, `ring_write`.

Owns: three Triton kernels and their launches on torch's current stream, allocating only outputs and the splits'
partials, so a CUDA graph captures them:
- `_ring_partial`: a program per (context split, KV head, lane). It reads the KV head's query rows straight from the
  layer's fused q|k|v projection and applies the q norm and RoPE in registers, walks its split's slots of the lane's
  context ring in place (a slot is visible when the position it holds is set, precedes the block's anchor and lies
  inside the sliding window), and split 0 also takes the block's own keys and values (k normed and rotated the same
  way). Scores and P @ V run on tensor cores with an online softmax in fp32; it writes per row the unnormalised
  output, the running max (log2 units) and the sum.
- `_ring_combine`: a program per (block row, query head): merges the splits into the attention output, rounded once
  to the model dtype.
- `_ring_write`: a program per (committed row, KV head): k normed and rotated, and v, stored in the lane's ring slot
  (position mod the ring's size), with the slot's position.
Does not own: the torch path these replace, which stays the reference and the CPU's arithmetic
(ignis.backends.dflash2: `Attention.forward` over `ContextCache.gather` and `block_mask`, `Attention.keys` with
`ContextCache.write_rows`), or when they run (the dflash2 backend's `ring` switch).

Why: the torch path gathered every lane's context, built a mask, concatenated keys, normed and rotated in a dozen
small launches a layer, and ran SDPA on the result: about 25 launches a drafter layer for a few microseconds of work
each. Norms and RoPE round to the model dtype where the torch path's ops did (the norm's output, its product with the
weight, each RoPE product and their sum), so the block's queries and keys are the reference's up to the order of the
norm's sum of squares.

Importing this module imports triton. Without a GPU, TRITON_INTERPRET=1 runs the kernels in Triton's interpreter on
CPU tensors (fp32: the interpreter mishandles bf16 loads).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

NEG = tl.constexpr(-1.0e30)  # the running max before any visible key: finite, so exp2(NEG - NEG) is 1, not NaN
KEYS = 64  # context slots a tile


@triton.jit
def _norm_rope(
    src,  # pointer to row starts [M] (int64 offsets added by the caller) of head vectors
    w,  # [HD] the norm's weight, model dtype
    cos, sin,  # [P, ROT] model dtype: the RoPE tables by position
    rows,  # [M] int64: each vector's position
    live,  # [M] bool
    d,  # [HD] arange
    eps,
    HD: tl.constexpr, ROT: tl.constexpr,
):
    """Qwen3's norm (x / rms(x) in fp32, rounded, times the weight, rounded) then rotate-half RoPE over the first ROT
    dims (each product and the sum rounded): [M, HD] fp32 holding model-dtype values."""
    dt = w.dtype.element_ty
    x = tl.load(src[:, None] + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, 1) / HD + eps)
    wt = tl.load(w + d).to(tl.float32)
    n = ((x * inv[:, None]).to(dt).to(tl.float32) * wt[None, :]).to(dt).to(tl.float32)
    if ROT > 0:
        half: tl.constexpr = ROT // 2
        rotated = d < ROT
        pd = tl.where(rotated, (d + half) % ROT, d)  # the partner dim of rotate-half
        xp = tl.load(src[:, None] + pd[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        wp = tl.load(w + pd).to(tl.float32)
        npart = ((xp * inv[:, None]).to(dt).to(tl.float32) * wp[None, :]).to(dt).to(tl.float32)
        sign = tl.where(d < half, -1.0, 1.0)
        c = tl.load(cos + rows[:, None] * ROT + d[None, :], mask=live[:, None] & rotated[None, :], other=0.0)
        s = tl.load(sin + rows[:, None] * ROT + d[None, :], mask=live[:, None] & rotated[None, :], other=0.0)
        a = (n * c.to(tl.float32)).to(dt).to(tl.float32)
        b = (sign[None, :] * npart * s.to(tl.float32)).to(dt).to(tl.float32)
        n = tl.where(rotated[None, :], (a + b).to(dt).to(tl.float32), n)
    return n


@triton.jit
def _ring_partial(
    qkv,  # [n * B, (NH + 2 NKV) HD] model dtype, rows contiguous: the block rows' q | k | v
    qw, kw,  # [HD] model dtype: q_norm, k_norm weights
    cos, sin,  # [P, ROT] model dtype contiguous: the RoPE tables by position
    kc, vc,  # [lanes + 1, size, NKV, HD] model dtype contiguous: the layer's context ring
    kpos,  # [lanes + 1, size] int64: position held by each slot, -1 if none
    lanes,  # [n] int64
    qpos,  # [n, B] int64 contiguous: the block rows' positions
    opart,  # [n, NKV, NS, R, HD] f32
    mpart, lpart,  # [n, NKV, NS, R] f32
    qkv_t, k_l, k_s, pos_l,  # strides: qkv row, ring lane, ring slot, kpos lane
    used, per_split, window, eps, qk_scale,  # slots scanned, slots a split, window (0: none), eps, scale * log2(e)
    NH: tl.constexpr, NKV: tl.constexpr, B: tl.constexpr, HD: tl.constexpr, ROT: tl.constexpr,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    split, kv, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ns = tl.num_programs(0)
    group: tl.constexpr = NH // NKV
    rows: tl.constexpr = group * B
    dt = qkv.dtype.element_ty
    lane = tl.load(lanes + b)
    d = tl.arange(0, HD)
    r = tl.arange(0, BLOCK_M)
    live = r < rows
    col = r % B  # row r is query head r // B of the KV head, block row r % B
    t = b * B + col
    src = qkv + t.to(tl.int64) * qkv_t + (kv * group + r // B) * HD
    qp = tl.load(qpos + b * B + col, mask=live, other=0)  # [BLOCK_M] int64
    q = _norm_rope(src, qw, cos, sin, qp, live, d, eps, HD, ROT).to(dt)
    anchor = tl.load(qpos + b * B)
    m = tl.full([BLOCK_M], NEG, tl.float32)
    lsum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HD], tl.float32)
    if split == 0:  # the block's own keys: every row sees them (non-causal) or those up to its own (causal)
        j = tl.arange(0, BLOCK_B)
        jl = j < B
        tj = b * B + j
        kp = tl.load(qpos + b * B + j, mask=jl, other=0)
        kb = _norm_rope(qkv + tj.to(tl.int64) * qkv_t + NH * HD + kv * HD, kw, cos, sin, kp, jl, d, eps, HD,
                        ROT).to(dt)
        vb = tl.load(qkv + tj.to(tl.int64)[:, None] * qkv_t + (NH + NKV) * HD + kv * HD + d[None, :],
                     mask=jl[:, None], other=0.0)
        seen = jl[None, :] & live[:, None]
        if CAUSAL:
            seen = seen & (j[None, :] <= col[:, None])
        dq = qp[:, None] - kp[None, :]
        seen = seen & ((window == 0) | ((dq < window) & (-dq < window)))
        s = tl.dot(q, tl.trans(kb), input_precision=PRECISION) * qk_scale
        s = tl.where(seen, s, NEG)
        m = tl.max(s, 1)
        p = tl.where(seen, tl.exp2(s - m[:, None]), 0.0)
        lsum = tl.sum(p, 1)
        acc = tl.dot(p.to(dt), vb, input_precision=PRECISION)
    start = split * per_split
    end = tl.minimum(start + per_split, used)
    ring_k = kc + lane * k_l + kv * HD
    ring_v = vc + lane * k_l + kv * HD
    for k0 in range(start, end, BLOCK_N):
        slot = k0 + tl.arange(0, BLOCK_N)
        inside = slot < end
        held = tl.load(kpos + lane * pos_l + slot, mask=inside, other=-1)  # [BLOCK_N] int64
        seen = (inside & (held >= 0) & (held < anchor))[None, :] & live[:, None]
        seen = seen & ((window == 0) | (qp[:, None] - held[None, :] < window))
        kt = tl.load(ring_k + slot[:, None] * k_s + d[None, :], mask=inside[:, None], other=0.0)
        s = tl.dot(q, tl.trans(kt), input_precision=PRECISION) * qk_scale
        s = tl.where(seen, s, NEG)
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.where(seen, tl.exp2(s - m_new[:, None]), 0.0)
        alpha = tl.exp2(m - m_new)
        lsum = lsum * alpha + tl.sum(p, 1)
        vt = tl.load(ring_v + slot[:, None] * k_s + d[None, :], mask=inside[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(dt), vt, input_precision=PRECISION)
        m = m_new
    at = ((b * NKV + kv) * ns + split) * rows + r
    tl.store(opart + at[:, None] * HD + d[None, :], acc, mask=live[:, None])
    tl.store(mpart + at, m, mask=live)
    tl.store(lpart + at, lsum, mask=live)


@triton.jit
def _ring_combine(
    opart, mpart, lpart,  # as _ring_partial wrote them
    y,  # [n * B, NH * HD] model dtype contiguous
    ns,
    NH: tl.constexpr, NKV: tl.constexpr, B: tl.constexpr, HD: tl.constexpr, BLOCK_S: tl.constexpr,
):
    t, h = tl.program_id(0), tl.program_id(1)
    group: tl.constexpr = NH // NKV
    rows: tl.constexpr = group * B
    b, kv = t // B, h // group
    r = (h % group) * B + t % B
    base = (b * NKV + kv) * ns
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, HD)
    top = tl.full([BLOCK_S], NEG, tl.float32)
    for s0 in range(0, ns, BLOCK_S):
        top = tl.maximum(top, tl.load(mpart + (base + s0 + sp) * rows + r, mask=s0 + sp < ns, other=NEG))
    big = tl.max(top, 0)  # split 0 holds the block's keys, which every row sees: a real score
    num = tl.zeros([HD], tl.float32)
    den = tl.zeros([BLOCK_S], tl.float32)
    for s0 in range(0, ns, BLOCK_S):
        ok = s0 + sp < ns
        at = (base + s0 + sp) * rows + r
        w = tl.where(ok, tl.exp2(tl.load(mpart + at, mask=ok, other=NEG) - big), 0.0)
        o = tl.load(opart + at[:, None] * HD + d[None, :], mask=ok[:, None], other=0.0)
        num += tl.sum(w[:, None] * o, 0)
        den += w * tl.load(lpart + at, mask=ok, other=0.0)
    tl.store(y + t * (NH * HD) + h * HD + d, (num / tl.sum(den, 0)).to(y.dtype.element_ty))


@triton.jit
def _ring_write(
    kv,  # [T, 2 NKV HD] model dtype, rows contiguous: the committed rows' k | v
    kw,  # [HD] model dtype: k_norm weight
    cos, sin,  # [P, ROT] model dtype contiguous: the RoPE tables by position
    lane_ix, positions,  # [T] int64: each row's lane (the scratch lane for rows not kept) and position
    kc, vc,  # [lanes + 1, size, NKV, HD] model dtype contiguous
    kpos,  # [lanes + 1, size] int64
    kv_t, k_l, k_s, pos_l, size, eps,
    NKV: tl.constexpr, HD: tl.constexpr, ROT: tl.constexpr,
):
    t, h = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, HD)
    one = tl.arange(0, 1)  # the helper works on tiles of rows: a tile of one
    lane = tl.load(lane_ix + t)
    pos = tl.load(positions + t)
    rows = t + one.to(tl.int64)
    k = _norm_rope(kv + rows * kv_t + h * HD, kw, cos, sin, pos + one.to(tl.int64), one == 0, d, eps, HD,
                   ROT)  # [1, HD]
    at = lane * k_l + (pos % size) * k_s + h * HD
    tl.store(kc + at + d[None, :], k.to(kc.dtype.element_ty))
    tl.store(vc + at + d, tl.load(kv + t.to(tl.int64) * kv_t + (NKV + h) * HD + d))
    if h == 0:
        tl.store(kpos + lane * pos_l + pos % size, pos)


def warps(block_m: int, hd: int) -> int:
    """Warps of a `_ring_partial` program: 8 once the query tile is 32 x 128 (the 27B drafter's 4 heads x 8 rows),
    where 4 warps spill its two-stage pipeline's registers on sm_90; else 4."""
    return 8 if block_m * hd >= 4096 else 4


def fits(head_dim: int, rotary_dim: int, dtype: torch.dtype) -> bool:
    """The kernels take a power-of-two head width of at least 16, an even rotary width, bf16 or fp32."""
    return (head_dim >= 16 and head_dim & (head_dim - 1) == 0 and rotary_dim % 2 == 0
            and dtype in (torch.bfloat16, torch.float32))


def splits(used: int, lanes: int, kv_heads: int) -> tuple[int, int]:
    """(splits, slots a split) of the context: ignis.kernels.attention's plan, in tiles of KEYS slots."""
    from ignis.kernels.attention import splits as plan

    return plan(used, lanes, kv_heads, KEYS)


def ring_attention(
    qkv: torch.Tensor,  # [n * B, (nh + 2 nkv) hd] model dtype, rows contiguous
    q_weight: torch.Tensor,  # [hd] model dtype
    k_weight: torch.Tensor,  # [hd] model dtype
    eps: float,
    cos: torch.Tensor,  # [P, rot] model dtype contiguous: RoPE tables covering every position of q_pos
    sin: torch.Tensor,
    kc: torch.Tensor,  # [lanes + 1, size, nkv, hd] model dtype contiguous
    vc: torch.Tensor,
    kpos: torch.Tensor,  # [lanes + 1, size] int64 contiguous
    lanes: torch.Tensor,  # [n] int64
    q_pos: torch.Tensor,  # [n, B] int64 contiguous
    used: int,  # ring slots to scan (slots past the longest lane's context hold nothing)
    window: int | None,
    causal: bool,
    nh: int,
) -> torch.Tensor:
    """Each block row's attention over its lane's visible context slots and the block's rows: [n * B, nh * hd] in the
    model dtype, heads in order (what o_proj reads)."""
    n, rows = q_pos.shape
    _, size, nkv, hd = kc.shape
    rot = cos.shape[-1]
    if not fits(hd, rot, qkv.dtype) or qkv.stride(-1) != 1 or not (kc.is_contiguous() and vc.is_contiguous()):
        raise ValueError(f"ring_attention takes a contiguous ring of power-of-two heads >= 16 in bf16/fp32; got "
                         f"{tuple(kc.shape)} {qkv.dtype}")
    used = max(1, min(used, size))
    ns, per = splits(used, n, nkv)
    group_rows = nh // nkv * rows
    block_m = max(16, triton.next_power_of_2(group_rows))
    opart = torch.empty((n, nkv, ns, group_rows, hd), dtype=torch.float32, device=qkv.device)
    mpart = torch.empty((n, nkv, ns, group_rows), dtype=torch.float32, device=qkv.device)
    lpart = torch.empty_like(mpart)
    precision = "ieee" if qkv.dtype == torch.float32 else "tf32"
    _ring_partial[(ns, nkv, n)](
        qkv, q_weight, k_weight, cos, sin, kc, vc, kpos, lanes, q_pos.contiguous(), opart, mpart, lpart,
        qkv.stride(0), kc.stride(0), kc.stride(1), kpos.stride(0),
        used, per, window or 0, float(eps), hd**-0.5 * math.log2(math.e),
        NH=nh, NKV=nkv, B=rows, HD=hd, ROT=rot, CAUSAL=causal,
        BLOCK_M=block_m, BLOCK_B=max(16, triton.next_power_of_2(rows)),
        BLOCK_N=KEYS if qkv.dtype != torch.float32 else 16, PRECISION=precision,
        num_warps=warps(block_m, hd), num_stages=2 if qkv.dtype != torch.float32 else 1,
    )
    y = torch.empty((n * rows, nh * hd), dtype=qkv.dtype, device=qkv.device)
    _ring_combine[(n * rows, nh)](opart, mpart, lpart, y, ns, NH=nh, NKV=nkv, B=rows, HD=hd, BLOCK_S=16,
                                  num_warps=4)
    return y


def ring_write(
    kv: torch.Tensor,  # [T, 2 nkv hd] model dtype, rows contiguous: k | v of the committed rows
    k_weight: torch.Tensor,  # [hd] model dtype
    eps: float,
    cos: torch.Tensor,  # [P, rot] model dtype contiguous: RoPE tables covering every position
    sin: torch.Tensor,
    lane_ix: torch.Tensor,  # [T] int64
    positions: torch.Tensor,  # [T] int64
    kc: torch.Tensor,  # [lanes + 1, size, nkv, hd] model dtype contiguous
    vc: torch.Tensor,
    kpos: torch.Tensor,  # [lanes + 1, size] int64
) -> None:
    """Store each row's normed, rotated k and its v in slot position mod size of its lane, and the position."""
    t = kv.shape[0]
    _, size, nkv, hd = kc.shape
    if not fits(hd, cos.shape[-1], kv.dtype) or kv.stride(-1) != 1 or not (kc.is_contiguous() and vc.is_contiguous()):
        raise ValueError(f"ring_write takes a contiguous ring of power-of-two heads >= 16 in bf16/fp32; got "
                         f"{tuple(kc.shape)} {kv.dtype}")
    if t:
        _ring_write[(t, nkv)](kv, k_weight, cos, sin, lane_ix.contiguous(), positions.contiguous(), kc, vc, kpos,
                              kv.stride(0), kc.stride(0), kc.stride(1), kpos.stride(0), size, float(eps),
                              NKV=nkv, HD=hd, ROT=cos.shape[-1], num_warps=1)
