"""Which requests hold lanes, and how many rows each gets this round. The scheduler never touches tensors.

Owns: the waiting queue, lane assignment (first come, first served; a request that extends a retained slot resumes
from it, see ignis.engine.retain) and the row budget. Does not own: what the rows contain (ignis.engine.round) or the
tensors a retained slot moves (ignis.engine.lane_store).

Prefill is split only at multiples of `prefill_chunk` counted from position 0, so where a prompt is cut never depends
on its neighbours: with exact arithmetic, a request's output is the same alone or beside others. A request resumed
at a position inside a chunk first prefills up to the next multiple, alone in its segment. Decoding lanes always get
their anchor plus drafts; prefill takes whole chunks from what is left of `max_rows`, and the first prefilling lane
always gets at least one chunk so that prompts cannot starve: a long prompt is prefilled a few chunks a round while
every other lane keeps decoding in the same rounds.

Lanes: a free lane with no retained state is taken first; then the free lane whose retained state is the least
recently kept (that state moves to the host or is dropped, per ignis.engine.retain).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from ignis.engine.request import Request
from ignis.engine.retain import Moves, Retained


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

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill and not self.moves


class Scheduler:
    def __init__(
        self, *, lanes: int, max_rows: int, prefill_chunk: int, max_waiting: int, draft_tokens: int, context: int,
        retained: Retained | None = None,
    ) -> None:
        """retained: where finished requests' states are kept (None: never kept, every prompt is prefilled whole)."""
        self.retained = retained
        self.draft_tokens = draft_tokens
        self.context = context
        self.lanes: list[Request | None] = [None] * lanes
        self.waiting: deque[Request] = deque()
        self.max_rows = max_rows
        self.prefill_chunk = prefill_chunk
        self.max_waiting = max_waiting

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
        """The request leaves its lane (finished or aborted, between rounds); its state is retained when it can be."""
        if 0 <= request.lane < len(self.lanes) and self.lanes[request.lane] is request:
            self.lanes[request.lane] = None
            ids = request.state_ids()
            if self.retained is not None and ids is not None:
                self.retained.keep(request.lane, ids)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.lane = -1

    def plan(self) -> RoundPlan:
        moves = Moves()
        admitted = self._admit(moves)
        decode = [Decode(r, r.drafts_allowed(self.draft_tokens, self.context)) for r in self.running if not r.prefilling]
        budget = self.max_rows - sum(1 + d.drafts for d in decode)
        prefill: list[Prefill] = []
        for r in sorted((r for r in self.running if r.prefilling), key=lambda r: r.t_admit):
            chunks = max(budget // self.prefill_chunk, 0 if prefill else 1)
            if chunks == 0:
                break
            pc, start = self.prefill_chunk, r.computed
            end = (start // pc + (chunks if start % pc == 0 else 1)) * pc  # a multiple of prefill_chunk
            length = min(len(r.prompt), end) - start
            prefill.append(Prefill(r, length))
            budget -= length
        return RoundPlan(admitted, decode, prefill, moves)

    def _admit(self, moves: Moves) -> list[Request]:
        admitted = []
        kept = self.retained
        if kept is not None:
            kept.settle()  # the last plan's restores have run
        while self.waiting and None in self.lanes:
            r = self.waiting.popleft()
            slot = kept.match(r.prompt) if kept is not None else None
            lane = slot.lane if slot is not None and slot.lane >= 0 else self._free_lane()
            if kept is not None:
                if slot is not None:
                    r.computed = r.resumed = kept.claim(slot, moves, lane)
                else:
                    kept.counts.misses += 1
                kept.vacate(lane, moves)
            r.lane, r.t_admit = lane, time.perf_counter()
            r.stats.prompt_tokens_resumed = r.resumed
            self.lanes[lane] = r
            admitted.append(r)
        return admitted

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
