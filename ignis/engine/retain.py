"""Retained slots: the lane state a finished (or aborted) request leaves behind, kept for a request that extends it.

Owns: which sequences are retained and where (on their lane, or on the host), matching a prompt against them, the
LRU order, and the host-memory bound (`engine.retained_host_memory`). Decisions only, as plain data: moving the
tensors is ignis.engine.lane_store's, and which lane a request takes is the scheduler's (it asks here).

What a retained state covers. A lane whose request has run positions 0..n-1 through the model holds, for those
positions, the attention K/V, the Gated DeltaNet conv window and recurrent state after position n-1, and the
backend's own per-lane state; token n (the anchor, or the next prompt token of an aborted prefill) is known but not
yet run. The recurrent state exists only there, at the retained end: nothing earlier can be recovered from it. And a
backend's state for positions 0..n-1 may depend on token n too (mtp's layer reads the embedding of the token after
each row; a mismatch there would only cost drafts, which verification rejects, but a resumed request should draft as
well as a fresh one). So a slot is the n + 1 token ids `ids` = tokens 0..n, and a prompt resumes from it only when
`ids` is a prefix of the prompt: every position the state covers, plus the token after them, equal. The request then
starts with n positions computed and prefills the rest (at least token n, whose logits give the first output). A
prompt that shares a shorter prefix, diverges inside it, or ends inside it gets a full prefill.

A resumed state holds the same values a full prefill would compute, not the same bits: its generated positions ran
a token at a time (the recurrent form) where a prefill runs chunks, so greedy outputs agree up to a near-tie of the
top two logits, as between any two summation orders.

Where a slot lives. A released lane keeps its state in place and stays reserved while other lanes are free; when a
new request needs that lane, the state is copied to host memory first (if it fits the bound, dropping the least
recently used host slots to make room; a state larger than the whole bound is dropped instead). A host slot is
copied back into whichever lane the request that resumes from it takes.

Pages. A slot on its lane keeps the K/V pages that hold its positions (ignis.engine.pages), and only while they are
not wanted: when the pool runs short, slots on lanes give their pages up before any request is preempted, the least
recently kept first, going to the host (or dropped) exactly as when a request takes their lane. A host slot holds no
pages; resuming from it takes pages for its positions again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Slot:
    key: int  # unique for the life of the engine
    ids: list[int]  # tokens 0..n: the n positions the state covers and the token after them
    lane: int  # the lane holding the state, -1 once on the host
    nbytes: int = 0  # host bytes the state takes (0 while it is on its lane)
    used: int = 0  # LRU clock: when it was retained

    @property
    def length(self) -> int:
        return len(self.ids) - 1  # positions the state covers


@dataclass(frozen=True)
class Save:
    """Copy lane `lane`'s state for positions 0..length-1 to the host, as slot `key`."""

    key: int
    lane: int
    length: int


@dataclass(frozen=True)
class Restore:
    """Copy host slot `key` into lane `lane`, then free the host copy."""

    key: int
    lane: int
    length: int


@dataclass
class Moves:
    """The state copies a round makes before it runs, in this order: saves, drops, restores."""

    saves: list[Save] = field(default_factory=list)
    drops: list[int] = field(default_factory=list)  # host slots to free
    restores: list[Restore] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.saves or self.drops or self.restores)


@dataclass
class Counts:
    hits: int = 0  # requests that resumed from a retained slot
    misses: int = 0  # requests admitted with no slot to resume from
    resumed_tokens: int = 0  # prompt tokens those hits did not prefill


class Retained:
    def __init__(self, host_bytes: int, state_bytes: Callable[[int], int]) -> None:
        """host_bytes: the bound on host copies; state_bytes(n): the bytes of one lane's state covering n positions."""
        self.host_bytes = host_bytes
        self.state_bytes = state_bytes
        self.slots: dict[int, Slot] = {}  # by key, which is also the order they were kept (least recent first)
        self._lanes: dict[int, Slot] = {}  # lane -> the slot on it (at most one a lane): no scan of every slot
        self._on_host = 0  # bytes of the host slots in `slots`
        self.counts = Counts()
        self._next = 0
        self._clock = 0
        self._pending: list[Slot] = []  # host slots claimed this plan: still counted until their restore ran

    @property
    def host_used(self) -> int:
        return self._on_host + sum(s.nbytes for s in self._pending)

    def on_lane(self, lane: int) -> Slot | None:
        return self._lanes.get(lane)

    def on_lanes(self) -> list[Slot]:
        """The slots on lanes (not on the host)."""
        return list(self._lanes.values())

    def keep(self, lane: int, ids: list[int]) -> bool:
        """A request released `lane`, whose state covers ids[:-1] with ids[-1] the token after them; False when it
        is not kept (nothing covered)."""
        if len(ids) < 2:
            return False
        self._next += 1
        self._clock += 1
        self.slots[self._next] = self._lanes[lane] = Slot(key=self._next, ids=ids, lane=lane, used=self._clock)
        return True

    def match(self, prompt: list[int]) -> Slot | None:
        """The slot covering the longest prefix of `prompt` whose ids all equal the prompt's, or None."""
        best: Slot | None = None
        for s in self.slots.values():
            n = len(s.ids)
            if n > len(prompt) or (best is not None and n <= len(best.ids)):
                continue
            if s.ids[-1] == prompt[n - 1] and s.ids[0] == prompt[0] and s.ids == prompt[:n]:
                best = s
        return best

    def claim(self, slot: Slot, moves: Moves, lane: int) -> int:
        """A request takes `slot`'s state into `lane` (its own lane, or any free lane for a host slot); returns
        the positions it covers. A host copy stays counted against the bound until `settle`."""
        del self.slots[slot.key]
        if slot.lane >= 0:
            del self._lanes[slot.lane]
        self._on_host -= slot.nbytes  # 0 for a slot on its lane
        self.counts.hits += 1
        self.counts.resumed_tokens += slot.length
        if slot.lane < 0:
            moves.restores.append(Restore(slot.key, lane, slot.length))
            self._pending.append(slot)
        return slot.length

    def vacate(self, lane: int, moves: Moves) -> bool:
        """A request takes `lane` without resuming from its slot, or its pages are wanted: the slot goes to the host,
        or is dropped. False when no slot was on the lane."""
        slot = self._lanes.pop(lane, None)
        if slot is None:
            return False
        nbytes = self.state_bytes(slot.length)
        if nbytes + sum(s.nbytes for s in self._pending) > self.host_bytes:  # no room even with every host slot gone
            del self.slots[slot.key]
            return True
        victims: list[Slot] = []
        used = self.host_used
        for s in self.slots.values():  # least recently kept first, stopping as soon as the state fits
            if used + nbytes <= self.host_bytes:
                break
            if s.lane < 0:
                victims.append(s)
                used -= s.nbytes
        for victim in victims:
            del self.slots[victim.key]
            moves.drops.append(victim.key)
            self._on_host -= victim.nbytes
        moves.saves.append(Save(slot.key, lane, slot.length))
        slot.lane, slot.nbytes = -1, nbytes
        self._on_host += nbytes
        return True

    def settle(self) -> None:
        """The plan's restores are done: their host copies no longer count."""
        self._pending.clear()
