"""Long prompts in the engine, as ratios taken in one run: a second turn's time to first token with a retained slot
against a full prefill, and the decode round time of other lanes while one lane prefills a long prompt.

Turns: a conversation of `--context` tokens (random ids) gets a `--reply`-token answer; its second turn adds `--turn`
tokens. The second turn's time to first token is taken three ways: resumed from the state left on its lane, resumed
from the state copied to the host and back (a filler request took the lane in between), and prefilled whole (the same
length with the first token changed, which no retained slot matches).

Beside a long prefill: `--lanes` - 1 lanes decode; the round time (one engine step) is taken over `--rounds` steps
before the long prompt arrives and over every step while it is prefilled.

    python -m tools.bench_long --profile h200 --context 32768 --turn 200 --backend off --backend dflash2:7
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ignis.artifact import BUILTIN
from ignis.config import load_config
from ignis.engine.core import Engine
from ignis.ipc.messages import EngineRequest
from ignis.params import SamplingParams


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def turn(engine: Engine, rid: str, ids: list[int], max_tokens: int) -> tuple[float, list[int], int]:
    """(time to first token s, tokens, prompt tokens resumed) of one request run to its end alone."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    _sync()
    t0 = time.perf_counter()
    engine.add(EngineRequest(id=rid, prompt_token_ids=ids, params=params))
    first, tokens = 0.0, []
    while True:
        for d in engine.step():
            if not tokens:
                _sync()
                first = time.perf_counter() - t0
            tokens += d.token_ids
            if d.finished:
                assert d.stats is not None
                return first, tokens, d.stats.prompt_tokens_resumed


def turns(engine: Engine, rng: random.Random, vocab: int, args: argparse.Namespace) -> dict[str, Any]:
    def ids(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    out: dict[str, Any] = {}
    for how in ("lane", "host"):
        first = ids(args.context)
        _, reply, _ = turn(engine, f"{how}.1", first, args.reply)
        if how == "host":
            turn(engine, "filler", ids(16), 1)  # takes the lane: the conversation's state goes to the host
        second = first + reply + ids(args.turn)
        ttft, _, resumed = turn(engine, f"{how}.2", second, 1)
        assert resumed == len(first) + len(reply) - 1, f"the second turn resumed {resumed} tokens ({how})"
        out[f"ttft_{how}_ms"], out[f"resumed_{how}"] = 1e3 * ttft, resumed
    whole = [(second[0] + 1) % vocab] + second[1:]  # same length, matches no retained slot
    ttft, _, resumed = turn(engine, "whole", whole, 1)
    assert resumed == 0
    out["ttft_full_ms"] = 1e3 * ttft
    out["second_turn_tokens"] = len(second)
    out["full_over_lane"] = out["ttft_full_ms"] / out["ttft_lane_ms"]
    out["full_over_host"] = out["ttft_full_ms"] / out["ttft_host_ms"]
    return out


def beside_prefill(engine: Engine, rng: random.Random, vocab: int, args: argparse.Namespace) -> dict[str, Any]:
    ec = engine.config.engine
    params = SamplingParams(max_tokens=ec.context - 65, temperature=0.0, ignore_eos=True)  # to the end of the context
    decoding = [f"d{i}" for i in range(ec.lanes - 1)]
    for rid in decoding:
        engine.add(EngineRequest(id=rid, prompt_token_ids=[rng.randrange(vocab) for _ in range(64)], params=params))
    while any(r.prefilling for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()

    def step_ms() -> float:
        _sync()
        t0 = time.perf_counter()
        engine.step()
        _sync()
        return 1e3 * (time.perf_counter() - t0)

    before = [step_ms() for _ in range(args.rounds)]
    engine.add(EngineRequest(id="long", prompt_token_ids=[rng.randrange(vocab) for _ in range(args.context)],
                             params=SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))
    during = []
    while engine.scheduler.find("long") is not None:
        during.append(step_ms())
    assert all(engine.scheduler.find(rid) is not None for rid in decoding), "a decoding lane ended: raise the context"
    engine.abort(decoding)
    return {"decoding_lanes": len(decoding), "round_ms_before": statistics.median(before),
            "round_ms_during_prefill": statistics.median(during), "prefill_rounds": len(during),
            "during_over_before": statistics.median(during) / statistics.median(before)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench_long")
    ap.add_argument("--model", default=str(BUILTIN))
    ap.add_argument("--profile", default=None)
    ap.add_argument("--backend", action="append", default=None, help="name[:draft_tokens]; repeatable (default off)")
    ap.add_argument("--context", type=int, default=2048, help="tokens of the conversation / the long prompt")
    ap.add_argument("--reply", type=int, default=32, help="tokens of the first turn's answer")
    ap.add_argument("--turn", type=int, default=200, help="tokens the second turn adds")
    ap.add_argument("--lanes", type=int, default=8, help="lanes for the beside-prefill case (lanes - 1 decode)")
    ap.add_argument("--rounds", type=int, default=20, help="rounds timed before the long prompt arrives")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    results = []
    for spec in args.backend or ["off"]:
        name, _, k = spec.partition(":")
        overrides: dict[str, Any] = {"model.path": args.model, "spec.backend": name, "log.level": "warning"}
        if k:
            overrides["spec.draft_tokens"] = int(k)
        rng = random.Random(0)
        one = Engine(load_config(profile=args.profile, overrides={**overrides, "engine.lanes": 1}))
        r: dict[str, Any] = {"backend": spec, **turns(one, rng, one.model.config.vocab_size, args)}
        del one
        many = Engine(load_config(profile=args.profile, overrides={**overrides, "engine.lanes": args.lanes}))
        r.update(beside_prefill(many, rng, many.model.config.vocab_size, args))
        del many
        results.append(r)
        print(f"{spec:10s} second turn of {r['second_turn_tokens']} tokens: TTFT full {r['ttft_full_ms']:8.1f} ms, "
              f"resumed on its lane {r['ttft_lane_ms']:7.1f} ms ({r['full_over_lane']:.1f}x), from the host "
              f"{r['ttft_host_ms']:7.1f} ms ({r['full_over_host']:.1f}x) | {r['decoding_lanes']} lanes decoding: round "
              f"{r['round_ms_before']:.2f} ms, {r['round_ms_during_prefill']:.2f} ms while {args.context} tokens "
              f"prefill over {r['prefill_rounds']} rounds ({r['during_over_before']:.2f}x)", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
