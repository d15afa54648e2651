"""The `mtp` backend: the checkpoint's own multi-token-prediction layer, applied recursively for K drafts.

Owns: the MTP layer's attention cache (in the target's K/V pool when the engine gives one: the layer attends at the
target's positions, so it reads and writes the pages the target's lane holds) and the drafting loop, in the host
form and the device form (see ignis.backends.base). Does not own: the MTP weights or layer math
(ignis.model.model.MTPHead, loaded with the target), the pool's pages, or acceptance.

At committed position t the layer reads the target's final-normed hidden h_t and the embedding of the token after it,
x_{t+1}, and predicts x_{t+2}. `observe` runs it over every committed row (filling its cache at those positions) and
keeps the output at the lane's last committed row, whose logits are the first draft. Each further draft feeds the
previous draft's embedding and the layer's own previous output one position on. A greedy lane takes the argmax (a
one-hot q); a sampling lane draws each draft from the layer's softmax over its CANDIDATES best tokens, shaped as the
request shapes the target's (`Choice.draw`: its temperature, top-k, top-p and min-p), and hands that distribution to
rejection sampling as q, which keeps more drafts than the argmax would (BENCHMARKS.md) and the output exact either
way. With spec.draft_head = "int4" ("auto" at a 27B's 16-bit head on a GPU) a draft's logits come from the target's
head in 4 bits (ignis.backends.dflash2.packed_head), whose best tokens the 16-bit rows score again: a quarter of the
head's bytes a draft, where the head is most of one.

The device form runs the layer over all C verify rows of every lane (a rejected row's keys sit past the lane's
committed positions, where the next observe or propose overwrites them before any query can see them) and keeps
the output at each lane's last kept row. It reads the verify's RoPE tables (`Committed.step`), the same positions',
rather than gathering them again.
"""

from __future__ import annotations

import dataclasses

import torch

from ignis.backends.base import BackendContext, Choice, Committed, Observation, Proposal, ProposeIn
from ignis.backends.dflash2.packed_head import PackedHead, for_spec
from ignis.errors import ArtifactError
from ignis.kernels.topk import topk
from ignis.model.batch import Segment
from ignis.model.pool import AttnState


# the layer's best tokens a sampled draft is drawn among: a request's nucleus rarely holds more (the sampled suite cuts
# at top-k 20), and the kernel's single top-k finds them
CANDIDATES = 32
# the 4-bit head's candidates a greedy draft is the best of, scored again by the 16-bit rows (RESCORE times as many by
# the 4-bit logits): the selector's width, within the two-launch top-k's
GREEDY_CANDIDATES = 16


class Mtp:
    name = "mtp"
    tap_layers: tuple[int, ...] = ()
    graph_safe = True

    def __init__(self, ctx: BackendContext, head: PackedHead | None = None, settled_head: str | None = None) -> None:
        """head: the 4-bit head whose candidates the drafts are chosen among; None = the target's own head.
        settled_head: spec.draft_head as the mtp backend settled it, which then holds the head; None where a dflash2
        backend holds it (this layer drafting its slot 1)."""
        model = ctx.model
        if model.mtp is None:
            raise ArtifactError(
                f"spec.backend 'mtp' needs the checkpoint's mtp.* weights, and {ctx.model_path} has none; "
                "use spec.backend='off' or a checkpoint with an MTP layer"
            )
        self.model = model
        self.mtp = model.mtp
        self.draft_tokens = ctx.config.spec.draft_tokens or 1
        cfg = model.config
        rows = ctx.lanes + 1  # + the scratch lane
        self.pooled = ctx.kv is not None
        if ctx.kv is not None:
            self.kv = ctx.kv.layer()
        else:  # a cache of its own: every lane's whole context
            shape = (rows, ctx.context + self.draft_tokens + 1, cfg.num_key_value_heads, cfg.head_dim)
            k = torch.zeros(shape, dtype=ctx.dtype, device=ctx.device)  # [lanes + 1, slots, nkv, hd]
            self.kv = AttnState.contiguous(k, torch.zeros_like(k))
        self.last = torch.zeros((rows, cfg.hidden_size), dtype=ctx.dtype, device=ctx.device)  # [lanes + 1, H]
        self.head = head
        self.own_head = settled_head is not None  # nbytes counts the head where it is this backend's own
        # the engine's reported config says which "auto" became
        self.settled_spec = {"draft_head": settled_head} if settled_head is not None else {}

    def nbytes(self) -> int:
        own = 0 if self.pooled else self.kv.k.nbytes + self.kv.v.nbytes  # pooled: counted with the pool
        head = self.head.nbytes() if self.head is not None and self.own_head else 0
        return own + self.last.nbytes + head

    def reset(self, lane: int) -> None:
        self.last[lane].zero_()

    def lane_views(self, lane: int, length: int) -> dict[str, torch.Tensor] | None:
        # Row t's keys read the token after t: the state of 0..length-1 holds token `length` too (the slot's last id).
        # Pooled keys move with the target's (ignis.model.cache.LaneCache.lane_read reads every pooled layer).
        if self.pooled:
            return {"last": self.last[lane]}
        return {"k": self.kv.k[lane, :length], "v": self.kv.v[lane, :length], "last": self.last[lane]}

    def observe(self, obs: list[Observation]) -> None:
        segments, embeds_ids, offset = [], [], 0
        for o in obs:
            n = o.tokens.shape[0]
            following = torch.tensor([o.following], dtype=torch.long, device=o.tokens.device)
            embeds_ids.append(torch.cat([o.tokens[1:], following]))  # x_{t+1} for every committed row t
            segments.append(Segment(lane=o.lane, offset=offset, start=o.start, length=n))
            offset += n
        hidden = torch.cat([o.hidden for o in obs])  # [T, H]
        positions = torch.cat([torch.arange(s.start, s.start + s.length) for s in segments]).to(hidden.device)
        out = self.mtp(
            self.model.embed(torch.cat(embeds_ids)), hidden, positions, tuple(segments), self.kv
        )
        for s in segments:
            self.last[s.lane] = out[s.offset + s.length - 1]

    def propose(self, inp: ProposeIn) -> Proposal:
        lanes = inp.lanes
        choice = Choice.build(inp.temperatures, inp.generators, inp.k, inp.anchors.device, inp.cuts,
                              drafts=inp.drafts)
        hidden = self.last[lanes]  # [n, H]
        drafts: list[torch.Tensor] = []
        qs: list[torch.Tensor] = []
        for step in range(inp.k):
            if step:
                positions = inp.positions + (step - 1)  # the anchor's position, then one further per draft
                segments = tuple(Segment(lane=lane, offset=i, start=int(p), length=1)
                                 for i, (lane, p) in enumerate(zip(lanes, positions.tolist())))
                hidden = self.mtp(self.model.embed(drafts[-1]), hidden, positions, segments, self.kv)
            self._choose(hidden, choice, step, drafts, qs)
        return Proposal(tokens=torch.stack(drafts, dim=1), q=torch.stack(qs, dim=1) if qs else None)

    def propose_lanes(self, lanes: torch.Tensor, anchors: torch.Tensor, positions: torch.Tensor, k: int,
                      choice: Choice, span: int) -> Proposal:
        hidden = self.last.index_select(0, lanes)  # [B, H]
        drafts: list[torch.Tensor] = []
        qs: list[torch.Tensor] = []
        for step in range(k):
            if step:
                at = (positions + (step - 1))[:, None]  # [B, 1]
                dstep = self.model.decode_step(lanes, at, span=span, record=False)
                hidden = self.mtp.decode(drafts[-1], self.model.embed_tokens.weight, hidden, dstep, self.kv)
            self._choose(hidden, choice, step, drafts, qs)
        return Proposal(tokens=torch.stack(drafts, dim=1), q=torch.stack(qs, dim=1) if qs else None)

    def _choose(self, hidden: torch.Tensor, choice: Choice, slot: int, drafts: list[torch.Tensor],
                qs: list[torch.Tensor]) -> None:
        """Slot `slot`'s drafts [n] from the layer's output rows hidden [n, H] onto `drafts`, and their q [n, V]
        float32 onto `qs` when any lane samples: drawn (`Choice.draw`) from the softmax over the layer's CANDIDATES best
        tokens, which one top-k finds, so a draw never sorts or scans the whole vocabulary. Through the 4-bit head
        those are its candidates (a greedy draft the best of GREEDY_CANDIDATES), valued by the 16-bit rows."""
        greedy = choice.uniforms is None
        if self.head is None:
            logits = self.model.logits(hidden)  # [n, V] float32
            vocab = logits.shape[-1]
            if greedy:
                drafts.append(logits.argmax(dim=-1))
                return
            values, ids = topk(logits, min(CANDIDATES, vocab))  # [n, C], largest first: column 0 is the argmax
        else:
            rows = hidden[:, None]  # [n, 1, H]: the head's candidates take rows of slots
            logits = self.head.logits(rows)  # [n, 1, V]
            vocab = logits.shape[-1]
            values, ids = (t[:, 0] for t in self.head.candidates(
                rows, logits, min(GREEDY_CANDIDATES if greedy else CANDIDATES, vocab)))  # [n, C], largest first
            if greedy:
                drafts.append(ids[:, 0])
                return
        q, column = choice.draw(values, torch.zeros_like(ids[:, 0]), slot)
        drafts.append(ids.gather(1, column[:, None])[:, 0])
        qs.append(torch.zeros((ids.shape[0], vocab), dtype=torch.float32, device=ids.device).scatter_(1, ids, q))

    def observe_lanes(self, rows: Committed, span: int) -> None:
        b, c = rows.tokens.shape
        # the verify's step over the same rows where the round gives it (the layer keeps no recurrent record)
        dstep = self.model.decode_step(rows.lanes, rows.positions, span=span, record=False) if rows.step is None \
            else dataclasses.replace(rows.step, record=False)
        out = self.mtp.decode(rows.following.reshape(-1), self.model.embed_tokens.weight,
                              rows.hidden.reshape(b * c, -1), dstep, self.kv)
        kept = out.view(b, c, -1).gather(1, rows.accepted[:, None, None].expand(b, 1, out.shape[-1]))[:, 0]
        self.last.index_copy_(0, rows.lanes, kept)


def load(ctx: BackendContext) -> Mtp:
    settled, head = for_spec(ctx.config.spec.draft_head, ctx.model, ctx.device, allowed=("auto", "full", "int4"))
    return Mtp(ctx, head=head, settled_head=settled)
