"""The interface every client talks to an engine through, in-process or across a socket."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ignis.ipc.messages import EngineInfo, EngineRequest, EngineStats, RequestDelta


class EngineClient(Protocol):
    info: EngineInfo

    def add(self, req: EngineRequest) -> None:
        """Queue a request. Raises InputError / QueueFullError / EngineDeadError before anything is queued."""
        ...

    def abort(self, ids: Sequence[str]) -> None: ...

    def get_deltas(self, timeout: float | None = None) -> list[RequestDelta]:
        """Deltas since the last call; waits up to `timeout` seconds for at least one (None: until one comes)."""
        ...

    def stats(self) -> EngineStats: ...

    def close(self) -> None: ...
