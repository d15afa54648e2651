"""An engine in the caller's own process: `get_deltas` runs rounds. For tests, tools and single-process embedding."""

from __future__ import annotations

from collections.abc import Sequence

from ignis.config import IgnisConfig
from ignis.engine.core import Engine
from ignis.ipc.messages import EngineRequest, EngineStats, RequestDelta


class InprocClient:
    def __init__(self, config: IgnisConfig) -> None:
        self.engine = Engine(config)
        self.info = self.engine.info
        self._pending: list[RequestDelta] = []

    def add(self, req: EngineRequest) -> None:
        self.engine.add(req)

    def abort(self, ids: Sequence[str]) -> None:
        self._pending.extend(self.engine.abort(ids))

    def get_deltas(self, timeout: float | None = None) -> list[RequestDelta]:
        out, self._pending = self._pending, []
        if not out and self.engine.has_work():
            out = self.engine.step()
        return out

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def close(self) -> None:
        pass
