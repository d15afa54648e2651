"""Decode speed of the engine per speculation backend, as ratios taken in one run on one device.

For each backend (name[:draft_tokens]) the engine decodes the same held-out prompts (`--requests`, default 24)
greedily, at one lane and at several lanes at once; the tool reports decode tokens per second (tokens after each
request's first; aggregate over the run, and over each request's own decode time), tokens per round, and the speed-up
over `off` measured in the same run, and the share of the engine's steps the host spent waiting for the device (a
run that hardly waits is bound by the host). The first backend warms up the device and is run again at the end, so
the spread between its two runs shows the noise. A backend may carry config overrides after commas (`KEY=VALUE`), so
variants of one backend compare in one run.

    python -m tools.bench_engine --profile h200 --backend off --backend mtp:1 --backend mtp:3 --backend dflash2:7
    python -m tools.bench_engine --profile h200 --backend dflash2:7 --backend dflash2:7,engine.rounds_per_sync=2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ignis.artifact import BUILTIN
from ignis.config import load_config, parse_overrides
from ignis.engine.core import Engine
from ignis.ipc.messages import EngineRequest
from ignis.params import SamplingParams
from tools.acceptance import load_prompts
from ignis.tokenizer import Tokenizer


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Waits:
    """Seconds the host spent waiting for the device inside the engine's steps: the runner's syncs (synchronous rounds
    and prefills) and the device round's waits for a queued round (engine.async_scheduling). What is left of a step
    is the host's own work; a run whose steps hardly wait is bound by the host, not the device."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def timed(self, fn: Callable[..., None]) -> Callable[..., None]:
        def wrapper(*args: Any) -> None:
            t0 = time.perf_counter()
            fn(*args)
            self.seconds += time.perf_counter() - t0

        return wrapper

    @contextmanager
    def on(self, engine: Engine) -> Iterator[Waits]:
        import ignis.engine.round as rounds

        dr = engine.runner.device_round
        kept = rounds.synchronize
        own = vars(dr).get("wait") if dr is not None else None  # a wrapper set on the instance before, if any
        rounds.synchronize = self.timed(kept)  # type: ignore[assignment]
        if dr is not None:
            dr.wait = self.timed(dr.wait)  # type: ignore[method-assign]
        try:
            yield self
        finally:
            rounds.synchronize = kept
            if dr is not None:
                if own is None:
                    del dr.wait
                else:
                    dr.wait = own  # type: ignore[method-assign]


def decode(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """Greedy decode of every prompt, as many at once as the engine has lanes (the rest queue). tok_s: tokens after
    each request's first over the time from the first request's first token to the last request's end (aggregate);
    tok_s_request: the same sums over each request's own time from its first token to its end (one lane's speed);
    wait_share: the share of the steps' time the host spent waiting for the device (`Waits`)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add(EngineRequest(id=f"b{i}", prompt_token_ids=ids, params=params))
    first: dict[str, float] = {}
    tokens = rounds = accepted = 0
    own = stepping = 0.0
    done = 0
    with Waits().on(engine) as waits:
        while done < len(prompts):
            t0 = time.perf_counter()
            deltas = engine.step()
            now = time.perf_counter()
            stepping += now - t0
            for d in deltas:
                if d.id not in first:
                    first[d.id] = now
                    tokens += len(d.token_ids) - 1
                else:
                    tokens += len(d.token_ids)
                if d.finished:
                    done += 1
                    rounds += d.stats.rounds
                    accepted += d.stats.accepted
                    own += now - first[d.id]
    _sync()
    seconds = time.perf_counter() - min(first.values())
    return {"tokens": tokens, "requests": len(prompts), "seconds": seconds, "tok_s": tokens / seconds,
            "tok_s_request": tokens / own if own else 0.0,
            "tokens_per_round": 1 + accepted / rounds if rounds else 1.0,
            "wait_share": waits.seconds / stepping if stepping else 0.0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench_engine")
    ap.add_argument("--model", default=str(BUILTIN))
    ap.add_argument("--profile", default=None)
    ap.add_argument("--backend", action="append", default=None,
                    help="name[:draft_tokens][,KEY=VALUE...]: a backend, with config overrides for this variant")
    ap.add_argument("--prompts", default=None)
    ap.add_argument("--lanes", type=int, action="append", default=None, help="lane counts to measure (default 1, 8)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--requests", type=int, default=24, help="held-out prompts decoded at each lane count (at least "
                                                             "the lane count)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    model = Path(args.model)
    tok = Tokenizer.from_dir(model)
    backends = args.backend or ["off"]
    lane_counts = args.lanes or [1, 8]
    results = []
    for lanes in lane_counts:
        prompts = load_prompts(Path(args.prompts) if args.prompts else model / "heldout_prompts.jsonl", tok,
                               max(lanes, args.requests))
        for spec in backends + [backends[0]]:
            backend, *sets = spec.split(",")
            name, _, k = backend.partition(":")
            overrides = {"model.path": str(model), "spec.backend": name, "engine.lanes": lanes, "log.level": "warning",
                         "engine.max_rows": max(512, lanes * 8)}
            if k:
                overrides["spec.draft_tokens"] = int(k)
            overrides.update(parse_overrides(sets))
            engine = Engine(load_config(profile=args.profile, overrides=overrides))
            decode(engine, prompts[:1], 8)  # warm-up: allocations, kernel compilation
            r = decode(engine, prompts, args.max_tokens)
            r.update({"backend": spec, "lanes": lanes})
            results.append(r)
            del engine
            print(f"lanes={lanes} {spec:10s} {r['tok_s']:9.1f} tok/s aggregate, {r['tok_s_request']:9.1f} a request  "
                  f"tokens/round={r['tokens_per_round']:.2f} ({r['requests']} requests), the host waiting for the "
                  f"device {100 * r['wait_share']:.0f}% of its steps", flush=True)
        base = [r for r in results if r["lanes"] == lanes and r["backend"] == backends[0]]
        for r in results:
            if r["lanes"] == lanes:
                r["speedup_vs_first"] = r["tok_s"] / base[0]["tok_s"]
        print(f"lanes={lanes} noise: {backends[0]} ran at {base[0]['tok_s']:.1f} and {base[-1]['tok_s']:.1f} tok/s")
    print(json.dumps({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                      "results": results}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
