"""The `/metrics` edge: engine counters (plain EngineStats from the GPU process) as Prometheus text.

Owns: metric names and the exposition. Every value comes from the engine's own stats, fetched per scrape, so any
front-end answers the same. The speculative families (names fixed by the design) appear only once the engine has
run a speculative request. Does not own: counting (the engine) or fetching (ignis.client.async_client).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ignis.ipc.messages import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _Snapshot(Collector):
    def __init__(self, stats: EngineStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        yield GaugeMetricFamily("ignis_requests_running", "Requests holding a lane.", value=s.running)
        yield GaugeMetricFamily("ignis_requests_waiting", "Requests queued for a lane.", value=s.waiting)
        yield CounterMetricFamily("ignis_requests", "Requests accepted by the engine.", value=s.requests_total)
        yield CounterMetricFamily("ignis_prompt_tokens", "Prompt tokens accepted.", value=s.prompt_tokens_total)
        yield CounterMetricFamily("ignis_generation_tokens", "Tokens generated.", value=s.generation_tokens_total)
        if s.speculative_requests <= 0:
            return
        yield CounterMetricFamily("ignis_speculative_rounds", "Verify rounds of speculative requests.", value=s.rounds)
        yield CounterMetricFamily("ignis_speculative_drafted_tokens", "Draft tokens proposed.", value=s.drafted)
        yield CounterMetricFamily(
            "ignis_speculative_accepted_tokens", "Draft tokens the model accepted; accepted/rounds is tokens per round.",
            value=s.accepted,
        )
        for name, values, what in (
            ("ignis_speculative_position_drafted", s.position_drafted, "Drafts proposed at each position."),
            ("ignis_speculative_position_accepted", s.position_accepted, "Drafts accepted at each position."),
        ):
            family = CounterMetricFamily(name, what, labels=["position"])
            for position, v in enumerate(values):
                family.add_metric([str(position)], v)
            yield family


def exposition(stats: EngineStats) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(stats))
    return generate_latest(registry)
