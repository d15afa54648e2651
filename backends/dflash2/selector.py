"""Choosing drafts from the drafter's logits: DFlash2's candidate selector, and the plain pick of a v1 drafter.

Owns: the top-k over the proposal head's logits, the logit transform (output_multiplier, softcap), the Markov walk
over the candidates, greedy and sampled choice, and the draft distribution q handed to rejection sampling. Does
not own: the logits themselves (.backend runs the head) or acceptance (ignis.engine.accept).

Selector (research/dflash2.md §2): per slot t, the K best tokens by logit get the score
    s[t, c] = unary[t, c] + sum_r A[prev, r] * (P h_t)[r] * B[cand[t, c], r]
with prev the draft chosen at slot t-1 (the anchor for t = 0). Greedy lanes take argmax s (ties to the better
logit); sampling lanes draw from q_t = softmax(s / T) over the K candidates within the request's top-k, top-p and
min-p cuts (Choice.probs), so q_t puts no mass where the target's p has none. q_t depends on the drafted prefix,
which is also what the target conditions on, so chained rejection sampling with these q stays exact. All lanes are
handled in one batch: greedy lanes simply ignore their uniforms, and nothing here reads a device value on the host.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ignis.backends.base import Choice
from ignis.backends.dflash2.config import DrafterConfig
from ignis.backends.dflash2.model import Selector
from ignis.kernels.launch import triton_installed
from ignis.kernels.topk import MAX_K, topk_reference
from ignis.kernels.topk import topk as kernel_topk


# The selector's GPU work after the head in few launches: the top-k over a head's logits in two (ignis.kernels.
# topk_cuda), the 4-bit head's rescoring in two and the greedy walk making its own edges in one (ignis.kernels.
# selector_triton). False: the numba top-k, and the rescoring, the edges and the walk in torch, the reference the
# CPU runs (tools.bench_round --selector times the two).
FUSED = True
# Most rows whose top-k takes the CUDA C++ kernel: on the H200 it took 21, 29 and 41 µs against the numba kernel's
# 23-32, 40-60 and 55-71 at 1, 7 and 14 rows of the 27B's vocabulary, and 127 against 83-123 at 56 (BENCHMARKS.md,
# "The drafter's candidates"), so more rows keep the numba kernel.
CUDA_TOPK_ROWS = 16


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, V] -> (values, ids) [R, k]: largest first, ties to the smaller id, on every device.

    On GPU the two-launch CUDA C++ kernel (FUSED, k <= 32, at most CUDA_TOPK_ROWS rows) or the numba-cuda one, on
    CPU the torch reference; a k beyond the kernels' lists takes the reference, which selects the same way."""
    if fused_on(x) and x.shape[0] <= CUDA_TOPK_ROWS:
        from ignis.kernels import topk_cuda

        if topk_cuda.fits(x, k):
            return topk_cuda.topk(x, k)
    if k <= MAX_K:
        return kernel_topk(x, k)
    return topk_reference(x, k)


def fused_on(x: torch.Tensor) -> bool:
    """Whether the selector's fused kernels run for tensors like x: CUDA, Triton installed, FUSED."""
    return FUSED and x.is_cuda and triton_installed()


def transform(cfg: DrafterConfig, logits: torch.Tensor) -> torch.Tensor:
    """The format's logit processing: times output_multiplier, then the tanh softcap when set."""
    x = logits * cfg.output_multiplier if cfg.output_multiplier != 1.0 else logits
    cap = cfg.final_logit_softcapping
    return torch.tanh(x / cap) * cap if cap else x


def select(
    cfg: DrafterConfig,
    selector: Selector,
    hidden: torch.Tensor,  # [n, k, H] model dtype, device: final-normed drafter rows of slots 1..k
    logits: torch.Tensor,  # [n, k, W] float32, device: the proposal head's raw logits (W = V, or the shortlist's N)
    ids: torch.Tensor | None,  # [W] int64, device: target id of each logit column (shortlist), None = identity
    anchors: torch.Tensor,  # [n] int64, device
    choice: Choice,
    vocab: int,
    candidates: Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]] | None = None,
    fused: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Drafts [n, k] int64 and q [n, k, vocab] float32 (None when every lane is greedy). candidates: the head's own
    choice of the K best (hidden, logits, K) -> (values, ids) [n, k, K] (the 4-bit head's, .packed_head), in place
    of the top-k over `logits`. fused False (exact mode): a greedy walk is the loop, whatever the device."""
    n, k, width = logits.shape
    # A shortlist narrower than top_k offers all its tokens.
    if candidates is None:
        values, cand = topk(logits.reshape(n * k, width), min(cfg.selector_top_k, width))
    else:
        values, cand = candidates(hidden, logits, min(cfg.selector_top_k, width))
    cand = cand.view(n, k, -1)
    if ids is not None:
        cand = ids[cand]
    unary = transform(cfg, values.view(n, k, -1).float())  # [n, k, K]; monotonic, so the candidate set is the same
    if choice.uniforms is None and fused and fused_on(logits):  # every lane greedy: the walk makes its edges
        from ignis.kernels import selector_triton

        hp = selector.hidden_projection(hidden)
        return selector_triton.walk(unary, cand, hp, selector.predecessor_codebook.detach(),
                                    selector.successor_codebook.detach(), anchors), None
    hp = selector.hidden_projection(hidden).float()  # [n, k, r]
    succ = selector.successor_codebook[cand].float()  # [n, k, K, r]
    # Edge scores of every (predecessor, candidate) pair at once: the anchor before slot 0, slot t-1's candidates
    # before slot t. The walk then only picks one row of them per slot.
    first = torch.einsum("nr,nkr->nk", selector.predecessor_codebook[anchors].float() * hp[:, 0], succ[:, 0])
    pairs = None
    if k > 1:
        pred = selector.predecessor_codebook[cand[:, :-1]].float() * hp[:, 1:, None, :]  # [n, k-1, K, r]
        pairs = torch.einsum("ntpr,ntcr->ntpc", pred, succ[:, 1:])  # [n, k-1, K (predecessor), K]
    width_k = cand.shape[-1]
    picks, probs = [], []
    pick = anchors  # unused for slot 0
    for t in range(k):
        if t == 0 or pairs is None:
            edge = first
        else:
            edge = pairs[:, t - 1].gather(1, pick[:, None, None].expand(n, 1, width_k))[:, 0]
        scores = unary[:, t] + edge
        pick = scores.argmax(dim=-1)
        if choice.uniforms is not None:
            p, pick = choice.draw(scores, pick, t)
            probs.append(p)
        picks.append(pick)
    tokens = cand.gather(-1, torch.stack(picks, dim=1)[..., None])[..., 0]
    if choice.uniforms is None:
        return tokens, None
    q = torch.zeros((n, k, vocab), dtype=torch.float32, device=logits.device)
    return tokens, q.scatter_(-1, cand, torch.stack(probs, dim=1))


def pick(
    cfg: DrafterConfig,
    logits: torch.Tensor,  # [n, k, W] float32, device: raw logits of the proposal head
    ids: torch.Tensor | None,  # [W] int64, device: target id of each column, None = identity
    choice: Choice,
    vocab: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A v1 drafter's drafts: argmax per slot, or a draw from the lane's shaped softmax(logits / T) (Choice.probs);
    slots are independent."""
    n, k, width = logits.shape
    x = transform(cfg, logits)
    best = x.argmax(dim=-1)  # [n, k]
    if choice.uniforms is None:
        return (best if ids is None else ids[best]), None
    p, chosen = choice.draw(x, best, None)
    q = p if ids is None else torch.zeros((n, k, vocab), dtype=torch.float32, device=x.device).index_copy_(2, ids, p)
    return (chosen if ids is None else ids[chosen]), q
