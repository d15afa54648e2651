"""Whether a request ever pays for a first use: start-up, the first request after ready, and new prompt lengths.

For each backend: the engine's start-up time (load, warm-up, graph capture), the first request's time to first token
and decode speed right after the engine is ready, the same request again (steady), then `--new` requests one after
another, each with a prompt length not seen before: each one's decode tok/s over the steady figure and over the same
prompt run again right after it (same acceptance, shapes no longer new: the cost of a first use alone).

    python -m tools.bench_stalls --profile h200 --backend off --backend mtp:3 --backend dflash2:7
"""

from __future__ import annotations

import argparse
import json
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
from ignis.tokenizer import Tokenizer


def one(engine: Engine, rid: str, ids: list[int], max_tokens: int) -> tuple[float, float, float]:
    """(time to first token s, decode tok/s after it, ms a round) of one request alone."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    engine.add(EngineRequest(id=rid, prompt_token_ids=ids, params=params))
    first = None
    n = 0
    while True:
        for d in engine.step():
            if first is None:
                first = time.perf_counter()
                n = len(d.token_ids) - 1
            else:
                n += len(d.token_ids)
            if d.finished:
                end = time.perf_counter()
                assert first is not None and d.stats is not None
                return first - t0, n / (end - first), 1e3 * (end - first) / max(d.stats.rounds, 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench_stalls")
    ap.add_argument("--model", default=str(BUILTIN))
    ap.add_argument("--profile", default=None)
    ap.add_argument("--backend", action="append", default=None)
    ap.add_argument("--new", type=int, default=20, help="requests with prompt lengths not seen before")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    ap.add_argument("--cprofile", default=None, metavar="FILE",
                    help="write the first request's Python profile (top 40 by cumulative time) to FILE: what a slow "
                         "first request spends its time on")
    args = ap.parse_args(argv)
    tok = Tokenizer.from_dir(Path(args.model))
    lines = (Path(args.model) / "heldout_prompts.jsonl").read_text().splitlines()
    texts = [json.loads(line)["prompt"] for line in lines]
    results: list[dict[str, Any]] = []
    for spec in args.backend or ["off"]:
        name, _, k = spec.partition(":")
        overrides: dict[str, Any] = {"model.path": args.model, "spec.backend": name, "log.level": "warning"}
        if k:
            overrides["spec.draft_tokens"] = int(k)
        t0 = time.perf_counter()
        engine = Engine(load_config(profile=args.profile, overrides=overrides))
        startup = time.perf_counter() - t0
        base = tok.encode(texts[0])[-300:]
        if args.cprofile:
            import cProfile
            import io
            import pstats

            prof = cProfile.Profile()
            ttft_first, tps_first, _ = prof.runcall(one, engine, "first", base, args.max_tokens)
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
            with open(args.cprofile, "a") as f:
                f.write(f"=== {spec}: first request ===\n{text.getvalue()}\n")
        else:
            ttft_first, tps_first, _ = one(engine, "first", base, args.max_tokens)
        ttft_steady, tps_steady, round_steady = one(engine, "steady", base, args.max_tokens)
        ratios, tok_ratios, ttfts, same = [], [], [], []
        for i in range(args.new):
            ids = tok.encode(texts[1 + i % (len(texts) - 1)])[-(37 + 13 * i) :]  # lengths 37, 50, 63, ... none repeated
            ttft, tps, per_round = one(engine, f"new{i}", ids, args.max_tokens)
            ttfts.append(1e3 * ttft)
            # The same prompt again: its shapes are no longer new and its acceptance is the same (greedy), so the
            # ratio is what the first use of a length costs, apart from how well that prompt drafts.
            _, tps_again, _ = one(engine, f"again{i}", ids, args.max_tokens)
            same.append(tps_again / tps)
            ratios.append(per_round / round_steady)  # a round's time: what a stall shows in (acceptance aside)
            tok_ratios.append(tps_steady / tps)
        r = {"backend": spec, "startup_s": startup, "ttft_first_ms": 1e3 * ttft_first, "ttft_steady_ms": 1e3 * ttft_steady,
             "tok_s_first": tps_first, "tok_s_steady": tps_steady, "round_ms_steady": round_steady,
             "worst_round_slowdown_new_lengths": max(ratios), "median_round_slowdown": sorted(ratios)[len(ratios) // 2],
             "worst_tok_s_slowdown_new_lengths": max(tok_ratios), "ttft_new_lengths_ms": ttfts,
             "worst_tok_s_slowdown_vs_same_prompt_again": max(same)}
        results.append(r)
        print(f"{spec:10s} start-up {startup:6.1f} s  TTFT first {r['ttft_first_ms']:7.1f} ms / steady "
              f"{r['ttft_steady_ms']:6.1f} ms  tok/s first {tps_first:7.1f} steady {tps_steady:7.1f}  new lengths: "
              f"round time worst {max(ratios):.2f}x, median {r['median_round_slowdown']:.2f}x of steady "
              f"{round_steady:.2f} ms; tok/s worst {max(tok_ratios):.2f}x slower than steady, {max(same):.2f}x than "
              f"the same prompt again; TTFT worst {max(ttfts):.1f} ms, median {sorted(ttfts)[len(ttfts) // 2]:.1f} ms",
              flush=True)
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
