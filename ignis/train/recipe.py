"""The DFlash block recipe: where blocks start, what each slot must predict, and the losses.

Owns: `anchors_for` (random anchors in the completions), `losses` (the block loss with slot weights decaying as
exp(-(k-1)/gamma), plus DFlash2's selector loss, each with an optional distillation term against the target's own
distribution, `Teacher`) and the teacher-forced acceptance counts they report. Does not own: the drafter network
(ignis.backends.dflash2.model, the same module ignis runs), the data or the tap features.

Recipe (research/dflash.md §4, dflash2.md §4): a block [x_a, MASK x (B-1)] at positions a..a+B-1 sees the target's
tapped features of positions < a and its own rows; slot k predicts x_{a+k}. Anchors are completion tokens whose
successor is one too, as in serving, where the anchor is always a token the target generated. The selector is trained
teacher-forced (its predecessor is the true previous token) as a K-way choice among the unary top-K, the true token
put in place of the K-th candidate when it is missing. A drafter whose slot 1 another layer drafts (first_draft "mtp")
trains on [x_a, x_{a+1}, MASK x (B-2)] with slot 1's weight zero: it learns slots 2 on, given the true slot 1.

Distillation: sampled lanes verify by rejection sampling, which accepts a draft from q with probability
sum_x min(p(x), q(x)); the hard labels are only samples of the target's p. So each hard term gets a soft twin, the
cross-entropy against p itself (temperature 1), which the target's last decoder layer gives for the price of the
output head on the label rows: slot k's label x_{a+k} was drawn from p at position a+k-1. The cross-entropy is a
proxy for that acceptance; the total variation 1 - sum_x min(p(x), q(x)) is its complement itself (DistillSpec, Zhou
et al. 2023, found it the better objective for sampled drafts), so it can be trained too (`Teacher.tv`), and the
selector's is always reported: the chance a sampled draft at temperature 1 is rejected, teacher-forced.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ignis.backends.dflash2.model import DrafterModel, shared_context_mask
from ignis.backends.dflash2.selector import transform
from ignis.engine.device_sampling import shape_probs

SELECTOR_WEIGHT = 1.0


def gamma_for(block_size: int) -> float:
    """The slot-weight decay the DFlash paper recommends: 7 for blocks of 16, 4 for blocks of 8."""
    return 4.0 if block_size <= 8 else 7.0


def anchors_for(mask: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """mask [b, S] bool (completion tokens), on the CPU -> anchors [b, n] int64: distinct positions a with mask[a] and
    mask[a+1], drawn uniformly. A sequence with fewer than n such positions gets 0 for the rest: position 0 is always
    a prompt token, so those blocks carry no weight."""
    b, seq = mask.shape
    ok = mask[:, :-1] & mask[:, 1:]  # [b, S-1]
    score = torch.rand(ok.shape, generator=gen).masked_fill(~ok, -1.0)
    n = min(n, seq - 1)
    top = score.topk(n, dim=-1)
    return torch.where(top.values >= 0, top.indices, torch.zeros_like(top.indices))


def slot_weights(
    mask: torch.Tensor,  # [b, S] bool
    anchors: torch.Tensor,  # [b, N] int64
    width: int,  # drafts a block
    gamma: float,
) -> torch.Tensor:
    """[b * N, width] float32: exp(-(k-1)/gamma) for slot k where x_{a+k} is a completion token, else 0."""
    b, seq = mask.shape
    owner = torch.arange(b, device=mask.device).repeat_interleave(anchors.shape[1])
    a = anchors.reshape(-1)
    q_pos = a[:, None] + torch.arange(1, width + 1, device=mask.device)  # [n, k]
    valid = mask[owner[:, None], q_pos.clamp(max=seq - 1)] & (q_pos < seq) & mask[owner, a][:, None]
    return torch.exp(-torch.arange(width, device=mask.device) / gamma) * valid


@dataclass(frozen=True)
class Teacher:
    """The target's next-token distribution p = softmax(head(final_norm(h))), h its last decoder layer's output."""

    last: torch.Tensor  # [b, S, H] model dtype: the last decoder layer's outputs (a tap: before the final norm)
    final_norm: Callable[[torch.Tensor], torch.Tensor]  # the target's own final RMSNorm, as it serves
    weight: float  # of each soft term beside its hard one (--distill)
    tv: float = 0.0  # of each total-variation term (--distill-tv); 0: the selector's is reported, not trained
    cut: tuple[int, float] | None = None  # (top_k, top_p) p and q are cut to for the total variation (--tv-cut)

    def probs(
        self,
        head: torch.Tensor,  # [V, H] the target's output head
        owner: torch.Tensor,  # [n] int64: the sequence of each block
        at: torch.Tensor,  # [n, k] int64: positions within it
    ) -> torch.Tensor:
        """[n, k, V] float32: p after each position, computed as the target serves it (no autocast, no gradient)."""
        with torch.no_grad(), torch.autocast(self.last.device.type, enabled=False):
            hidden = self.final_norm(self.last[owner[:, None], at])
            return F.linear(hidden, head).softmax(-1, dtype=torch.float32)


def losses(
    model: DrafterModel,
    embed: torch.Tensor,  # [V, H] the target's input embedding
    head: torch.Tensor,  # [V, H] the target's output head (the embedding again when tied)
    taps: torch.Tensor,  # [b, S, F] the target's tapped layer outputs
    tokens: torch.Tensor,  # [b, S] int64
    mask: torch.Tensor,  # [b, S] bool: completion tokens (the target's own), the rest is prompt or padding
    anchors: torch.Tensor,  # [b, N] int64
    gamma: float,
    norm: torch.Tensor | None = None,  # [] the slot-weight sum to divide by; None: these blocks' own
    teacher: Teacher | None = None,  # None: hard labels only
) -> dict[str, torch.Tensor]:
    """The losses ("loss", "unary", "selector", "soft_unary", "soft_selector", "tv_unary", "tv_selector") and
    teacher-forced counts ("accepted_unary", "accepted_selector", "blocks": blocks whose every slot has a label);
    1 + accepted / blocks is tokens a round on greedy data.

    loss = unary + w * soft_unary + SELECTOR_WEIGHT * (selector + w * soft_selector)
           + t * (tv_unary + SELECTOR_WEIGHT * tv_selector), w = teacher.weight, t = teacher.tv: the hard terms are
    cross-entropies against the labels, the soft ones against the teacher's p (the selector's over its K candidates,
    p not renormalized: mass outside them carries no gradient), the tv ones 1 - sum min(p, q) with q the unary softmax
    or the selector's softmax over its candidates (p's mass outside them counts as rejected). Without a teacher the
    soft and tv terms are 0; tv_unary, a vocabulary-sized product, is computed only when t > 0.
    Each is a slot-weighted sum divided by `norm`: a step split into micro-batches passes the whole batch's
    `slot_weights(...).sum()`, so the parts' losses and gradients add up to the whole's exactly."""
    cfg = model.config
    b, seq = tokens.shape
    k, dev = cfg.width, tokens.device
    pos = torch.arange(seq, device=dev)
    kv = model.context_kv(taps.reshape(b * seq, -1), pos.repeat(b))  # computed once per position
    owner = torch.arange(b, device=dev).repeat_interleave(anchors.shape[1])  # [n]: sequence of each block
    a = anchors.reshape(-1)
    q_pos = a[:, None] + torch.arange(k + 1, device=dev)  # [n, B]
    at = q_pos[:, 1:].clamp(max=seq - 1)
    labels = tokens[owner[:, None], at]  # [n, k]
    # a drafter whose slot 1 another layer drafts (first_draft "mtp") sees that token in its block and learns slots 2..k
    given = 1 if cfg.first_draft else 0
    ids = torch.cat([tokens[owner, a][:, None], labels[:, :given],
                     torch.full_like(labels[:, given:], cfg.mask_token_id)], dim=1)
    x = F.embedding(ids, embed) * cfg.input_embedding_scale
    # One copy of a sequence's context for all its blocks (blocks are sequence-major: a = anchors.reshape(-1)).
    ctx = [(kk.view(b, seq, *kk.shape[1:]), vv.view(b, seq, *vv.shape[1:])) for kk, vv in kv]
    per = anchors.shape[1]
    masks = [shared_context_mask(cfg, i, pos.expand(b, -1), q_pos.view(b, per, k + 1)) for i in range(cfg.num_layers)]
    hidden = model.block(x, q_pos, ctx, masks)[:, 1:]  # [n, k, H]
    logits = transform(cfg, F.linear(hidden, head).float())  # [n, k, V]
    weight = slot_weights(mask, anchors, k, gamma)  # [n, k]
    if given:
        weight = torch.cat([torch.zeros_like(weight[:, :given]), weight[:, given:]], dim=1)
    valid = weight[:, given:] > 0
    norm = (weight.sum() if norm is None else norm).clamp_min(1e-6)
    logp = logits.log_softmax(-1)  # [n, k, V]
    out = {"unary": _weighted(-logp.gather(-1, labels[..., None])[..., 0], weight, norm)}
    zero = torch.zeros((), device=dev)
    # Slot k's label x_{a+k} is what the target drew from its distribution after position a+k-1.
    p = None if teacher is None else teacher.probs(head, owner, q_pos[:, :-1].clamp(max=seq - 1))  # [n, k, V]
    out["soft_unary"] = zero if p is None else _weighted(-(p * logp).sum(-1), weight, norm)
    tv = 0.0 if teacher is None else teacher.tv
    cut = None if teacher is None else teacher.cut
    p_tv = p if p is None or cut is None else _cut(p.clamp_min(1e-30).log(), cut)  # p as a cut request sees it
    q_unary = None if p_tv is None or tv == 0 else logp.exp() if cut is None else _cut(logits, cut)
    out["tv_unary"] = zero if p_tv is None or q_unary is None else _weighted(_rejected(p_tv, q_unary), weight, norm)
    unary_pick = logits.argmax(-1)
    if model.candidate_selector is not None:
        sel = model.candidate_selector
        cand = logits.detach().topk(cfg.selector_top_k, dim=-1).indices  # [n, k, K]: the serving set
        missing = ~(cand == labels[..., None]).any(-1)
        cand[..., -1] = torch.where(missing, labels, cand[..., -1])
        target = (cand == labels[..., None]).int().argmax(-1)  # [n, k]
        prev = torch.cat([ids[:, :1], labels[:, :-1]], dim=1)  # teacher forcing: the true previous token
        hp = sel.hidden_projection(hidden)
        edge = torch.einsum("nkr,nkcr->nkc", sel.predecessor_codebook[prev] * hp, sel.successor_codebook[cand])
        scores = logits.gather(-1, cand) + edge.float()
        slogp = scores.log_softmax(-1)  # [n, k, K]
        out["selector"] = _weighted(-slogp.gather(-1, target[..., None])[..., 0], weight, norm)
        out["soft_selector"] = zero if p is None else _weighted(-(p.gather(-1, cand) * slogp).sum(-1), weight, norm)
        q_sel = slogp.exp() if cut is None else _cut(scores, cut)  # the draft distribution as the engine serves it
        out["tv_selector"] = zero if p_tv is None else _weighted(_rejected(p_tv.gather(-1, cand), q_sel), weight, norm)
        chosen = cand.gather(-1, scores.argmax(-1, keepdim=True))[..., 0]
    else:
        out["selector"] = out["soft_selector"] = out["tv_selector"] = zero
        chosen = unary_pick
    out["loss"] = out["unary"] + SELECTOR_WEIGHT * out["selector"]
    if teacher is not None:
        out["loss"] = out["loss"] + teacher.weight * (out["soft_unary"] + SELECTOR_WEIGHT * out["soft_selector"])
        if tv:
            out["loss"] = out["loss"] + tv * (out["tv_unary"] + SELECTOR_WEIGHT * out["tv_selector"])
    full = valid.all(-1)  # blocks whose every slot has a label: their accepted length is defined
    for name, pick in (("unary", unary_pick), ("selector", chosen)):
        run = torch.cumprod((pick == labels)[:, given:].int(), dim=1).sum(-1)  # the slots the drafter drafts
        out[f"accepted_{name}"] = (run * full).sum().float()
    out["blocks"] = full.sum().float()
    return out


def _cut(logits: torch.Tensor, cut: tuple[int, float]) -> torch.Tensor:
    """logits [..., W] -> softmax within top-k and top-p (cut), renormalised: ignis.engine.device_sampling.shape_probs
    at T = 1, as the engine shapes p and q for a request with that cut. The cut is a constant mask; the gradient
    flows through the kept logits."""
    rows = logits.reshape(-1, logits.shape[-1]).float()
    n = rows.shape[0]
    probs = shape_probs(rows, rows.new_ones(n), torch.full((n,), cut[0], dtype=torch.int64, device=rows.device),
                        rows.new_full((n,), cut[1]), rows.new_zeros(n))
    return probs.view(logits.shape)


def _rejected(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...]: 1 - sum min(p, q), the chance rejection sampling turns down a draft drawn from q."""
    return 1.0 - torch.minimum(p, q).sum(-1)


def _weighted(per_slot: torch.Tensor, weight: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """per_slot [n, k] -> []: the slot-weighted sum over `norm`."""
    return (per_slot * weight).sum() / norm
