"""Which requests hold lanes, how many rows each gets this round and which K/V pages it holds. The scheduler never
touches tensors.

Owns: the waiting queue, lane assignment (first come, first served; a request that extends a retained slot resumes
from it, see ignis.engine.retain), the row budget, and who gets K/V pages when there are too few (the pool's
bookkeeping is ignis.engine.pages). Does not own: what the rows contain (ignis.engine.round), the tensors a retained
slot moves (ignis.engine.lane_store) or the pages themselves (ignis.model.pool).

Prefill is split only at multiples of `prefill_chunk` counted from position 0, so where a prompt is cut never depends
on its neighbours: with exact arithmetic, a request's output is the same alone or beside others. A request resumed
at a position inside a chunk first prefills up to the next multiple, alone in its segment. Decoding lanes always get
their anchor plus drafts; prefill takes whole chunks from what is left of `max_rows`, and the first prefilling lane
always gets at least one chunk so that prompts cannot starve: a long prompt is prefilled a few chunks a round while
every other lane keeps decoding in the same rounds.

Lanes: a free lane with no retained state is taken first; then the free lane whose retained state is the least
recently kept (that state moves to the host or is dropped, per ignis.engine.retain).

Pages (with a shared pool): before a round, every lane holds pages for every position the round writes (its verify
columns, or its prefill chunk). They come from the free list first, then from retained slots (least recently kept
first: the state goes to the host or is dropped, and its lane's pages are freed), then, for a decoding lane or the
first prefilling lane, from the newest running request: it is preempted (its pages freed, its tokens kept, and it is
put back at the front of the queue to prefill its prompt and output again; a request newer than every other gives
way itself). Older requests are never preempted for newer ones, so the oldest always runs to its end: the pool holds
at least one lane's whole context. Other prefilling lanes take fewer chunks, or wait a round. A waiting request is
admitted only when the pool can hold its whole prompt beside what the prompts already running still need.

Chained plans (rounds_per_sync above 1): a plan that only decodes, with no request that needs the host between rounds,
is given pages for rounds_per_sync rounds of every lane's drafts, where max_tokens and the context leave room for
them and free pages hold them (`RoundPlan.rounds`); ignis.engine.round may then queue them all before it reads any.
Followed rounds (engine.async_scheduling): such lanes' next round may be queued before the host reads the last one
(`follow`), on the same terms for the two rounds.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from ignis.engine.pages import Pages
from ignis.engine.request import Request
from ignis.engine.retain import Moves, Retained, Slot


@dataclass(frozen=True)
class Prefill:
    request: Request
    length: int  # rows this round, starting at request.computed


@dataclass(frozen=True)
class Decode:
    request: Request
    drafts: int  # drafts this lane verifies this round (0..K): rows = 1 + drafts


@dataclass(frozen=True)
class RoundPlan:
    admitted: list[Request]  # took a lane this round (reset its state, unless it resumes: request.resumed > 0)
    decode: list[Decode]
    prefill: list[Prefill]
    moves: Moves = field(default_factory=Moves)  # retained state to copy before the round runs
    pages: list[tuple[int, int, int]] = field(default_factory=list)  # block-table writes (lane, index, page), in order
    # decode rounds the plan has room for: every lane keeps its drafts and holds pages for this many rounds (more than
    # one only for a chained plan: decoding lanes only, ignis.engine.round may queue them before one read)
    rounds: int = 1

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill and not self.moves and not self.pages


class Scheduler:
    def __init__(
        self, *, lanes: int, max_rows: int, prefill_chunk: int, max_waiting: int, draft_tokens: int, context: int,
        retained: Retained | None = None, pages: Pages | None = None, rounds_per_sync: int = 1,
    ) -> None:
        """retained: where finished requests' states are kept (None: never kept, every prompt is prefilled whole);
        pages: the K/V pool's pages (None: every lane holds its whole context, nothing is ever short);
        rounds_per_sync: the most rounds a plan of decoding lanes only may chain (engine.rounds_per_sync)."""
        self.rounds_per_sync = rounds_per_sync
        self.retained = retained
        self.pages = pages
        self.draft_tokens = draft_tokens
        self.context = context
        self.lanes: list[Request | None] = [None] * lanes
        self.waiting: deque[Request] = deque()
        self.max_rows = max_rows
        self.prefill_chunk = prefill_chunk
        self.max_waiting = max_waiting
        self.preemptions = 0

    @property
    def running(self) -> list[Request]:
        return [r for r in self.lanes if r is not None]

    def queue_full(self) -> bool:
        return len(self.waiting) >= self.max_waiting + self.lanes.count(None)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def find(self, request_id: str) -> Request | None:
        for r in self.running:
            if r.id == request_id:
                return r
        for r in self.waiting:
            if r.id == request_id:
                return r
        return None

    def release(self, request: Request) -> None:
        """The request leaves its lane (finished or aborted, between rounds); its state is retained when it can be,
        with the pages that hold it, and its other pages are freed."""
        lane = request.lane
        if 0 <= lane < len(self.lanes) and self.lanes[lane] is request:
            self.lanes[lane] = None
            ids = request.state_ids()
            kept = self.retained is not None and ids is not None and self.retained.keep(lane, ids)
            if self.pages is not None:
                self.pages.trim(lane, request.computed if kept else 0)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.lane = -1

    def plan(self) -> RoundPlan:
        moves = Moves()
        if self.retained is not None:
            self.retained.settle()  # the last plan's restores have run
        plan = _Plan(moves)
        for r in self._by_age():  # every decoding lane gets its verify columns' pages, oldest first
            if r.lane >= 0 and not r.prefilling:
                d = Decode(r, r.drafts_allowed(self.draft_tokens, self.context))
                if self._room(r, r.computed + 1 + d.drafts, plan, preempt=True):
                    plan.decode.append(d)
        self._admit(plan)
        budget = self.max_rows - sum(1 + d.drafts for d in plan.decode)
        for r in self._by_age():
            if r.lane < 0 or not r.prefilling:
                continue
            first = not plan.prefill
            chunks = max(budget // self.prefill_chunk, 0 if plan.prefill else 1)
            length = self._chunk(r, chunks) if chunks > 0 else 0
            if length and self.pages is not None:
                spare = self._spare(None)  # as many chunks as free pages and retained slots' hold, at least one
                while chunks > 1 and self.pages.needs(r.lane, r.computed + length) > spare:
                    chunks -= 1
                    length = self._chunk(r, chunks)
                fits = self.pages.needs(r.lane, r.computed + length) <= spare
                if not (fits or first) or not self._room(r, r.computed + length, plan, preempt=first):
                    length = 0
            if length == 0:
                break  # it waits a round, holding its pages; no later prompt jumps ahead of it
            plan.prefill.append(Prefill(r, length))
            budget -= length
        rounds = self._chain(plan)
        pages = self.pages.take_updates() if self.pages is not None else []
        return RoundPlan(plan.admitted, plan.decode, plan.prefill, moves, pages, rounds)

    def _chain(self, plan: _Plan) -> int:
        """rounds_per_sync where the plan only decodes, every lane chains (Request.chains), keeps its drafts for that
        many rounds (max_tokens and context leave room for each one's every column) and gets their pages from the free
        list (no one preempted, no retained slot evicted: chaining saves the host's waits, never state); else 1. A
        lane whose request stops in an earlier round runs the later ones for nothing."""
        n = self.rounds_per_sync
        if n == 1 or not plan.decode or plan.prefill or plan.admitted:
            return 1
        return n if self._rounds_fit(plan.decode, n) else 1

    def follow(self, decodes: list[Decode]) -> list[tuple[int, int, int]] | None:
        """Room for one more round of these decoding lanes, queued while the host has not read the round before it
        (engine.async_scheduling): the block-table writes that give it pages, or None where the lanes must wait for
        the host. It follows where every request still holds its lane and chains, has room for both rounds' columns
        (max_tokens and the context), no waiting request could take a free lane, and free pages hold both rounds (as
        a chained plan's: no one preempted, no retained slot evicted)."""
        if self.waiting and None in self.lanes:
            return None  # a plan admits it first
        for d in decodes:
            r = d.request
            if r.lane < 0 or self.lanes[r.lane] is not r or r.finish_reason is not None:
                return None
        if not self._rounds_fit(decodes, 2):
            return None
        return self.pages.take_updates() if self.pages is not None else []

    def _rounds_fit(self, decodes: list[Decode], n: int) -> bool:
        """Every lane chains (Request.chains), has room for n rounds of its drafts (max_tokens and the context leave
        room for each one's every column) and gets their pages from the free list (what it grew stays with the lane
        where another does not fit: the next plan maps it)."""
        for d in decodes:
            r, cols = d.request, n * (1 + d.drafts)
            if not r.chains or r.params.max_tokens - r.generated < cols or self.context - len(r.tokens) < cols:
                return False
        if self.pages is not None:
            for d in decodes:
                if not self.pages.grow(d.request.lane, d.request.computed + n * (1 + d.drafts)):
                    return False
        return True

    def _chunk(self, r: Request, chunks: int) -> int:
        """Rows of r's prefill this round when it takes `chunks` chunks (one if it starts inside a chunk)."""
        pc, start = self.prefill_chunk, r.computed
        end = (start // pc + (chunks if start % pc == 0 else 1)) * pc  # a multiple of prefill_chunk
        return min(r.fill, end) - start

    def _by_age(self) -> list[Request]:
        return sorted(self.running, key=lambda r: r.t_admit)

    def _room(self, r: Request, positions: int, plan: _Plan, *, preempt: bool) -> bool:
        """Pages for r's positions 0..positions-1: free ones, then retained slots' (least recently kept first), then
        (preempt) the newest running request's not admitted this round, while it is newer than r. False: r gets none
        this round (and was preempted itself when it was the newest, unless it was admitted this round)."""
        if self.pages is None:
            return True
        admitted = {id(a) for a in plan.admitted}
        while not self._grow(r.lane, positions, plan.moves):
            if not preempt:
                return False
            victim = max((q for q in self.running if q is r or id(q) not in admitted), key=lambda q: q.t_admit)
            if victim is r:
                if id(r) not in admitted:
                    self._preempt(r, plan)
                return False
            self._preempt(victim, plan)
        return True

    def _grow(self, lane: int, positions: int, moves: Moves) -> bool:
        """Pages for `lane`'s positions 0..positions-1 from the free list, evicting retained slots on lanes (least
        recently kept first) while it is short; False when even that leaves too few."""
        assert self.pages is not None
        while not self.pages.grow(lane, positions):
            if not self._evict(moves):
                return False
        return True

    def _evict(self, moves: Moves) -> bool:
        """Free the pages of the least recently kept retained slot on a lane (the state goes to the host, or is
        dropped); False when no lane holds one."""
        kept, pages = self.retained, self.pages
        if kept is None or pages is None:
            return False
        on_lanes = [s for s in kept.on_lanes() if pages.held(s.lane)]
        if not on_lanes:
            return False
        lane = min(on_lanes, key=lambda s: s.used).lane
        kept.vacate(lane, moves)
        pages.release(lane)
        return True

    def _preempt(self, r: Request, plan: _Plan) -> None:
        """r leaves its lane and pages and waits in front (it may come back in this plan's admissions, from 0)."""
        assert self.pages is not None
        self.lanes[r.lane] = None
        self.pages.release(r.lane)
        r.preempt()
        self.waiting.appendleft(r)  # newest first: the older of two preempted requests ends up in front
        plan.decode = [d for d in plan.decode if d.request is not r]
        plan.prefill = [p for p in plan.prefill if p.request is not r]
        self.preemptions += 1

    def _admit(self, plan: _Plan) -> None:
        kept, pages = self.retained, self.pages
        # Pages the prompts already running still need to finish prefilling (and take their first decode round).
        owed = sum(pages.needs(r.lane, r.fill + 1) for r in self.running if r.prefilling) if pages is not None else 0
        while self.waiting and None in self.lanes:
            r = self.waiting[0]
            fill = r.tokens[: r.fill]
            slot = kept.match(fill) if kept is not None else None
            lane = slot.lane if slot is not None and slot.lane >= 0 else self._free_lane()
            if pages is not None:
                need = pages.covering(len(fill) + 1) - (pages.held(lane) if slot is not None and slot.lane >= 0 else 0)
                if owed + need > self._spare(slot):
                    break  # it waits for pages, first in line
                owed += need
            self.waiting.popleft()
            if kept is not None:
                if slot is not None:
                    r.computed = r.resumed = kept.claim(slot, plan.moves, lane)
                else:
                    kept.counts.misses += 1
                if kept.vacate(lane, plan.moves) and pages is not None:
                    pages.release(lane)
            if pages is not None and r.resumed and not self._grow(lane, r.resumed, plan.moves):
                raise AssertionError("admitted a request the pool cannot hold")  # admission counted these pages
            r.lane, r.t_admit = lane, time.perf_counter()
            r.stats.prompt_tokens_resumed = r.resumed
            self.lanes[lane] = r
            plan.admitted.append(r)

    def _spare(self, resuming: Slot | None) -> int:
        """Pages free or held by retained slots on lanes (but the one `resuming` takes over)."""
        assert self.pages is not None
        return len(self.pages.free) + self.retained_pages(but=resuming)

    def retained_pages(self, but: Slot | None = None) -> int:
        """K/V pages held by retained slots on their lanes (but `but`'s)."""
        if self.pages is None or self.retained is None:
            return 0
        return sum(self.pages.held(s.lane) for s in self.retained.on_lanes() if s is not but)

    def _free_lane(self) -> int:
        """A free lane: one with no retained state first, else the one whose retained state was kept longest ago."""
        free = [lane for lane, held in enumerate(self.lanes) if held is None]
        if self.retained is None:
            return free[0]
        slots = {lane: self.retained.on_lane(lane) for lane in free}
        empty = [lane for lane in free if slots[lane] is None]
        if empty:
            return empty[0]
        return min(free, key=lambda lane: slots[lane].used)  # type: ignore[union-attr]


@dataclass
class _Plan:
    """A plan as it is made."""

    moves: Moves
    admitted: list[Request] = field(default_factory=list)
    decode: list[Decode] = field(default_factory=list)
    prefill: list[Prefill] = field(default_factory=list)
