"""Acceptance measurement: how many tokens a round commits, per backend and draft width, on held-out prompts.

Free-running: each prompt is decoded by the engine with the backend under test; the tool reports tokens per round
(1 + accepted / rounds, the bonus counted, as DFlash and vLLM report it) and per-position acceptance
(accepted at position i / rounds that drafted position i), for greedy decoding and for sampling.

    python -m tools.acceptance --backend off --backend mtp:3 --backend dflash2:7 --limit 32 --max-tokens 128
    python -m tools.acceptance --mode sampled --temperature 1.0 --top-p 0.95 --top-k 20 --backend dflash2:7
    python -m tools.acceptance --mode sampled --backend dflash2:7 --set spec.draft_sampling=greedy   # one-hot q

Teacher-forced replay (the seeds' "sampled acceptance" method): recorded turns are replayed token for token; at each
round the backend drafts from the recorded context, the acceptance rule (rejection sampling at the given temperature,
top-p and top-k) decides how many drafts it would keep, and the lane then advances along the record (over the drafts
that equal it, plus the next recorded token). Turns are recorded from the target itself with --record:

    python -m tools.acceptance --record turns.jsonl --limit 200 --max-tokens 256
    python -m tools.acceptance --replay turns.jsonl --backend mtp:3 --backend dflash2:7

Prompts come from the built-in artifact's held-out set (`heldout_prompts.jsonl`: files the model never trained on)
unless --prompts names another JSONL file with a "prompt" (text), "messages" (chat) or "prompt_token_ids" field.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ignis.artifact import BUILTIN
from ignis.config import load_config, parse_overrides
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
        if "prompt_token_ids" in rec:
            ids = rec["prompt_token_ids"]
        elif "messages" in rec:
            ids = tokenizer.encode(tokenizer.apply_chat_template(rec["messages"]))
        else:
            ids = tokenizer.encode(rec["prompt"])
        out.append(ids)
        if len(out) == limit:
            break
    return out


SETTINGS: list[str] = []  # extra "key=value" config overrides from --set, for every engine the tool builds


def _engine(model: str, profile: str | None, backend: str, k: int, lanes: int) -> Engine:
    overrides = {"model.path": model, "spec.backend": backend, "engine.lanes": lanes, "log.level": "warning"}
    if k:
        overrides["spec.draft_tokens"] = k
    overrides.update(parse_overrides(SETTINGS))
    return Engine(load_config(profile=profile, overrides=overrides))


def _drain(engine: Engine, n: int, tally: Tally | None = None) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    done = 0
    while done < n:
        for d in engine.step():
            tokens.setdefault(d.id, []).extend(d.token_ids)
            if d.finished:
                done += 1
                if tally is not None and d.stats is not None:
                    tally.add(d.stats)
    return tokens


def measure(model: str, profile: str | None, backend: str, k: int, prompts: list[list[int]],
            params: SamplingParams, mode: str, lanes: int) -> Tally:
    """Free-running: decode every prompt with the backend; tally what each round committed."""
    engine = _engine(model, profile, backend, k, lanes)
    tally = Tally(backend, engine.backend.draft_tokens, mode)
    stop = engine.info.eos_token_ids
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add(EngineRequest(id=str(i), prompt_token_ids=ids, params=params, stop_token_ids=list(stop)))
    _drain(engine, len(prompts), tally)
    tally.seconds = time.perf_counter() - t0
    return tally


def record(model: str, profile: str | None, prompts: list[list[int]], params: SamplingParams,
           lanes: int) -> list[dict]:
    """Turns as the target itself answers them (plain decoding): {"prompt_token_ids", "response_token_ids"}."""
    engine = _engine(model, profile, "off", 0, lanes)
    stop = engine.info.eos_token_ids
    for i, ids in enumerate(prompts):
        engine.add(EngineRequest(id=str(i), prompt_token_ids=ids, params=params, stop_token_ids=list(stop)))
    out = _drain(engine, len(prompts))
    return [{"prompt_token_ids": ids, "response_token_ids": out[str(i)]} for i, ids in enumerate(prompts)]


def replay(model: str, profile: str | None, backend: str, k: int, turns: list[dict], params: SamplingParams,
           lanes: int) -> Tally:
    """Teacher-forced: each turn emits its recorded response; the stats count what the rule would have accepted."""
    import msgspec

    engine = _engine(model, profile, backend, k, lanes)
    tally = Tally(backend, engine.backend.draft_tokens, "replay")
    t0 = time.perf_counter()
    n = 0
    for i, turn in enumerate(turns):
        response = turn["response_token_ids"]
        if len(response) < 2:
            continue
        p = msgspec.structs.replace(params, max_tokens=len(response))
        engine.add(EngineRequest(id=str(i), prompt_token_ids=turn["prompt_token_ids"], params=p), forced=response)
        n += 1
    _drain(engine, n, tally)
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
    ap.add_argument("--record", default=None, help="record turns from the target into this JSONL, then stop")
    ap.add_argument("--replay", default=None, help="teacher-forced replay of the turns in this JSONL")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for every engine, e.g. spec.draft_head=shortlist, spec.draft_sampling=greedy")
    args = ap.parse_args(argv)
    SETTINGS[:] = args.set
    model = Path(args.model)
    sampled = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                             top_k=args.top_k, seed=args.seed)
    if args.replay is None:
        prompts = load_prompts(Path(args.prompts) if args.prompts else model / "heldout_prompts.jsonl",
                               Tokenizer.from_dir(model), args.limit)
    if args.record:
        turns = record(str(model), args.profile, prompts, sampled, args.lanes)
        Path(args.record).write_text("".join(json.dumps(t) + "\n" for t in turns))
        print(f"recorded {len(turns)} turns into {args.record}")
        return 0
    modes = ("replay",) if args.replay else ("greedy", "sampled") if args.mode == "both" else (args.mode,)
    turns = [json.loads(x) for x in Path(args.replay).read_text().splitlines() if x.strip()][: args.limit] if args.replay else []
    results = []
    for spec in args.backend or ["off"]:
        name, _, k = spec.partition(":")
        for mode in modes:
            if mode == "replay":
                t = replay(str(model), args.profile, name, int(k or 0), turns, sampled, args.lanes)
            else:
                params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0) if mode == "greedy" else sampled
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
