"""The dflash2 selector's GPU work after the proposal head, in Triton: `rescore` and `walk`.

Owns: three kernels and their launches on torch's current stream (outputs and partials allocated here, so a CUDA
graph captures them):
- `_rescore_parts`: a program per (row, slice of the hidden size): the row's wide candidates' dot products with their
  rows of the target's 16-bit output head over the slice, in fp32.
- `_rescore_top`: a program per row: the slices' sums added in slice order, rounded to the head's dtype as the
  target's own logits are, and the k best of them, largest first, ties to the smaller token id.
- `_walk`: a program per lane: the greedy Markov walk over its slots' candidates, each slot's edge scores made from
  the selector's codebooks for the token picked before it (the anchor before slot 0).
Does not own: the proposal head or the wide top-k that feeds `rescore` (ignis.backends.dflash2.packed_head,
ignis.kernels.topk_cuda), the scores' definition and the reference loop (ignis.backends.dflash2.selector), or
sampled lanes' draws (the selector's loop and ignis.kernels.draw_triton).

Why: in torch the rescoring was a sort of the ids, a gather of head rows, a batched product, a widening copy, a
second top-k and a gather; the greedy walk's inputs were a product's widening, codebook gathers, widenings and
products for every (predecessor, candidate) pair of every slot, of which the walk reads one row a slot. About
twenty-five launches of a few microseconds each; here three.

Numerics: every product and sum is fp32, as the torch path's; the sums run in another order (a tree over the hidden
size, the codebooks' rank), so a score may differ from the torch path's in its last bits and a near-tie between two
candidates may go the other way. Drafts only propose: the committed tokens stay the target's. A row's work never
reads another row's, so a row's candidates and a lane's drafts do not depend on what shares the call.

Importing this module imports triton. Without a GPU, TRITON_INTERPRET=1 runs the kernels in Triton's interpreter on
CPU tensors (fp32: the interpreter mishandles bf16 loads).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SLICE = 512  # hidden columns a rescoring program sums


@triton.jit
def _key(v, col):
    """[N] float32 logits and their int64 token ids -> int64 keys whose order is ignis.kernels.topk's (larger value
    first, -0.0 as +0.0, NaN above +inf, then the smaller id) and no two of which are equal."""
    bits = v.to(tl.int32, bitcast=True)
    bits = tl.where(v == 0.0, 0, bits)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    ordered = tl.where(v != v, 0x7FFFFFFF, ordered)
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - col).to(tl.int64)


@triton.jit
def _rescore_parts(
    hidden,  # [R, H] the rows' final hidden states, rows `h_stride` apart
    head,  # [V, H] the target's 16-bit output head, rows `w_stride` apart
    wide,  # [R, W] int64: each row's wide candidates
    parts,  # [R, P, WB] fp32 out: each slice's partial dot products
    H, W, h_stride, w_stride, P,
    WB: tl.constexpr, SLICE: tl.constexpr, BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    j = tl.arange(0, WB)
    ok = j < W
    cand = tl.load(wide + row * W + j, mask=ok, other=0)
    acc = tl.zeros([WB], tl.float32)
    for h0 in tl.static_range(0, SLICE, BLOCK_H):
        h = p * SLICE + h0 + tl.arange(0, BLOCK_H)
        hm = h < H
        x = tl.load(hidden + row * h_stride + h, mask=hm, other=0.0).to(tl.float32)
        w = tl.load(head + cand[:, None] * w_stride + h[None, :], mask=ok[:, None] & hm[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    tl.store(parts + (row * P + p) * WB + j, acc)


@triton.jit
def _rescore_top(
    parts,  # [R, P, WB] fp32
    wide,  # [R, W] int64
    values,  # [R, k] fp32 out
    ids,  # [R, k] int64 out
    W, P, k,
    WB: tl.constexpr, K2: tl.constexpr, PB: tl.constexpr, OUT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, WB)
    ok = j < W
    p = tl.arange(0, PB)
    part = tl.load(parts + (row * P + p[:, None]) * WB + j[None, :], mask=(p < P)[:, None], other=0.0)
    total = tl.zeros([WB], tl.float32)
    for i in tl.static_range(PB):  # slice order, whatever the tree inside each slice
        total += tl.sum(tl.where(p[:, None] == i, part, 0.0), axis=0)
    logit = total.to(OUT).to(tl.float32)  # the head's logits round to its dtype
    cand = tl.load(wide + row * W + j, mask=ok, other=0)
    top = tl.topk(tl.where(ok, _key(logit, cand), -0x7FFFFFFFFFFFFFFF - 1), K2)
    col = 0x7FFFFFFF - (top & 0x7FFFFFFF)
    ordered = (top >> 32).to(tl.int32)
    bits = ordered ^ ((ordered >> 31) & 0x7FFFFFFF)  # the key's order undone: the logit's bits (-0.0 read as +0.0)
    o = tl.arange(0, K2)
    kept = o < k
    tl.store(ids + row * k + o, col, mask=kept)
    tl.store(values + row * k + o, bits.to(tl.float32, bitcast=True), mask=kept)


def rescore(hidden: torch.Tensor, head: torch.Tensor, wide: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [R, H], head [V, H] (the target's 16-bit output head), wide [R, W] int64 (each row's candidates, in any
    order) -> (values [R, k] fp32, ids [R, k] int64): the k of each row's W candidates with the largest logits by the
    head's own rows, rounded to the head's dtype, largest first, ties to the smaller id."""
    rows, hsize = hidden.shape
    width = wide.shape[1]
    if head.shape[1] != hsize or wide.shape[0] != rows or not 1 <= k <= width or head.stride(-1) != 1 \
            or hidden.stride(-1) != 1 or wide.dtype != torch.long:
        raise ValueError(f"rescore takes hidden [R, H], head [V, H] and int64 wide [R, W] with k <= W; got "
                         f"{tuple(hidden.shape)}, {tuple(head.shape)}, {tuple(wide.shape)} {wide.dtype}, k {k}")
    wb = max(2, triton.next_power_of_2(width))
    pieces = triton.cdiv(hsize, SLICE)
    parts = torch.empty((rows, pieces, wb), dtype=torch.float32, device=hidden.device)
    values = torch.empty((rows, k), dtype=torch.float32, device=hidden.device)
    ids = torch.empty((rows, k), dtype=torch.long, device=hidden.device)
    if rows:
        wide = wide.contiguous()
        block_h = min(SLICE, max(16, 8192 // wb))
        _rescore_parts[(rows, pieces)](hidden, head, wide, parts, hsize, width, hidden.stride(0), head.stride(0),
                                       pieces, WB=wb, SLICE=SLICE, BLOCK_H=block_h, num_warps=4)
        out = tl.bfloat16 if head.dtype == torch.bfloat16 else tl.float16 if head.dtype == torch.float16 else tl.float32
        _rescore_top[(rows,)](parts, wide, values, ids, width, pieces, k, WB=wb,
                              K2=max(2, triton.next_power_of_2(k)), PB=max(2, triton.next_power_of_2(pieces)),
                              OUT=out, num_warps=1)
    return values, ids


@triton.jit
def _walk(
    unary,  # [n, k, K] f32 contiguous: each slot's candidates' transformed logits
    cand,  # [n, k, K] int64 contiguous: the candidates' token ids
    hp,  # [n, k, r] contiguous: the selector's hidden projection of each slot's row
    pred,  # [V, r] the predecessor codebook, rows `r` apart
    succ,  # [V, r] the successor codebook
    anchors,  # [n] int64
    tokens,  # [n, k] int64 out
    K, r, k: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_K)
    ok = c < K
    q = tl.arange(0, BLOCK_R)
    rm = q < r
    prev = tl.load(anchors + b)
    for t in tl.static_range(k):
        w = tl.load(pred + prev * r + q, mask=rm, other=0.0).to(tl.float32) \
            * tl.load(hp + (b * k + t) * r + q, mask=rm, other=0.0).to(tl.float32)
        ids = tl.load(cand + (b * k + t) * K + c, mask=ok, other=0)
        s_rows = tl.load(succ + ids[:, None] * r + q[None, :], mask=ok[:, None] & rm[None, :], other=0.0)
        edge = tl.sum(s_rows.to(tl.float32) * w[None, :], axis=1)
        s = tl.where(ok, tl.load(unary + (b * k + t) * K + c, mask=ok, other=0.0) + edge, float("-inf"))
        pick = tl.argmax(s, 0, tie_break_left=True)
        prev = tl.sum(tl.where(c == pick, ids, 0))
        tl.store(tokens + b * k + t, prev)


def walk(unary: torch.Tensor, cand: torch.Tensor, hp: torch.Tensor, pred: torch.Tensor, succ: torch.Tensor,
         anchors: torch.Tensor) -> torch.Tensor:
    """The greedy selector walk of every lane in one launch: per slot the candidate of the best unary + edge score
    (ties to the earlier candidate, as torch's argmax), the edge sum_r pred[prev, r] * hp[slot, r] * succ[cand, r]
    from the token picked at the slot before. unary [n, k, K] f32, cand [n, k, K] int64, hp [n, k, r], pred and succ
    [V, r] (any float dtype, contiguous), anchors [n] int64 -> tokens [n, k] int64."""
    n, k, width = unary.shape
    rank = hp.shape[-1]
    if cand.shape != unary.shape or hp.shape[:2] != (n, k) or pred.shape[1] != rank or succ.shape != pred.shape \
            or not (pred.is_contiguous() and succ.is_contiguous()):
        raise ValueError(f"walk takes unary and cand [n, k, K], hp [n, k, r] and contiguous codebooks [V, r]; got "
                         f"{tuple(unary.shape)}, {tuple(cand.shape)}, {tuple(hp.shape)}, {tuple(pred.shape)}, "
                         f"{tuple(succ.shape)}")
    tokens = torch.empty((n, k), dtype=torch.long, device=unary.device)
    if n:
        _walk[(n,)](unary.contiguous(), cand.contiguous(), hp.contiguous(), pred, succ, anchors.contiguous(), tokens,
                    width, rank, k=k, BLOCK_K=max(2, triton.next_power_of_2(width)),
                    BLOCK_R=max(16, triton.next_power_of_2(rank)), num_warps=4)
    return tokens
