"""One round for every lane: propose -> verify -> accept -> commit.

Owns: turning a `RoundPlan` into each lane's committed tokens (first making the plan's retained-state copies and
block-table writes, and resetting each admitted lane that does not resume), and the choice of how: when the model is not
in exact mode and the backend is graph-safe, decoding lanes go through the device round (ignis.engine.device_round:
static shapes, CUDA graphs, one sync) and prompts through the device prefill (ignis.engine.device_prefill: graph
pieces), with one sync for the round (or a chained plan's rounds, queued back to back) and every prompt it ends; exact
mode (the CPU reference), teacher-forced requests, logits shaped on the host and prompts longer than the device
prefill's spans go through the host round below, one target forward over packed segments with acceptance on the host.
Does not own: policy (which lanes, how many rows: ignis.engine.scheduler), stop rules (ignis.engine.request) or drafting
(ignis.backends).

The host round:

1. propose  the backend drafts k tokens after each decoding lane's anchor (off: none).
2. verify   one target forward over every decoding lane's [anchor, d1..dk] and every prefill chunk. Attention layers
            write keys for every row; recurrent layers record per-column state for drafting lanes and keep nothing.
3. accept   greedy: longest run of drafts equal to the argmax, plus the model's token; sampling: rejection sampling.
4. commit   keep the recurrent state after the committed columns, advance the lane, hand the committed rows' hidden
            states to the backend, and return the tokens each request emits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ignis.backends.base import Observation, Proposal, ProposeIn, SpecBackend
from ignis.engine.accept import (
    Anatomy,
    Rule,
    Verdict,
    accept_block,
    accept_greedy,
    accept_sampled,
    teacher_forced,
)
from ignis.engine.device_prefill import DevicePrefill
from ignis.engine.device_round import DeviceRound, Launched, synchronize
from ignis.engine.lane_store import LaneStore
from ignis.engine.request import Request
from ignis.engine.sampling import draw, target_probs
from ignis.engine.scheduler import Prefill, RoundPlan
from ignis.model.batch import Batch, ForwardOut, Segment
from ignis.model.cache import LaneCache
from ignis.model.model import HybridModel


@dataclass
class Emission:
    request: Request
    tokens: list[int]  # committed by the model this round, in order (stop rules not yet applied)
    drafted: int
    accepted: int
    logprobs: list[dict[int, float]] | None = None


@dataclass(frozen=True)
class _Rows:
    """Where one lane's rows sit in the packed batch and in the logits."""

    request: Request
    offset: int
    length: int
    logit_offset: int  # first row of this lane in ForwardOut.logits, -1 if none


class Runner:
    def __init__(
        self,
        model: HybridModel,
        cache: LaneCache,
        backend: SpecBackend,
        device: torch.device,
        sample_drafts: bool = True,
        device_round: DeviceRound | None = None,
        store: LaneStore | None = None,
        device_prefill: DevicePrefill | None = None,
        verify: Rule = "block",
    ) -> None:
        """store: where retained lane states go to the host and come back (None: plans move none); device_prefill:
        where the prompts it takes prefill (None: every prompt prefills in the host round); verify: how sampled lanes'
        drafts are judged (spec.verify)."""
        self.accept_sampled = accept_block if verify == "block" else accept_sampled
        self.device_prefill = device_prefill
        self.store = store
        self.sample_drafts = sample_drafts  # False: one-hot drafts (the drafter's argmax) for sampled requests too
        self.model = model
        self.cache = cache
        self.backend = backend
        self.device = device
        self.device_round = device_round
        self.anatomy: Anatomy | None = None  # set: the host round's sampled verifies are recorded into it

    def defers(self, plan: RoundPlan) -> bool:
        """Whether `start` may queue this plan and leave its read for later (engine.async_scheduling): one round of
        decoding lanes only, each of which chains (Request.chains), on the device round."""
        return (self.device_round is not None and bool(plan.decode) and not plan.prefill and not plan.admitted
                and not plan.moves and plan.rounds == 1 and all(d.request.chains for d in plan.decode))

    @torch.inference_mode()
    def start(self, plan: RoundPlan) -> Launched:
        """Queue a plan `defers` takes, without waiting for it: `finish` reads it. Its requests count it as a round
        ahead of what the host has read (Request.ahead)."""
        assert self.device_round is not None and self.defers(plan)
        self.cache.pool.map(plan.pages)
        self._check_pages(plan)
        launched = self.device_round.start(plan.decode)
        for d in plan.decode:
            d.request.ahead += 1
        return launched

    @torch.inference_mode()
    def follow(self, launched: Launched, pages: list[tuple[int, int, int]]) -> Launched:
        """Queue one more round of `launched`'s lanes after it, from its outputs on the device, before the host reads
        it; `pages`: the block-table writes that give every lane room for it (Scheduler.follow)."""
        assert self.device_round is not None
        self.cache.pool.map(pages)
        self._check_pages(RoundPlan([], launched.decodes, [], rounds=launched.rounds + 1))
        following = self.device_round.follow(launched)
        for d in launched.decodes:
            d.request.ahead += 1
        return following

    def finish(self, launched: Launched) -> list[Emission]:
        """Wait for a round `start` or `follow` queued (not for what was queued after it) and read its lanes'
        tokens."""
        assert self.device_round is not None
        self.device_round.wait(launched)
        for d in launched.decodes:
            d.request.ahead -= launched.rounds
        return self._read(launched)

    def _read(self, launched: Launched) -> list[Emission]:
        """The committed tokens of device rounds the caller has waited for, each request moved past them."""
        assert self.device_round is not None
        emissions: list[Emission] = []
        for e in self.device_round.collect(launched):
            r = e.request
            r.computed += e.accepted + 1
            lp = _logprobs(e.rows, e.tokens, r.params.logprobs)
            emissions.append(Emission(r, e.tokens, e.drafted, e.accepted, lp))
        return emissions

    @torch.inference_mode()
    def run(self, plan: RoundPlan) -> list[Emission]:
        store = self.store
        if plan.moves:
            assert store is not None, "a plan moved retained state, and the runner has no store"
            store.save(plan.moves)  # reads through the table rows as they stand, before pages change hands
        self.cache.pool.map(plan.pages)
        if plan.moves and store is not None:
            store.restore(plan.moves)  # into the pages just mapped, before any admitted lane is reset or written
        for r in plan.admitted:
            if r.resumed == 0:  # else the lane holds the state of tokens 0..resumed-1, kept or just restored
                self.cache.reset(r.lane)
                self.backend.reset(r.lane)
        if not plan.decode and not plan.prefill:
            return []
        self._check_pages(plan)
        if self.device_round is None or any(d.request.forced is not None or d.request.needs_logits for d in plan.decode):
            return self.host_round(plan)
        # Queue the decode round (a chained plan's rounds, each from the last one's outputs) and every prefill piece
        # the device takes, then sync once and read them all.
        rounds = min(plan.rounds, self.device_round.max_rounds)
        launched = self.device_round.start(plan.decode, rounds) if plan.decode else None
        dp = self.device_prefill
        host: list[Prefill] = []
        firsts: list[Request] = []  # prompts whose last piece ran: their first token is on its way to the host
        for p in plan.prefill:
            if dp is not None and dp.takes(p.request, p.length):
                if dp.start(p.request, p.length):
                    firsts.append(p.request)
                p.request.computed += p.length
            else:
                host.append(p)
        synchronize(self.device)
        emissions = self._read(launched) if launched is not None else []
        for r in firsts:
            assert dp is not None
            token, logits = dp.first(r)
            emissions.append(Emission(r, [token], 0, 0, _logprobs(logits, [token], r.params.logprobs)))
        if host:
            emissions += self.host_round(RoundPlan([], [], host))
        return emissions

    def _check_pages(self, plan: RoundPlan) -> None:
        """Every lane holds the page of the last position the plan's rounds write (host ints only: the table's host
        mirror, `KVPool.maps_last`)."""
        pool = self.cache.pool
        writes = [(d.request, d.request.computed + plan.rounds * (1 + d.drafts)) for d in plan.decode] + [
            (p.request, p.request.computed + p.length) for p in plan.prefill]
        short = np.flatnonzero(~pool.maps_last([r.lane for r, _ in writes], [end for _, end in writes]))
        if short.size:
            r, end = writes[short[0]]
            raise AssertionError(f"lane {r.lane} writes positions up to {end - 1} past its {pool.held(r.lane)} pages")

    def host_round(self, plan: RoundPlan) -> list[Emission]:
        proposal = self.propose(plan)
        batch, decode_rows, prefill_rows = self.pack(plan, proposal)
        out = self.model(batch, self.cache, taps=self.backend.tap_layers)
        verdicts = self.accept(plan, proposal, out, decode_rows)
        return self.commit(plan, proposal, verdicts, batch, out, decode_rows, prefill_rows)

    def propose(self, plan: RoundPlan) -> Proposal:
        reqs = [d.request for d in plan.decode]
        k = max((d.drafts for d in plan.decode), default=0)
        if k == 0:
            return Proposal(tokens=torch.empty((len(reqs), 0), dtype=torch.long, device=self.device), q=None)
        inp = ProposeIn(
            lanes=[r.lane for r in reqs],
            anchors=torch.tensor([r.anchor for r in reqs], dtype=torch.long, device=self.device),
            positions=torch.tensor([len(r.tokens) - 1 for r in reqs], dtype=torch.long, device=self.device),
            k=k,
            temperatures=[r.params.temperature if self.sample_drafts else 0.0 for r in reqs],
            generators=[r.generator for r in reqs],
            cuts=[(r.params.top_k, r.params.top_p, r.params.min_p) for r in reqs],
            span=max(len(r.tokens) - 1 for r in reqs),
            greedy_round=all(r.params.greedy for r in reqs),
            drafts=[d.drafts for d in plan.decode],
        )
        return self.backend.propose(inp)

    def pack(self, plan: RoundPlan, proposal: Proposal) -> tuple[Batch, list[_Rows], list[_Rows]]:
        tokens: list[torch.Tensor] = []
        segments: list[Segment] = []
        logit_rows: list[int] = []
        decode_rows: list[_Rows] = []
        prefill_rows: list[_Rows] = []
        offset = 0
        drafts = proposal.tokens
        for i, d in enumerate(plan.decode):
            r, n = d.request, 1 + d.drafts
            anchor = torch.tensor([r.anchor], dtype=torch.long, device=self.device)
            tokens.append(torch.cat([anchor, drafts[i, : d.drafts]]))
            segments.append(Segment(lane=r.lane, offset=offset, start=r.computed, length=n, record=d.drafts > 0))
            decode_rows.append(_Rows(r, offset, n, len(logit_rows)))
            logit_rows.extend(range(offset, offset + n))
            offset += n
        for p in plan.prefill:
            r, n = p.request, p.length
            tokens.append(torch.tensor(r.tokens[r.computed : r.computed + n], dtype=torch.long, device=self.device))
            segments.append(Segment(lane=r.lane, offset=offset, start=r.computed, length=n, prefill=True))
            finishes = r.computed + n == r.fill
            prefill_rows.append(_Rows(r, offset, n, len(logit_rows) if finishes else -1))
            if finishes:
                logit_rows.append(offset + n - 1)
            offset += n
        positions = torch.cat([torch.arange(s.start, s.start + s.length) for s in segments]).to(self.device)
        batch = Batch(
            tokens=torch.cat(tokens),
            positions=positions,
            segments=tuple(segments),
            logit_rows=torch.tensor(logit_rows, dtype=torch.long, device=self.device),
        )
        return batch, decode_rows, prefill_rows

    def accept(self, plan: RoundPlan, proposal: Proposal, out: ForwardOut, rows: list[_Rows]) -> list[Verdict]:
        argmax = out.logits.argmax(dim=-1).tolist() if rows else []
        drafts = proposal.tokens.tolist()
        verdicts = []
        for i, (d, lr) in enumerate(zip(plan.decode, rows)):
            mine = drafts[i][: d.drafts] if drafts else []
            r = d.request
            logits = out.logits[lr.logit_offset : lr.logit_offset + lr.length]
            if r.shaper is not None:  # penalties, bias, grammar: column j sees the drafts before it
                logits = r.shaper.shape(logits, r.tokens, mine)
            if r.params.greedy:
                lane_argmax = argmax[lr.logit_offset : lr.logit_offset + lr.length]
                v = accept_greedy(mine, lane_argmax if r.shaper is None else logits.argmax(dim=-1).tolist())
            else:
                p = target_probs(logits, r.params)
                q = proposal.q[i, : d.drafts] if proposal.q is not None else None
                v = self.accept_sampled(mine, p, q, r.generator)
                if self.anatomy is not None and q is not None:
                    self.anatomy.add(p, q, min(v.accepted + 1, len(mine)))
                    self.anatomy.judge(mine, p, q)
            verdicts.append(v if r.forced is None else teacher_forced(v, mine, r.forced, r.generated))
        return verdicts

    def commit(
        self,
        plan: RoundPlan,
        proposal: Proposal,
        verdicts: list[Verdict],
        batch: Batch,
        out: ForwardOut,
        decode_rows: list[_Rows],
        prefill_rows: list[_Rows],
    ) -> list[Emission]:
        emissions: list[Emission] = []
        observed: list[Observation] = []
        drafts = proposal.tokens.tolist()
        for i, (d, v, lr) in enumerate(zip(plan.decode, verdicts, decode_rows)):
            r, kept = d.request, 1 + v.accepted
            if d.drafts > 0:
                self.cache.commit(r.lane, kept)
            tokens = drafts[i][: v.accepted] + [v.token]
            observed.append(self._observe(r, batch, out, lr.offset, kept, following=v.token))
            r.computed += kept
            lp = _logprobs(out.logits[lr.logit_offset :], tokens, r.params.logprobs)
            emissions.append(Emission(r, tokens, d.drafts, v.accepted if v.measured is None else v.measured, lp))
        for p, lr in zip(plan.prefill, prefill_rows):
            r = p.request
            if lr.logit_offset < 0:
                following = r.tokens[r.computed + lr.length]
                observed.append(self._observe(r, batch, out, lr.offset, lr.length, following=following))
                r.computed += lr.length
                continue
            row = out.logits[lr.logit_offset]
            if r.shaper is not None:
                row = r.shaper.shape(row[None], r.tokens, [])[0]
            if r.forced is not None:
                first = r.forced[r.generated]
            elif r.params.greedy:
                first = int(row.argmax())
            else:
                first = draw(target_probs(row[None], r.params)[0], r.generator)
            observed.append(self._observe(r, batch, out, lr.offset, lr.length, following=first))
            r.computed += lr.length
            emissions.append(Emission(r, [first], 0, 0, _logprobs(out.logits[lr.logit_offset :], [first],
                                                                   r.params.logprobs)))
        if observed:
            self.backend.observe(observed)
        return emissions

    @staticmethod
    def _observe(r: Request, batch: Batch, out: ForwardOut, offset: int, n: int, following: int) -> Observation:
        rows = slice(offset, offset + n)
        return Observation(
            lane=r.lane,
            start=r.computed,
            tokens=batch.tokens[rows],
            following=following,
            hidden=out.hidden[rows],
            taps=out.taps[rows] if out.taps is not None else None,
        )


def _logprobs(logits: torch.Tensor | None, tokens: list[int], top: int | None) -> list[dict[int, float]] | None:
    """Log-probabilities of the raw model distribution for each emitted token, plus the `top` most likely.
    logits: [>= len(tokens), V]: the rows that chose the tokens, first row first."""
    if top is None:
        return None
    assert logits is not None, "logprobs asked for, and no logits kept"
    rows = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
    result = []
    for row, t in zip(rows, tokens):
        entry = {t: float(row[t])}
        if top > 0:
            vals, ids = torch.topk(row, top)
            entry.update({int(i): float(x) for i, x in zip(ids, vals)})
        result.append(entry)
    return result
