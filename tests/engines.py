"""Helpers for engine tests: an engine over a tiny checkpoint, running token-id requests to completion, and random
churn of requests (`Churn`)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ignis.config import load_config
from ignis.engine.core import Engine
from ignis.engine.request import Request
from ignis.engine.sampling import make_generator
from ignis.ipc.messages import EngineRequest, RequestDelta
from ignis.params import SamplingParams


def make_engine(
    ckpt: Path, backend: str = "off", draft_tokens: int = 0, *, profile: str = "cpu",
    model: dict[str, Any] | None = None, spec: dict[str, Any] | None = None, **engine: Any,
) -> Engine:
    """An engine over `ckpt`; `model`, `spec` and `engine` override keys of those config sections."""
    overrides: dict[str, Any] = {"model.path": str(ckpt), "spec.backend": backend, "log.level": "warning"}
    if draft_tokens:
        overrides["spec.draft_tokens"] = draft_tokens
    overrides.update({f"model.{k}": v for k, v in (model or {}).items()})
    overrides.update({f"spec.{k}": v for k, v in (spec or {}).items()})
    overrides.update({f"engine.{k}": v for k, v in engine.items()})
    return Engine(load_config(profile=profile, overrides=overrides))


def run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams) -> dict[str, RequestDelta]:
    """Add every prompt (ids "0", "1", ...), step until all finish; returns each id's tokens in a final delta."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    for i, (ids, p) in enumerate(zip(prompts, plist)):
        engine.add(EngineRequest(id=str(i), prompt_token_ids=ids, params=p))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    final: dict[str, RequestDelta] = {}
    while len(final) < len(prompts):
        for d in engine.step():
            tokens[d.id].extend(d.token_ids)
            if d.finished:
                final[d.id] = RequestDelta(id=d.id, token_ids=tokens[d.id], finished=True,
                                           finish_reason=d.finish_reason, stats=d.stats)
    return final


def until_finished(engine: Engine, request: EngineRequest) -> list[int]:
    """Add one request and step until it finishes: its tokens."""
    engine.add(request)
    tokens: list[int] = []
    while True:
        deltas = engine.step()
        tokens += [t for d in deltas for t in d.token_ids]
        if any(d.finished for d in deltas):
            return tokens


def decoding(rid: str, tokens: int, max_tokens: int, **params: Any) -> Request:
    """A request of `tokens` prompt tokens and one generated, its prompt in its lane's caches: what a scheduler plans
    a decode for."""
    r = Request(id=rid, prompt=[1] * tokens, params=SamplingParams(max_tokens=max_tokens, **params),
                stop_ids=frozenset(), generator=make_generator(0))
    r.tokens.append(2)
    r.computed = tokens
    return r


def prompts(n: int, vocab: int, seed: int = 0, lo: int = 3, hi: int = 90) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


@dataclass
class Churn:
    """Requests arriving, aborted and finishing at random on one engine, as a server sees them, and what each gave.

    `sequences` holds every ended request's prompt and output, in the order they ended: what follow-ups extend."""

    engine: Engine
    rng: random.Random
    prompts: dict[str, list[int]] = field(default_factory=dict)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    finished: dict[str, str | None] = field(default_factory=dict)
    preempted: set[str] = field(default_factory=set)
    live: set[str] = field(default_factory=set)
    sequences: list[list[int]] = field(default_factory=list)

    def run(self, total: int, prompt: Callable[[], list[int]], max_tokens: int, abort: float,
            check: Callable[[], None]) -> None:
        """`total` greedy requests: each round one arrives with probability 1/2 (its prompt from `prompt`, at most
        max_tokens - 1 tokens), a live one is aborted with probability `abort`, the engine steps and `check` runs."""
        e, rng, n = self.engine, self.rng, 0
        while n < total or self.live:
            if n < total and rng.random() < 0.5:
                rid, ids = f"r{n}", prompt()
                e.add(EngineRequest(id=rid, prompt_token_ids=ids,
                                    params=SamplingParams(max_tokens=rng.randrange(1, max_tokens), temperature=0.0,
                                                          ignore_eos=True)))
                self.prompts[rid], self.outputs[rid] = ids, []
                self.live.add(rid)
                n += 1
            if self.live and rng.random() < abort:
                rid = rng.choice(sorted(self.live))
                for d in e.abort([rid]):
                    self.finished[d.id] = d.finish_reason
                self._ended(rid)
            for d in e.step():
                self.outputs[d.id] += d.token_ids
                if d.finished:
                    self.finished[d.id] = d.finish_reason
                    self._ended(d.id)
                    assert d.stats is not None
                    if d.stats.preemptions:
                        self.preempted.add(d.id)
            check()

    def _ended(self, rid: str) -> None:
        self.live.discard(rid)
        self.sequences.append(self.prompts[rid] + self.outputs[rid])
