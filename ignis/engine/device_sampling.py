"""Acceptance and sampling for every lane of a round at once, as device ops: no host read, so a round can be captured.

Owns: per-request counter-based uniforms, per-row probability shaping (temperature, top-k, top-p and min-p held as
tensors), over the whole vocabulary or, where every sampling row's top-k is at most CANDIDATES, over each row's
CANDIDATES largest logits only (`shape_candidates`: the same p, held sparse), the scans over a vocabulary's columns
(`row_cumsum`), drawing by inverse CDF, greedy longest-prefix acceptance and speculative rejection sampling over
[B, K] drafts, draft by draft or as a block, against a dense p or a sparse one. Does not own: the
host reference these follow (ignis.engine.accept, ignis.engine.sampling: the same rules, one lane at a time) or which
rows are sampled (ignis.engine.device_round).

Randomness: a uniform is a hash of (request seed, the anchor's position, stream, slot). A lane's anchor position grows
every round, so no number is drawn twice, and a request draws the same numbers alone or beside any other requests.
The hash is murmur3's 32-bit finaliser over int64 tensors, with products split into 16-bit halves so that no
intermediate leaves int64's range.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ignis.kernels.launch import triton_installed
from ignis.kernels.topk import MAX_K, topk

STREAM_ACCEPT = 0  # u_i of draft slot i in rejection sampling
STREAM_BONUS = 1  # the draw of the model's own token (correction or bonus)
STREAM_DRAFT = 2  # a sampling drafter's choice at each slot

_M32 = 0xFFFFFFFF
# Columns a block of `row_cumsum`'s scan on CUDA. torch's scan of the last dimension gives each few rows one block of
# threads, so a round's handful of vocabulary-long rows (248,320 columns at the 27B shape) ran 0.35-0.4 ms a scan on
# the H200, against microseconds for the same bytes cut into rows of this length.
SCAN_BLOCK = 1024
# Tokens a row's p holds on the sparse path: a round takes it when every sampling lane's top-k is 1..CANDIDATES. There
# p is the dense p's nonzero entries (top-k leaves at most that many), and shaping, acceptance and the draws run over
# [rows, CANDIDATES] instead of [rows, vocabulary]: a full sort and a dozen vocabulary-long passes fewer a round.
CANDIDATES = MAX_K


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """(h * c) mod 2**32 for h in [0, 2**32): split c so every partial product fits in int64."""
    lo, hi = c & 0xFFFF, c >> 16
    return (h * lo + (((h * hi) & 0xFFFF) << 16)) & _M32


def _fmix(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def uniforms(
    seeds: torch.Tensor,  # [B] int64, device: each request's seed (any int64)
    positions: torch.Tensor,  # [B] int64, device: the lane's anchor position this round
    stream: int,
    n: int,
) -> torch.Tensor:
    """[B, n] float64 in [0, 1): uniform `slot` of `stream` for each lane this round."""
    slots = torch.arange(n, device=seeds.device, dtype=torch.int64)
    h = _fmix((seeds & _M32) ^ 0x9E3779B9)
    h = _fmix(h ^ ((seeds >> 32) & _M32))
    h = _fmix(h ^ (positions & _M32))
    h = _fmix(h[:, None] ^ (stream * 0x10000 + slots)[None, :])
    return h.to(torch.float64) * (1.0 / 2**32)


def shape_probs(
    logits: torch.Tensor,  # [N, V] float32
    temperature: torch.Tensor,  # [N] float32; rows at 0 (greedy) are shaped at 1 and not used
    top_k: torch.Tensor,  # [N] int64; 0 = off
    top_p: torch.Tensor,  # [N] float32; 1 = off
    min_p: torch.Tensor,  # [N] float32; 0 = off
) -> torch.Tensor:
    """[N, V] float32 rows that sum to 1: ignis.engine.sampling.target_probs with each row's own parameters."""
    vocab = logits.shape[-1]
    t = torch.where(temperature > 0, temperature, 1.0)
    x = logits.float() / t[:, None]
    sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
    use_k = (top_k > 0) & (top_k < vocab)
    kth = sorted_x.gather(1, (top_k - 1).clamp(0, vocab - 1)[:, None])  # [N, 1]
    x = torch.where(use_k[:, None] & (x < kth), float("-inf"), x)
    probs = torch.softmax(x, dim=-1)
    sorted_p = probs.gather(1, order)
    before = row_cumsum(sorted_p) - sorted_p  # mass of strictly larger tokens
    drop_sorted = (before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    probs = probs.masked_fill(drop, 0.0)
    floor = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    probs = probs.masked_fill(probs < floor, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def shape_candidates(
    logits: torch.Tensor,  # [N, V] float32
    temperature: torch.Tensor,  # [N] float32; rows at 0 (greedy) are shaped at 1 and not used
    top_k: torch.Tensor,  # [N] int64: 1..width for every row that is used (0: the row is not cut, and not used)
    top_p: torch.Tensor,  # [N] float32; 1 = off
    min_p: torch.Tensor,  # [N] float32; 0 = off
    width: int = CANDIDATES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cols [N, width] int64, probs [N, width] float32): `shape_probs` for rows whose top-k is at most `width`, held
    on each row's `width` largest logits (ties to the smaller id, as the dense path's stable sort keeps them), in
    token order, every other token's probability zero as there. The same cuts on the same values; only the softmax's
    sum runs over fewer zeros, so the probabilities agree to float32's rounding and a draw at the same uniform takes
    the same token."""
    t = torch.where(temperature > 0, temperature, 1.0)
    values, cols = topk(logits.float(), width)  # [N, W]: temperature > 0 keeps the order
    x = values / t[:, None]
    kth = x.gather(1, (top_k - 1).clamp(0, width - 1)[:, None])  # [N, 1]
    x = torch.where((top_k > 0)[:, None] & (x < kth), float("-inf"), x)
    probs = torch.softmax(x, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly larger tokens: the columns are in sorted order
    probs = probs.masked_fill((before >= top_p[:, None]) & (top_p < 1.0)[:, None], 0.0)
    probs = probs.masked_fill(probs < min_p[:, None] * probs[:, :1], 0.0)  # the first column is the largest
    # in token order, as the dense row's: a draw's inverse CDF then meets the tokens in the same order
    order = cols.argsort(dim=-1)
    return cols.gather(1, order), (probs / probs.sum(dim=-1, keepdim=True)).gather(1, order)


def row_cumsum(x: torch.Tensor, blocked: bool | None = None) -> torch.Tensor:
    """torch.cumsum of x [N, V] over its last dimension. On CUDA (blocked None) a row longer than SCAN_BLOCK is scanned
    a block of columns at a time, and the total of the blocks before each block is added to it after: the same sums
    in another order (to the dtype's rounding). Elsewhere it is torch.cumsum itself, the CPU's reference. Rows stay
    independent, so a row's sums do not depend on the rows beside it."""
    n, v = x.shape
    if not (x.is_cuda if blocked is None else blocked) or v <= SCAN_BLOCK:
        return torch.cumsum(x, dim=-1)
    nb = -(-v // SCAN_BLOCK)
    blocks = F.pad(x, (0, nb * SCAN_BLOCK - v)).view(n, nb, SCAN_BLOCK).cumsum(dim=-1)  # [N, nb, SCAN_BLOCK]
    totals = blocks[:, :, -1].cumsum(dim=-1)  # [N, nb]: the sum through each block
    before = torch.cat([torch.zeros_like(totals[:, :1]), totals[:, :-1]], dim=1)  # [N, nb]: the blocks before it
    return (blocks + before[:, :, None]).view(n, nb * SCAN_BLOCK)[:, :v]


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [N, V] (any non-negative weights) by inverse CDF at u [N] float64 -> [N] int64.

    The first index whose CDF exceeds u * total, so a zero-weight token is never chosen (sampling.draw's rule)."""
    cdf = row_cumsum(probs.double())
    return first_above(cdf, probs, u * cdf[:, -1])


def first_above(cdf: torch.Tensor, probs: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """[N] int64: each row's first index of positive weight whose cdf [N, V] exceeds threshold [N] (the last index of
    positive weight where none does). Over a non-decreasing cdf that is the first index whose cdf exceeds it; a cdf
    summed in pieces may step back by a rounding where a piece starts, and this still never picks a zero weight."""
    positive = probs > 0
    hit = (cdf > threshold[:, None]) & positive
    first = hit.to(torch.uint8).argmax(dim=-1)  # the first True (argmax takes the first of equal maxima)
    last = probs.shape[-1] - 1 - positive.flip(-1).to(torch.uint8).argmax(dim=-1)
    return torch.where(hit.any(dim=-1), first, last)


def accept_greedy(
    drafts: torch.Tensor,  # [B, K] int64
    argmax: torch.Tensor,  # [B, K+1] int64: the model's choice at every column
    allowed: torch.Tensor,  # [B] int64: drafts this lane may keep (0..K)
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted [B], token [B]): the longest run of drafts equal to the argmax, then the argmax after it."""
    k = drafts.shape[1]
    slots = torch.arange(k, device=drafts.device)
    match = (drafts == argmax[:, :k]) & (slots[None, :] < allowed[:, None])
    accepted = match.long().cumprod(dim=1).sum(dim=1)
    return accepted, argmax.gather(1, accepted[:, None])[:, 0]


def settle_reference(
    drafts: torch.Tensor,  # [B, K] int64
    argmax: torch.Tensor,  # [B, K+1] int64
    allowed: torch.Tensor,  # [B] int64
    read_back: torch.Tensor,  # [B, K+2] int64 out: accepted, the drafts, the token
    sampled: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,  # [B] each: accepted, token, greedy
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`settle` in torch ops: the rules, and its result on the CPU."""
    accepted, token = accept_greedy(drafts, argmax, allowed)
    if sampled is not None:
        a_s, t_s, greedy = sampled
        keep = greedy.bool()
        accepted, token = torch.where(keep, accepted, a_s), torch.where(keep, token, t_s)
    following = torch.cat([drafts, token[:, None]], dim=1).scatter(1, accepted[:, None], token[:, None])
    torch.cat([accepted[:, None], drafts, token[:, None]], dim=1, out=read_back)
    return accepted, token, following


def settle(
    drafts: torch.Tensor,  # [B, K] int64
    argmax: torch.Tensor,  # [B, K+1] int64: the model's choice at every column
    allowed: torch.Tensor,  # [B] int64: drafts this lane may keep (0..K)
    read_back: torch.Tensor,  # [B, K+2] int64 out, contiguous
    sampled: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,  # where lanes sample: accept_sampled's
    # (accepted [B], token [B]) and greedy [B] int64 (1: the lane keeps the greedy result)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(accepted [B], token [B], following [B, K+1]) of a round, with `read_back` written: the greedy longest prefix,
    the sampled lanes' own results where they sample, the token after each row (its draft, then the token at the
    first row not kept) and the row the host reads back. One launch on CUDA where Triton runs
    (ignis.kernels.settle_triton); the torch ops elsewhere."""
    if drafts.is_cuda and triton_installed():
        from ignis.kernels.settle_triton import settle as settle_triton

        return settle_triton(drafts, argmax, allowed, read_back, sampled)
    return settle_reference(drafts, argmax, allowed, read_back, sampled)


def accept_sampled(
    drafts: torch.Tensor,  # [B, K] int64
    p: torch.Tensor,  # [B, K+1, W] float32: each column's target distribution (shaped by the request)
    q: torch.Tensor | None,  # [B, K, V] float32: the draft distribution of each slot; None = one-hot at the drafts
    u: torch.Tensor,  # [B, K] float64: acceptance uniforms
    u_token: torch.Tensor,  # [B] float64: the uniform of the emitted token's draw
    allowed: torch.Tensor,  # [B] int64
    cols: torch.Tensor | None = None,  # [B, K+1, W] int64: the tokens p's entries are (`shape_candidates`); None: W = V
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted [B], token [B]) by speculative rejection sampling: draft i is kept when u_i * q_i(d) < p_i(d); at
    the first rejection the token comes from norm(max(0, p - q)) (p without d for one-hot q), after all `allowed`
    drafts from p itself. Each emitted token is distributed exactly as p. A sparse p (`cols`) holds every token p
    gives mass, so the residual, which is zero wherever p is, lives on its entries too."""
    b, k = drafts.shape
    width = p.shape[-1]
    slots = torch.arange(k, device=drafts.device)
    p_d = _at(p[:, :k], None if cols is None else cols[:, :k], drafts)  # [B, K]
    q_d = torch.ones_like(p_d) if q is None else q.gather(2, drafts[..., None])[..., 0]
    ok = (q_d > 0) & (u * q_d < p_d) & (slots[None, :] < allowed[:, None])
    accepted = ok.long().cumprod(dim=1).sum(dim=1)
    p_a = p.gather(1, accepted[:, None, None].expand(b, 1, width))[:, 0]  # [B, W]
    c_a = None if cols is None else cols.gather(1, accepted[:, None, None].expand(b, 1, width))[:, 0]
    rejected = accepted < allowed
    if k == 0:
        return accepted, _token(draw(p_a, u_token), c_a)
    at = accepted.clamp(max=k - 1)[:, None]
    if q is None:
        residual = _without(p_a, c_a, drafts.gather(1, at)[:, 0])
    else:
        q_a = q.gather(1, at[:, :, None].expand(b, 1, q.shape[-1]))[:, 0]
        residual = torch.clamp(p_a - _cols(q_a, c_a), min=0.0)
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_a)
    return accepted, _token(draw(torch.where(rejected[:, None], residual, p_a), u_token), c_a)


def accept_block(
    drafts: torch.Tensor,  # [B, K] int64
    p: torch.Tensor,  # [B, K+1, W] float32
    q: torch.Tensor | None,  # [B, K, V] float32; None = one-hot at the drafts
    u: torch.Tensor,  # [B, K] float64: u_j of the block of j + 1 drafts
    u_token: torch.Tensor,  # [B] float64
    allowed: torch.Tensor,  # [B] int64: a lane's block is its first `allowed` drafts
    cols: torch.Tensor | None = None,  # [B, K+1, W] int64: p's tokens (`shape_candidates`); None: W = V
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted [B], token [B]) by block verification (ignis.engine.accept's docstring, `accept_block` there the
    reference): the longest block of j drafts with u_{j-1} < h_j, then a token from norm(max(0, w_j p_j - q_j)), or
    from p_j after all `allowed`; over p's entries where p is sparse, as `accept_sampled`."""
    b, k = drafts.shape
    width = p.shape[-1]
    if k == 0:
        return allowed.new_zeros(b), _token(draw(p[:, 0], u_token), None if cols is None else cols[:, 0])
    p_d = _at(p[:, :k], None if cols is None else cols[:, :k], drafts).double()  # [B, K]
    q_d = torch.ones_like(p_d) if q is None else q.gather(2, drafts[..., None])[..., 0].double()
    ratio = torch.where(q_d > 0, p_d / q_d.clamp(min=1e-300), 0.0)
    weights = [torch.ones_like(ratio[:, 0])]
    for j in range(k):
        weights.append(torch.clamp(weights[-1] * ratio[:, j], max=1.0))
    w = torch.stack(weights, dim=1)  # [B, K+1]: w_0 .. w_K
    # h_j for blocks of j = 1..K-1 drafts: the residual mass after them over itself plus what w_j leaves
    mid = _residual(w[:, 1:k], p[:, 1:k], None if q is None else q[:, 1:k], drafts[:, 1:k],
                    None if cols is None else cols[:, 1:k]).sum(dim=-1).double()
    room = mid + 1.0 - w[:, 1:k]
    h = torch.cat([torch.where(room > 0, mid / room.clamp(min=1e-300), 0.0), w[:, k:]], dim=1)  # [B, K]: h_1 .. h_K
    sizes = torch.arange(1, k + 1, device=drafts.device)
    h = torch.where(sizes[None, :] == allowed[:, None], w[:, 1:],  # a lane's last draft: h = w
                    torch.where(sizes[None, :] < allowed[:, None], h, 0.0))
    accepted = torch.where(u < h, sizes[None, :], 0).max(dim=1).values  # [B]: the longest block kept
    p_a = p.gather(1, accepted[:, None, None].expand(b, 1, width))[:, 0]  # [B, W]
    c_a = None if cols is None else cols.gather(1, accepted[:, None, None].expand(b, 1, width))[:, 0]
    at = accepted.clamp(max=k - 1)
    q_a = None if q is None else q.gather(1, at[:, None, None].expand(b, 1, q.shape[-1]))[:, 0]
    w_a = w.gather(1, accepted[:, None])[:, 0]  # [B]
    residual = _residual(w_a, p_a, q_a, drafts.gather(1, at[:, None])[:, 0], c_a)
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_a)
    return accepted, _token(draw(torch.where((accepted < allowed)[:, None], residual, p_a), u_token), c_a)


def _residual(w: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None, d: torch.Tensor,
              cols: torch.Tensor | None = None) -> torch.Tensor:
    """max(0, w p - q) over p's last dimension, in p's dtype; w and d have p's shape without it; q None: one-hot at
    d; cols: the tokens of p's entries (None: every token)."""
    wp = w.to(p.dtype)[..., None] * p
    if q is None:
        if cols is not None:
            return torch.where(cols == d[..., None], torch.clamp(wp - 1.0, min=0.0), wp)
        at = d[..., None]
        return wp.scatter(-1, at, torch.clamp(wp.gather(-1, at) - 1.0, min=0.0))
    return torch.clamp(wp - _cols(q, cols), min=0.0)


def _at(p: torch.Tensor, cols: torch.Tensor | None, d: torch.Tensor) -> torch.Tensor:
    """p [..., W] at the tokens d [...]: zero where a sparse p (its tokens `cols`) does not hold d."""
    if cols is None:
        return p.gather(-1, d[..., None])[..., 0]
    return (p * (cols == d[..., None])).sum(dim=-1)


def _cols(q: torch.Tensor, cols: torch.Tensor | None) -> torch.Tensor:
    """q [..., V] at a sparse p's tokens cols [..., W] (q itself where p is dense)."""
    return q if cols is None else q.gather(-1, cols)


def _without(p: torch.Tensor, cols: torch.Tensor | None, d: torch.Tensor) -> torch.Tensor:
    """p [B, W] with token d [B] taken out."""
    if cols is None:
        return p.scatter(1, d[:, None], 0.0)
    return p.masked_fill(cols == d[:, None], 0.0)


def _token(drawn: torch.Tensor, cols: torch.Tensor | None) -> torch.Tensor:
    """The token of a draw's index over p's entries."""
    return drawn if cols is None else cols.gather(1, drawn[:, None])[:, 0]
