"""What the engine measures for operators: latency and length histograms, memory in use, errors by kind.

Owns: the histograms' names and bucket bounds, observing a request at its first token, at each round and at its
end, and filling those figures into `EngineStats` as plain data. Does not own: the counters the engine keeps itself
(ignis.engine.core), Prometheus names and help text (ignis.server.metrics), or timing the request outside the engine.

Times are taken in the engine, from when it received the request: a front-end's tokenizing is not in them.
"""

from __future__ import annotations

import bisect

from ignis.engine.request import Request
from ignis.ipc.messages import EngineStats, Histogram

_LATENCY = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
            80.0, 160.0, 640.0, 2560.0]
_PER_TOKEN = [0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
              0.4, 0.5, 0.75, 1.0, 2.5, 5.0]
_REQUEST = [0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
            480.0, 960.0, 1920.0, 7680.0]
_TOKENS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000, 500000,
           1000000]

# name -> upper bounds. The server edge adds the `ignis_` prefix and Prometheus suffixes (ignis.server.metrics).
BOUNDS: dict[str, list[float]] = {
    "time_to_first_token_seconds": _LATENCY,
    "time_per_output_token_seconds": _PER_TOKEN,
    "e2e_request_latency_seconds": _REQUEST,
    "request_queue_time_seconds": _LATENCY,
    "request_prompt_tokens": [float(b) for b in _TOKENS],
    "request_generation_tokens": [float(b) for b in _TOKENS],
    "tokens_per_round": [float(b) for b in range(1, 9)],
}
ERROR_KINDS = ("input", "queue_full", "aborted")  # refused as bad input, refused for a full queue, ended early


class Telemetry:
    def __init__(self, lane_bytes: int, position_bytes: int) -> None:
        """lane_bytes / position_bytes: what one lane's caches take whatever its length, and per position held."""
        self.lane_bytes = lane_bytes
        self.position_bytes = position_bytes
        self.histograms = {name: Histogram(bounds=list(b), counts=[0] * (len(b) + 1)) for name, b in BOUNDS.items()}
        self.errors = dict.fromkeys(ERROR_KINDS, 0)

    def observe(self, name: str, value: float) -> None:
        h = self.histograms[name]
        h.counts[bisect.bisect_left(h.bounds, value)] += 1
        h.total += value

    def first_token(self, r: Request, now: float) -> None:
        self.observe("request_queue_time_seconds", max(r.t_admit - r.t_arrival, 0.0))
        self.observe("time_to_first_token_seconds", now - r.t_arrival)

    def round(self, committed: int) -> None:
        """One lane's decode round committed `committed` tokens (its accepted drafts plus the model's own)."""
        self.observe("tokens_per_round", committed)

    def finished(self, r: Request, now: float) -> None:
        if r.finish_reason == "abort":
            self.errors["aborted"] += 1
            return
        self.observe("e2e_request_latency_seconds", now - r.t_arrival)
        self.observe("request_prompt_tokens", len(r.prompt))
        self.observe("request_generation_tokens", r.generated)
        if r.generated > 1:
            self.observe("time_per_output_token_seconds", (now - r.t_first) / (r.generated - 1))

    def refused(self, kind: str) -> None:
        self.errors[kind] += 1

    def fill(self, stats: EngineStats, running: list[Request], lanes: int, allocated: int) -> None:
        stats.lanes = lanes
        stats.cache_bytes = allocated
        stats.cache_used_bytes = sum(self.lane_bytes + r.computed * self.position_bytes for r in running)
        stats.errors = dict(self.errors)
        stats.histograms = self.histograms
