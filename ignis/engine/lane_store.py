"""Host copies of retained lane states: the tensor side of ignis.engine.retain's decisions.

Owns: copying a lane's state (the target's K/V of the covered positions, read from and written to the lane's pages
through its block-table row, the recurrent state at their end, and the backend's per-lane state) to host memory and
back, and the host bytes in use. Pinned memory on a GPU, so the copies are asynchronous on the current stream: a copy
out is ordered before any later kernel that overwrites the lane, and a copy in before any kernel that reads it, with no
host wait. Does not own: which state to move, when, or the bound (ignis.engine.retain).
"""

from __future__ import annotations

import torch

from ignis.backends.base import SpecBackend
from ignis.engine.retain import Moves
from ignis.model.cache import LaneCache


class LaneStore:
    def __init__(self, cache: LaneCache, backend: SpecBackend, device: torch.device) -> None:
        self.cache = cache
        self.backend = backend
        self.pinned = device.type == "cuda"
        self.host: dict[int, dict[str, torch.Tensor]] = {}  # slot key -> name -> host copy
        views = getattr(backend, "lane_views", None)  # a third-party backend may predate the method
        self.retains = views is not None and views(cache.scratch, 1) is not None

    def read(self, lane: int, length: int) -> dict[str, torch.Tensor]:
        """Every tensor of a lane's state for positions 0..length-1, by name: the target's K/V read from the lane's
        pages (copies), its recurrent state and the backend's per-lane state (views)."""
        out = {f"target.{k}": t for k, t in self.cache.lane_read(lane, length).items()}
        return out | {f"backend.{k}": t for k, t in self._backend(lane, length).items()}

    def state_bytes(self, length: int) -> int:
        """Host bytes one retained state covering `length` positions takes (the same for every lane)."""
        own = sum(t.nbytes for t in self._backend(self.cache.scratch, length).values())
        return self.cache.state_bytes(length) + own

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for saved in self.host.values() for t in saved.values())

    def save(self, moves: Moves) -> None:
        """The plan's saves and drops: before the round frees or maps any page, since a save reads the slot's K/V
        through its lane's table row as it stands."""
        for s in moves.saves:
            self.host[s.key] = {name: self._copy_out(t) for name, t in self.read(s.lane, s.length).items()}
        for key in moves.drops:
            del self.host[key]

    def restore(self, moves: Moves) -> None:
        """The plan's restores: after the pages the restoring lanes were given are in the table."""
        for r in moves.restores:
            saved = self.host.pop(r.key)
            self.cache.lane_write(r.lane, r.length, {k.removeprefix("target."): t for k, t in saved.items()
                                                     if k.startswith("target.")})
            for name, t in self._backend(r.lane, r.length).items():
                t.copy_(saved[f"backend.{name}"], non_blocking=self.pinned)

    def _backend(self, lane: int, length: int) -> dict[str, torch.Tensor]:
        views = self.backend.lane_views(lane, length)
        assert views is not None, "a backend that cannot retain gets no retained slots"
        return views

    def _copy_out(self, t: torch.Tensor) -> torch.Tensor:
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pinned)
        return host.copy_(t, non_blocking=self.pinned)
