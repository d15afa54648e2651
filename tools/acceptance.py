"""Acceptance measurement: how many tokens a round commits, per backend and draft width, and how often outputs loop.

Free-running, on three suites unless told otherwise: greedy code (the artifact's held-out code prompts), greedy free
prose (tools/prose_prompts.jsonl, chat requests for explanations and stories) and sampled chat turns (T = 1.0,
top_p 0.95, top_k 20, on the artifact's held-out chat requests). For each it reports tokens a round after the
prefill's first token ((emitted - 1) / rounds, summed over prompts: ignis.acceptance), per-position acceptance
(accepted at position i / rounds that drafted position i) and the loop rate: the share of outputs whose last 64
tokens repeat a shorter period, since a loop is the easiest text to draft and flatters every figure beside it.

    python -m tools.acceptance --backend dflash2:7 --backend mtp:3 --limit 24 --max-tokens 256
    python -m tools.acceptance --suite code --backend off --backend dflash2:7          # one suite
    python -m tools.acceptance --prompts my.jsonl --mode sampled --backend dflash2:7    # your own prompts
    python -m tools.acceptance --suite sampled --backend dflash2:7 --set spec.draft_sampling=greedy   # one-hot q
    python -m tools.acceptance --suite sampled --backend dflash2:7 --seeds 4     # seeds 0-3 and their mean

Teacher-forced replay (the seeds' "sampled acceptance" method): recorded turns are replayed token for token; at each
round the backend drafts from the recorded context, the acceptance rule (rejection sampling at the given temperature,
top-p and top-k) decides how many drafts it would keep, and the lane then advances along the record (over the drafts
that equal it, plus the next recorded token). Turns are recorded from the target itself with --record:

    python -m tools.acceptance --record turns.jsonl --limit 200 --max-tokens 256
    python -m tools.acceptance --replay turns.jsonl --backend mtp:3 --backend dflash2:7

With --anatomy, each sampled run also reports where its drafts are lost, position by position (ignis.engine.accept
.Anatomy, recorded in the host round, so on the CPU): the chance the verifier keeps a draft from q, sum min(p, q),
and the target's mass on tokens q cannot propose after the request's cuts; and the drafts the token rule and block
verification (spec.verify) would keep in expectation on the same verifies:

    python -m tools.acceptance --suite sampled --backend dflash2:7 --seeds 2 --anatomy

A prompts file is JSONL with a "prompt" (text), "messages" (chat) or "prompt_token_ids" field on each line.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from ignis.acceptance import Tally, drain, measure
from ignis.artifact import BUILTIN
from ignis.config import load_config, parse_overrides
from ignis.engine.accept import Anatomy
from ignis.engine.core import Engine
from ignis.ipc.messages import EngineRequest
from ignis.params import SamplingParams
from ignis.tokenizer import Tokenizer

PROSE = Path(__file__).resolve().parent / "prose_prompts.jsonl"


@dataclass(frozen=True)
class Suite:
    name: str
    prompts: Path
    sampled: bool


def suites(model: Path, names: list[str]) -> list[Suite]:
    known = {"code": Suite("code", model / "heldout_prompts.jsonl", False),
             "prose": Suite("prose", PROSE, False),
             "sampled": Suite("sampled", model / "heldout_chat.jsonl", True)}
    return [known[n] for n in names]


def load_prompts(path: Path, tokenizer: Tokenizer | Path, limit: int) -> list[list[int]]:
    """Token ids of the first `limit` prompts; `tokenizer` may be the model directory, read only if a prompt is text."""
    out = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if "prompt_token_ids" in rec:
            ids = rec["prompt_token_ids"]
            out.append(ids)
            if len(out) == limit:
                break
            continue
        if isinstance(tokenizer, Path):
            tokenizer = Tokenizer.from_dir(tokenizer)
        if "messages" in rec:
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


def record(model: str, profile: str | None, prompts: list[list[int]], params: SamplingParams,
           lanes: int) -> list[dict]:
    """Turns as the target itself answers them (plain decoding): {"prompt_token_ids", "response_token_ids"}."""
    _, outputs = measure(_engine(model, profile, "off", 0, lanes), prompts, params, "record")
    return [{"prompt_token_ids": ids, "response_token_ids": out} for ids, out in zip(prompts, outputs)]


def replay(model: str, profile: str | None, backend: str, k: int, turns: list[dict], params: SamplingParams,
           lanes: int) -> Tally:
    """Teacher-forced: each turn emits its recorded response; the stats count what the rule would have accepted."""
    engine = _engine(model, profile, backend, k, lanes)
    tally = Tally(backend, engine.backend.draft_tokens, "replay")
    t0 = time.perf_counter()
    ids = []
    for i, turn in enumerate(turns):
        response = turn["response_token_ids"]
        if len(response) < 2:
            continue
        p = msgspec.structs.replace(params, max_tokens=len(response))
        engine.add(EngineRequest(id=str(i), prompt_token_ids=turn["prompt_token_ids"], params=p), forced=response)
        ids.append(str(i))
    done = drain(engine, len(ids))
    tally.seconds = time.perf_counter() - t0
    for rid in ids:
        tally.add(done[rid][1], done[rid][0])
    return tally


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.acceptance", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(BUILTIN))
    ap.add_argument("--profile", default=None)
    ap.add_argument("--suite", action="append", choices=("code", "prose", "sampled"), default=None,
                    help="repeatable; default: all three")
    ap.add_argument("--prompts", default=None, help="your own JSONL prompts instead of the suites (with --mode)")
    ap.add_argument("--mode", choices=("greedy", "sampled"), default="greedy", help="how --prompts are decoded")
    ap.add_argument("--limit", type=int, default=24, help="prompts per suite")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--lanes", type=int, default=4)
    ap.add_argument("--backend", action="append", default=None, help="name[:draft_tokens], repeatable")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", type=int, default=1,
                    help="sampled suites run once per seed from --seed on, each reported, then their mean")
    ap.add_argument("--anatomy", action="store_true",
                    help="sampled runs also report, per draft position, the chance a draft is kept and the target's "
                         "mass outside the draft distribution's support (host round: on the CPU)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--record", default=None, help="record turns from the target into this JSONL, then stop")
    ap.add_argument("--replay", default=None, help="teacher-forced replay of the turns in this JSONL")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for every engine, e.g. spec.draft_head=shortlist, spec.draft_sampling=greedy")
    args = ap.parse_args(argv)
    if args.seeds < 1:
        ap.error(f"--seeds: at least 1, got {args.seeds}")
    SETTINGS[:] = args.set
    model = Path(args.model)
    sampled = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                             top_k=args.top_k, seed=args.seed)
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    if args.prompts:
        chosen = [Suite(Path(args.prompts).stem, Path(args.prompts), args.mode == "sampled")]
    else:
        chosen = suites(model, args.suite or ["code", "prose", "sampled"])
    for s in chosen:
        if not args.replay and not s.prompts.is_file():
            ap.error(f"suite {s.name}: no prompts at {s.prompts}; give --prompts FILE or choose --suite")
    if args.record:
        prompts = load_prompts(chosen[0].prompts, model, args.limit)
        turns = record(str(model), args.profile, prompts, sampled, args.lanes)
        Path(args.record).write_text("".join(json.dumps(t) + "\n" for t in turns))
        print(f"recorded {len(turns)} turns into {args.record}")
        return 0
    turns = [json.loads(x) for x in Path(args.replay).read_text().splitlines() if x.strip()][: args.limit] if args.replay else []
    results = []
    anatomies: dict[int, Anatomy] = {}  # id of a run's Tally -> what --anatomy recorded during it
    for spec in args.backend or ["off"]:
        name, _, k = spec.partition(":")
        if args.replay:
            runs = [replay(str(model), args.profile, name, int(k or 0), turns, sampled, args.lanes)]
        else:
            engine = _engine(str(model), args.profile, name, int(k or 0), args.lanes)
            runs = []
            for s in chosen:
                seeds = range(args.seed, args.seed + args.seeds) if s.sampled else [None]
                for seed in seeds:
                    params = msgspec.structs.replace(sampled, seed=seed) if seed is not None else greedy
                    label = s.name if args.seeds == 1 or seed is None else f"{s.name}@{seed}"
                    anatomy = Anatomy() if args.anatomy and s.sampled else None
                    engine.runner.anatomy = anatomy
                    runs.append(measure(engine, load_prompts(s.prompts, model, args.limit), params, label)[0])
                    engine.runner.anatomy = None
                    if anatomy is not None:
                        anatomies[id(runs[-1])] = anatomy
        for t in runs:
            results.append(t)
            pos = " ".join(f"{x:.2f}" for x in t.per_position())
            print(f"{t.backend:8s} k={t.k} {t.suite:8s} prompts={t.prompts} rounds={t.rounds} "
                  f"tokens/round={t.tokens_per_round:.3f} loop_rate={t.loop_rate:.2f} per-position=[{pos}]", flush=True)
            if id(t) in anatomies:
                _print_anatomy(anatomies[id(t)])
        for suite in dict.fromkeys(t.suite.partition("@")[0] for t in runs if "@" in t.suite):
            per_seed = [t.tokens_per_round for t in runs if t.suite.partition("@")[0] == suite]
            print(f"{name:8s} k={runs[0].k} {suite:8s} mean of seeds {args.seed}-{args.seed + args.seeds - 1}: "
                  f"tokens/round={statistics.fmean(per_seed):.3f}{_spread(per_seed)}", flush=True)
    if args.json:
        rows = [{**t.as_dict(), **({"anatomy": anatomies[id(t)].rows(), "expected_kept": anatomies[id(t)].expected()}
                                   if id(t) in anatomies else {})} for t in results]
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def _print_anatomy(a: Anatomy) -> None:
    rows = a.rows()
    if not rows:
        print("  anatomy: no sampled verify ran in the host round (it runs there on the CPU)", flush=True)
    for r in rows:
        print(f"  position {r['position']}: reached {r['reached']}, chance kept {r['kept']:.3f}, p outside q's "
              f"support {r['p_outside_q']:.3f}, tokens in q's support {r['q_support']:.1f}, in p's "
              f"{r['p_support']:.1f}", flush=True)
    e = a.expected()
    if e["verifies"]:
        print(f"  expected drafts kept a verify, both rules on these {e['verifies']} verifies: token rule "
              f"{e['token']:.3f}, block verification {e['block']:.3f}", flush=True)


def _spread(per_seed: list[float]) -> str:
    """The seeds' standard error of the mean and range: two configurations whose means differ by less than about
    twice the error are not told apart by these seeds."""
    if len(per_seed) < 2:
        return ""
    error = statistics.stdev(per_seed) / math.sqrt(len(per_seed))
    return f" +- {error:.3f} (standard error; seeds {min(per_seed):.3f}-{max(per_seed):.3f})"


if __name__ == "__main__":
    sys.exit(main())
