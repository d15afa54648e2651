"""Which requests hold lanes, and how many rows each gets this round. The scheduler never touches tensors.

Owns: the waiting queue, lane assignment (first come, first served) and the row budget. Does not own: what the rows
contain (ignis.engine.round).

Prefill is split only at multiples of `prefill_chunk` counted from position 0, so where a prompt is cut never depends
on its neighbours: with exact arithmetic, a request's output is the same alone or beside others. Decoding lanes
always get their anchor plus drafts; prefill takes whole chunks from what is left of `max_rows`, and the first
prefilling lane always gets at least one chunk so that prompts cannot starve.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from ignis.engine.request import Request


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
    admitted: list[Request]  # took a lane this round (their lane state must be reset)
    decode: list[Decode]
    prefill: list[Prefill]

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    def __init__(
        self, *, lanes: int, max_rows: int, prefill_chunk: int, max_waiting: int, draft_tokens: int, context: int
    ) -> None:
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
        if 0 <= request.lane < len(self.lanes) and self.lanes[request.lane] is request:
            self.lanes[request.lane] = None
        elif request in self.waiting:
            self.waiting.remove(request)
        request.lane = -1

    def plan(self) -> RoundPlan:
        admitted = self._admit()
        decode = [Decode(r, r.drafts_allowed(self.draft_tokens, self.context)) for r in self.running if not r.prefilling]
        budget = self.max_rows - sum(1 + d.drafts for d in decode)
        prefill: list[Prefill] = []
        for r in sorted((r for r in self.running if r.prefilling), key=lambda r: r.t_admit):
            remaining = len(r.prompt) - r.computed
            chunks = max(budget // self.prefill_chunk, 0 if prefill else 1)
            if chunks == 0:
                break
            length = min(remaining, chunks * self.prefill_chunk)
            prefill.append(Prefill(r, length))
            budget -= length
        return RoundPlan(admitted, decode, prefill)

    def _admit(self) -> list[Request]:
        admitted = []
        for lane, held in enumerate(self.lanes):
            if held is None and self.waiting:
                r = self.waiting.popleft()
                r.lane, r.t_admit = lane, time.perf_counter()
                self.lanes[lane] = r
                admitted.append(r)
        return admitted
