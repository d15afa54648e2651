"""Long prompts in the engine, as ratios taken in one run: prefill speed and decode rounds at long contexts against
their floor, a second turn's time to first token with a retained slot against a full prefill, and the decode round
time of other lanes while one lane prefills a long prompt.

Model: the built-in one, a checkpoint directory, or `27b`: the Qwen3.5-27B shape (tools.round_work.QWEN35_27B, with
its MTP layer) with seeded random bf16 weights made on the GPU (`model.load_format = "dummy"`: no checkpoint on disk).

Long prompts (`--long N`, repeatable): one lane whose context holds N prompt tokens and `--rounds` decode rounds; the
prompt's time to first token gives prefill tokens/s, then each decode round is timed (median) against its floor: the
weights, the recurrent state and the K/V of N positions over the copy bandwidth measured in the same run
(tools.round_work.floor_bytes).

Turns: a conversation of `--context` tokens (random ids) gets a `--reply`-token answer; its second turn adds `--turn`
tokens. The second turn's time to first token is taken three ways: resumed from the state left on its lane, resumed
from the state copied to the host and back (a filler request took the lane in between), and prefilled whole (the same
length with the first token changed, which no retained slot matches).

Beside a long prefill: `--lanes` - 1 lanes decode; the round time (one engine step) is taken over `--rounds` steps
before a `--beside`-token prompt (default `--context`) arrives and over every step while it is prefilled.

    python -m tools.bench_long --profile h200 --context 32768 --turn 200 --backend off --backend dflash2:7
    python -m tools.bench_long --profile h200 --model 27b --long 131072 --long 262144 --skip turns,beside
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ignis.artifact import BUILTIN
from ignis.config import load_config
from ignis.config.load import parse_overrides
from ignis.engine.core import Engine
from ignis.ipc.messages import EngineRequest
from ignis.model.random import _full_config
from ignis.params import SamplingParams
from tools.round_timing import copy_bandwidth
from tools.round_work import QWEN35_27B, floor_bytes

SECTIONS = ("long", "turns", "beside")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def turn(engine: Engine, rid: str, ids: list[int], max_tokens: int) -> tuple[float, list[int], int]:
    """(time to first token s, tokens, prompt tokens resumed) of one request run to its end alone."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    _sync()
    t0 = time.perf_counter()
    engine.add(EngineRequest(id=rid, prompt_token_ids=ids, params=params))
    first, tokens = 0.0, list[int]()
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
    engine.add(EngineRequest(id="long", prompt_token_ids=[rng.randrange(vocab) for _ in range(args.beside)],
                             params=SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))
    during = []
    while engine.scheduler.find("long") is not None:
        during.append(step_ms())
    assert all(engine.scheduler.find(rid) is not None for rid in decoding), "a decoding lane ended: raise the context"
    engine.abort(decoding)
    return {"decoding_lanes": len(decoding), "beside_tokens": args.beside, "round_ms_before": statistics.median(before),
            "round_ms_during_prefill": statistics.median(during), "prefill_rounds": len(during),
            "during_over_before": statistics.median(during) / statistics.median(before)}


def long_prompt(engine: Engine, rng: random.Random, vocab: int, n: int, rounds: int, bandwidth: float
                ) -> dict[str, Any]:
    """One lane: an n-token prompt's prefill, then `rounds` decode rounds at that context against their floor."""
    params = SamplingParams(max_tokens=rounds * (engine.backend.draft_tokens + 1) + 1, temperature=0.0,
                            ignore_eos=True)
    _sync()
    t0 = time.perf_counter()
    engine.add(EngineRequest(id=f"long{n}", prompt_token_ids=[rng.randrange(vocab) for _ in range(n)], params=params))
    steps = 0
    while not engine.step():
        steps += 1
    _sync()
    ttft = time.perf_counter() - t0
    times, tokens = [], 0
    for _ in range(rounds):
        _sync()
        t1 = time.perf_counter()
        out = engine.step()
        _sync()
        times.append(1e3 * (time.perf_counter() - t1))
        tokens += sum(len(d.token_ids) for d in out)
    engine.abort([f"long{n}"])
    while engine.has_work():  # a round queued for the aborted lane is read (and dropped) before the next prompt
        engine.step()
    cols = engine.backend.draft_tokens + 1
    ms = statistics.median(times[1:] if len(times) > 1 else times)
    floor_ms = 1e3 * floor_bytes(engine.model, 1, cols, position=n) / bandwidth if bandwidth else None
    return {"prompt_tokens": n, "ttft_s": ttft, "prefill_tok_s": n / ttft, "prefill_rounds": steps + 1,
            "decode_round_ms": ms, "decode_floor_ms": floor_ms, "decode_x_floor": ms / floor_ms if floor_ms else None,
            "tokens_per_round": tokens / rounds}


def _model_overrides(model: str, scratch: Path) -> dict[str, Any]:
    if model != "27b":
        return {"model.path": model}
    (scratch / "config.json").write_text(json.dumps(_full_config(QWEN35_27B, mtp=True), indent=1))
    return {"model.path": str(scratch), "model.load_format": "dummy", "model.dtype": "bfloat16"}


def _engine(overrides: dict[str, Any], profile: str | None, **engine: Any) -> tuple[Engine, float]:
    t0 = time.perf_counter()
    e = Engine(load_config(profile=profile, overrides={**overrides, **{f"engine.{k}": v for k, v in engine.items()}}))
    return e, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench_long")
    ap.add_argument("--model", default=str(BUILTIN), help="a checkpoint directory, or 27b (random weights, GPU)")
    ap.add_argument("--profile", default=None)
    ap.add_argument("--backend", action="append", default=None, help="name[:draft_tokens]; repeatable (default off)")
    ap.add_argument("--long", action="append", type=int, default=[], help="a long prompt's tokens; repeatable")
    ap.add_argument("--context", type=int, default=2048, help="tokens of the conversation")
    ap.add_argument("--reply", type=int, default=32, help="tokens of the first turn's answer")
    ap.add_argument("--turn", type=int, default=200, help="tokens the second turn adds")
    ap.add_argument("--beside", type=int, default=0, help="tokens of the prompt prefilled beside decoding lanes "
                    "(default --context)")
    ap.add_argument("--lanes", type=int, default=8, help="lanes for the beside-prefill case (lanes - 1 decode)")
    ap.add_argument("--rounds", type=int, default=20, help="decode rounds timed (before a long prompt arrives, and "
                    "at a long context)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every engine, as `ignis serve --set`")
    ap.add_argument("--skip", default="", help=f"comma list of {', '.join(SECTIONS)}")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.beside = args.beside or args.context
    skip = {s for s in args.skip.split(",") if s}
    if skip - set(SECTIONS):
        ap.error(f"--skip takes {', '.join(SECTIONS)}")
    bandwidth = copy_bandwidth(torch.device("cuda")) if torch.cuda.is_available() else 0.0
    results: list[dict[str, Any]] = []

    def save() -> None:  # after every section, so a run cut short keeps what it measured
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))

    with tempfile.TemporaryDirectory() as scratch:
        model = _model_overrides(args.model, Path(scratch))
        for spec in args.backend or ["off"]:
            name, _, k = spec.partition(":")
            overrides: dict[str, Any] = {**model, "spec.backend": name, "log.level": "warning",
                                         **parse_overrides(args.sets)}
            if k:
                overrides["spec.draft_tokens"] = int(k)
            r: dict[str, Any] = {"backend": spec, "model": args.model, "sets": args.sets, "copy_bandwidth": bandwidth}
            results.append(r)
            rng = random.Random(0)
            if args.long and "long" not in skip:
                most = max(args.long) + 8 * (int(k or 0) + 1) * (args.rounds + 2)
                one, r["startup_s_long"] = _engine(overrides, args.profile, lanes=1, context=most)
                r["long"] = []
                for n in args.long:
                    r["long"].append(long_prompt(one, rng, one.model.config.vocab_size, n, args.rounds, bandwidth))
                    x = r["long"][-1]
                    floor = (f" = {x['decode_x_floor']:.2f}x its floor of {x['decode_floor_ms']:.2f} ms"
                             if x["decode_floor_ms"] else "")
                    print(f"{spec:10s} {n}-token prompt: prefill {x['prefill_tok_s']:8.0f} tok/s ({x['ttft_s']:.1f} s)"
                          f" | decode round {x['decode_round_ms']:.2f} ms{floor}, {x['tokens_per_round']:.2f} tokens "
                          f"a round", flush=True)
                    save()
                del one
            if "turns" not in skip:
                need = args.context + args.reply + args.turn + 64  # the second turn, its first token and slack
                one, r["startup_s"] = _engine(overrides, args.profile, lanes=1, context=-(-need // 64) * 64)
                r.update(turns(one, rng, one.model.config.vocab_size, args))
                del one
                print(f"{spec:10s} second turn of {r['second_turn_tokens']} tokens: TTFT full "
                      f"{r['ttft_full_ms']:8.1f} ms, resumed on its lane {r['ttft_lane_ms']:7.1f} ms "
                      f"({r['full_over_lane']:.1f}x), from the host {r['ttft_host_ms']:7.1f} ms "
                      f"({r['full_over_host']:.1f}x)", flush=True)
                save()
            if "beside" not in skip:
                context = max(args.beside + 64, 8192) if args.model == "27b" else 0
                many, r["startup_s_lanes"] = _engine(overrides, args.profile, lanes=args.lanes,
                                                     **({"context": context} if context else {}))
                r.update(beside_prefill(many, rng, many.model.config.vocab_size, args))
                del many
                print(f"{spec:10s} {r['decoding_lanes']} lanes decoding: round {r['round_ms_before']:.2f} ms, "
                      f"{r['round_ms_during_prefill']:.2f} ms while {args.beside} tokens prefill over "
                      f"{r['prefill_rounds']} rounds ({r['during_over_before']:.2f}x)", flush=True)
                save()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
