"""Acceptance measurement: how many tokens a round commits, per backend and draft width, on held-out prompts.

Free-running: each prompt is decoded by the engine with the backend under test; the tool reports tokens per round
(1 + accepted / rounds, the bonus counted, as DFlash and vLLM report it) and per-position acceptance
(accepted at position i / rounds that drafted position i), for greedy decoding and for sampling.

    python -m tools.acceptance --backend off --backend mtp:3 --backend dflash2:7 --limit 32 --max-tokens 128
    python -m tools.acceptance --mode sampled --temperature 1.0 --top-p 0.95 --top-k 20 --backend dflash2:7

Prompts come from the built-in artifact's held-out set (`heldout_prompts.jsonl`: files the model never trained on)
unless --prompts names another JSONL file with a "prompt" (text) or "prompt_token_ids" field per line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ignis.artifact import BUILTIN
from ignis.config import load_config
from ignis.engine.core import Engine
from ignis.ipc.messages import EngineRequest, RequestStats
from ignis.params import SamplingParams
from ignis.tokenizer import Tokenizer


@dataclass
class Tally:
    backend: str
    k: int
    mode: str
    prompts: int = 0
    tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    position_drafted: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, s: RequestStats) -> None:
        self.prompts += 1
        self.tokens += s.decode_tokens
        self.rounds += s.rounds
        self.drafted += s.drafted
        self.accepted += s.accepted
        for mine, theirs in ((self.position_drafted, s.position_drafted), (self.position_accepted, s.position_accepted)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v

    @property
    def tokens_per_round(self) -> float:
        return 1.0 + self.accepted / self.rounds if self.rounds else 0.0

    def per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.position_accepted, self.position_drafted)]

    def as_dict(self) -> dict:
        return {
            "backend": self.backend, "k": self.k, "mode": self.mode, "prompts": self.prompts, "tokens": self.tokens,
            "rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
            "tokens_per_round": round(self.tokens_per_round, 4),
            "per_position": [round(x, 4) for x in self.per_position()], "seconds": round(self.seconds, 2),
        }


def load_prompts(path: Path, tokenizer: Tokenizer, limit: int) -> list[list[int]]:
    out = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        ids = rec.get("prompt_token_ids") or tokenizer.encode(rec["prompt"])
        out.append(ids)
        if len(out) == limit:
            break
    return out


def measure(model: str, profile: str | None, backend: str, k: int, prompts: list[list[int]],
            params: SamplingParams, mode: str, lanes: int) -> Tally:
    overrides = {"model.path": model, "spec.backend": backend, "engine.lanes": lanes, "log.level": "warning"}
    if k:
        overrides["spec.draft_tokens"] = k
    engine = Engine(load_config(profile=profile, overrides=overrides))
    tally = Tally(backend, engine.backend.draft_tokens, mode)
    stop = engine.info.eos_token_ids
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add(EngineRequest(id=str(i), prompt_token_ids=ids, params=params, stop_token_ids=list(stop)))
    done = 0
    while done < len(prompts):
        for d in engine.step():
            if d.finished:
                done += 1
                tally.add(d.stats)
    tally.seconds = time.perf_counter() - t0
    return tally


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.acceptance", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(BUILTIN))
    ap.add_argument("--profile", default=None)
    ap.add_argument("--prompts", default=None, help="JSONL; default: the artifact's heldout_prompts.jsonl")
    ap.add_argument("--limit", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--lanes", type=int, default=4)
    ap.add_argument("--backend", action="append", default=None, help="name[:draft_tokens], repeatable")
    ap.add_argument("--mode", choices=("greedy", "sampled", "both"), default="greedy")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    model = Path(args.model)
    prompts = load_prompts(Path(args.prompts) if args.prompts else model / "heldout_prompts.jsonl",
                           Tokenizer.from_dir(model), args.limit)
    modes = ("greedy", "sampled") if args.mode == "both" else (args.mode,)
    results = []
    for spec in args.backend or ["off"]:
        name, _, k = spec.partition(":")
        for mode in modes:
            params = (SamplingParams(max_tokens=args.max_tokens, temperature=0.0) if mode == "greedy" else
                      SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                     top_k=args.top_k, seed=args.seed))
            t = measure(str(model), args.profile, name, int(k or 0), prompts, params, mode, args.lanes)
            results.append(t)
            pos = " ".join(f"{x:.2f}" for x in t.per_position())
            print(f"{t.backend:8s} k={t.k} {mode:7s} prompts={t.prompts} rounds={t.rounds} "
                  f"tokens/round={t.tokens_per_round:.3f} per-position=[{pos}]", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps([t.as_dict() for t in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
