"""Acceptance as a user sees it: tokens a round, per-position acceptance and the loop rate of free-running decoding.

Owns: `Tally` (what a set of requests committed, round by round), `measure` (decode prompts through an engine and
tally them) and `loops` (does an output end in a repeating cycle). Does not own: building engines or choosing prompts
(tools/acceptance.py, ignis.train.evaluate), or the round's counters (ignis.engine.core).

Tokens a round leave out the prefill's first token: the engine does not count the prefill as a round, so a request
that emitted n tokens in r rounds committed (n - 1) / r a round. That is what a user waits for after the first token
(what DFlash and vLLM call acceptance length, the bonus counted), and it stays honest where a stop token or
max_tokens cut a round's commit short, which 1 + accepted / rounds would not.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ignis.engine.core import Engine
from ignis.ipc.messages import EngineRequest, RequestStats
from ignis.params import SamplingParams

LOOP_WINDOW = 64


def loops(tokens: list[int], window: int = LOOP_WINDOW) -> bool:
    """True when the last `window` tokens repeat a shorter period: tail[i] == tail[i + p] for every i, for some
    p <= window // 2 (the cycle shows at least twice in full). An output shorter than the window never loops."""
    if len(tokens) < window:
        return False
    tail = tokens[-window:]
    return any(all(tail[i] == tail[i + p] for i in range(window - p)) for p in range(1, window // 2 + 1))


@dataclass
class Tally:
    backend: str
    k: int
    suite: str
    prompts: int = 0
    tokens: int = 0  # emitted, the prefill's first token included
    rounds: int = 0  # rounds after the first token
    drafted: int = 0
    accepted: int = 0
    looping: int = 0  # outputs that end in a cycle (`loops`)
    position_drafted: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, s: RequestStats, output: list[int]) -> None:
        self.prompts += 1
        self.tokens += len(output)
        self.rounds += s.rounds
        self.drafted += s.drafted
        self.accepted += s.accepted
        self.looping += loops(output)
        for mine, theirs in ((self.position_drafted, s.position_drafted), (self.position_accepted, s.position_accepted)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v

    @property
    def tokens_per_round(self) -> float:
        """Tokens committed a round after each request's first token."""
        return (self.tokens - self.prompts) / self.rounds if self.rounds else 0.0

    @property
    def loop_rate(self) -> float:
        return self.looping / self.prompts if self.prompts else 0.0

    def per_position(self) -> list[float]:
        """Accepted at draft position i / rounds that drafted position i."""
        accepted = self.position_accepted + [0] * (len(self.position_drafted) - len(self.position_accepted))
        return [a / d if d else 0.0 for a, d in zip(accepted, self.position_drafted)]

    def as_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend, "k": self.k, "suite": self.suite, "prompts": self.prompts, "tokens": self.tokens,
            "rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
            "tokens_per_round": round(self.tokens_per_round, 4), "loop_rate": round(self.loop_rate, 4),
            "per_position": [round(x, 4) for x in self.per_position()], "seconds": round(self.seconds, 2),
        }


def measure(engine: Engine, prompts: list[list[int]], params: SamplingParams, suite: str) -> tuple[Tally, list[list[int]]]:
    """Decode every prompt free-running (stopping at the model's end-of-sequence tokens); returns the tally and each
    prompt's output, in prompt order."""
    tally = Tally(engine.backend.name, engine.backend.draft_tokens, suite)
    stop = list(engine.info.eos_token_ids)
    t0 = time.perf_counter()
    requests = [EngineRequest(id=str(i), prompt_token_ids=ids, params=params, stop_token_ids=stop)
                for i, ids in enumerate(prompts)]
    outputs = run_all(engine, requests)
    tally.seconds = time.perf_counter() - t0
    for i in range(len(prompts)):
        tokens, stats = outputs[str(i)]
        tally.add(stats, tokens)
    return tally, [outputs[str(i)][0] for i in range(len(prompts))]


def run_all(engine: Engine, requests: list[EngineRequest]) -> dict[str, tuple[list[int], RequestStats]]:
    """Run every request to its end, with no more in the engine at once than its lanes plus half its waiting room
    (so any number fits under engine.max_waiting); each request's emitted tokens and final stats by id."""
    window = engine.info.lanes + max(1, engine.config.engine.max_waiting // 2)
    waiting = list(reversed(requests))
    tokens: dict[str, list[int]] = {}
    done: dict[str, tuple[list[int], RequestStats]] = {}
    in_flight = 0
    while len(done) < len(requests):
        while waiting and in_flight < window:
            engine.add(waiting.pop())
            in_flight += 1
        for d in engine.step():
            tokens.setdefault(d.id, []).extend(d.token_ids)
            if d.finished:
                done[d.id] = (tokens.pop(d.id), d.stats if d.stats is not None else RequestStats())
                in_flight -= 1
    return done


def drain(engine: Engine, n: int) -> dict[str, tuple[list[int], RequestStats]]:
    """Step until `n` requests finish; each request's emitted tokens and final stats by id."""
    tokens: dict[str, list[int]] = {}
    done: dict[str, tuple[list[int], RequestStats]] = {}
    while len(done) < n:
        for d in engine.step():
            tokens.setdefault(d.id, []).extend(d.token_ids)
            if d.finished:
                done[d.id] = (tokens[d.id], d.stats if d.stats is not None else RequestStats())
    return done
