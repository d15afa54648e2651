"""The DFlash block recipe: where blocks start, what each slot must predict, and the losses.

Owns: `anchors_for` (random anchors in the completions), `losses` (the block loss with slot weights decaying as
exp(-(k-1)/gamma), plus DFlash2's selector loss) and the teacher-forced acceptance counts they report. Does not own:
the drafter network (ignis.backends.dflash2.model, the same module ignis runs), the data or the tap features.

Recipe (research/dflash.md §4, dflash2.md §4): a block [x_a, MASK x (B-1)] at positions a..a+B-1 sees the target's
tapped features of positions < a and its own rows; slot k predicts x_{a+k}. Anchors are completion tokens whose
successor is one too, as in serving, where the anchor is always a token the target generated. The selector is trained
teacher-forced (its predecessor is the true previous token) as a K-way choice among the unary top-K, the true token
put in place of the K-th candidate when it is missing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ignis.backends.dflash2.model import DrafterModel, block_mask
from ignis.backends.dflash2.selector import transform

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
) -> dict[str, torch.Tensor]:
    """The losses ("loss", "unary", "selector") and teacher-forced counts ("accepted_unary", "accepted_selector",
    "blocks": blocks whose every slot has a label); 1 + accepted / blocks is tokens a round on greedy data.

    The losses are weighted sums divided by `norm`: a step split into micro-batches passes the whole batch's
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
    ids = torch.cat([tokens[owner, a][:, None], torch.full_like(labels, cfg.mask_token_id)], dim=1)
    x = F.embedding(ids, embed) * cfg.input_embedding_scale
    ctx = [(kk.view(b, seq, *kk.shape[1:])[owner], vv.view(b, seq, *vv.shape[1:])[owner]) for kk, vv in kv]
    masks = [block_mask(cfg, i, pos.expand(a.shape[0], -1), q_pos) for i in range(cfg.num_layers)]
    hidden = model.block(x, q_pos, ctx, masks)[:, 1:]  # [n, k, H]
    logits = transform(cfg, F.linear(hidden, head).float())  # [n, k, V]
    weight = slot_weights(mask, anchors, k, gamma)  # [n, k]
    valid = weight > 0
    norm = (weight.sum() if norm is None else norm).clamp_min(1e-6)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    out = {"unary": (ce.view_as(weight) * weight).sum() / norm}
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
        sce = F.cross_entropy(scores.reshape(-1, scores.shape[-1]), target.reshape(-1), reduction="none")
        out["selector"] = (sce.view_as(weight) * weight).sum() / norm
        out["loss"] = out["unary"] + SELECTOR_WEIGHT * out["selector"]
        chosen = cand.gather(-1, scores.argmax(-1, keepdim=True))[..., 0]
    else:
        out["selector"] = torch.zeros((), device=dev)
        out["loss"] = out["unary"]
        chosen = unary_pick
    full = valid.all(-1)  # blocks whose every slot has a label: their accepted length is defined
    for name, pick in (("unary", unary_pick), ("selector", chosen)):
        run = torch.cumprod((pick == labels).int(), dim=1).sum(-1)
        out[f"accepted_{name}"] = (run * full).sum().float()
    out["blocks"] = full.sum().float()
    return out
