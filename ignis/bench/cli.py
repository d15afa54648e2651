"""`ignis bench`: its flags, the targets it measures (a running server, or an `ignis serve` it starts), the progress
line, and what it prints and writes (bench.json, bench.png and, for two targets, the ratios).

Owns: turning flags into targets and levels, and running them in order. Does not own: load, summaries or the
server child (the sibling modules).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from ignis.bench import report
from ignis.bench.load import level, model_name
from ignis.bench.server import StartedServer
from ignis.bench.workloads import WORKLOADS, load
from ignis.errors import InputError


def add_parser(commands: Any) -> None:
    p = commands.add_parser("bench", help="measure a server under load: throughput, TTFT, TPOT, tokens per round",
                            description="Measure an OpenAI-compatible server under load. Without --base-url or "
                                        "--compare it starts `ignis serve MODEL` and measures that.")
    p.add_argument("model", nargs="?", metavar="MODEL",
                   help="model for the ignis serve it starts (default: the built-in model)")
    p.add_argument("--base-url", metavar="URL", help="measure a running server, e.g. http://localhost:8000/v1")
    p.add_argument("--serve-args", default="", metavar="ARGS",
                   help='arguments for the ignis serve it starts, e.g. "--profile h200 --spec off"')
    p.add_argument("--compare", nargs=2, metavar=("A", "B"),
                   help='measure two targets in one run and print B/A: each a base URL or serve arguments '
                        '(e.g. --compare "--spec off" "--spec dflash2:7")')
    p.add_argument("--workload", default="code",
                   help=f"built-in workload ({', '.join(WORKLOADS)}) or a JSONL file of prompt/messages (default code)")
    p.add_argument("--concurrency", default="1,4,16", metavar="N,N,...",
                   help="concurrency levels, requests in flight (default 1,4,16)")
    p.add_argument("--requests", type=int, default=0, metavar="N",
                   help="requests per level (default: 4 x the level, at least 8)")
    p.add_argument("--rate", type=float, default=float("inf"), metavar="R",
                   help="requests a second, Poisson arrivals (default: inf, all at once up to the concurrency)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request at most (default 128)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="every request generates --max-tokens (ignis, vLLM and llama.cpp honour it; default off)")
    p.add_argument("--api-key", help="bearer token for the server (default: none)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S", help="per-request timeout (default 600)")
    p.add_argument("--out", default="ignis-bench", metavar="DIR",
                   help="where bench.json and bench.png go (default ./ignis-bench)")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise InputError("--concurrency", f"got {text!r}; expected positive integers separated by commas, e.g. 1,4,16")
    return levels


def run(args: argparse.Namespace) -> int:
    levels = _levels(args.concurrency)
    if args.requests < 0 or args.max_tokens < 1 or not args.rate > 0:
        raise InputError("--requests", "--requests must be >= 0, --max-tokens >= 1 and --rate > 0")
    if args.compare and args.base_url:
        raise InputError("--compare", "give --compare or --base-url, not both")
    items = load(args.workload, args.max_tokens)
    out = Path(args.out)
    specs = args.compare or [args.base_url or args.serve_args]
    targets = [_measure(spec, args, levels, items, out, i) for i, spec in enumerate(specs)]
    result: dict[str, Any] = {
        "workload": args.workload, "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos,
        "rate": None if args.rate == float("inf") else args.rate,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "targets": targets,
    }
    if len(targets) == 2:
        result["ratios"] = report.ratios(targets[0], targets[1])
        print(report.ratio_table(targets[0]["label"], targets[1]["label"], result["ratios"]))
    report.write_json(out / "bench.json", result)
    wrote = [str(out / "bench.json")]
    if report.plot(out / "bench.png", targets, f"ignis bench: {args.workload}, max_tokens {args.max_tokens}"):
        wrote.append(str(out / "bench.png"))
    else:
        print("ignis bench: no plot (pip install 'ignis[bench]' for matplotlib)", file=sys.stderr)
    print("wrote " + ", ".join(wrote))
    return 1 if any(r["errors"] for t in targets for r in t["levels"]) else 0


def _measure(spec: str, args: argparse.Namespace, levels: list[int], items: list[Any], out: Path, index: int
             ) -> dict[str, Any]:
    """Measure one target: a base URL as is, or an ignis serve started with `spec` as its arguments."""
    server = None
    if spec.startswith(("http://", "https://")):
        base_url, label = spec.rstrip("/"), spec
    else:
        server = StartedServer(args.model, spec, out / f"serve-{index}.log")
        base_url, label = server.base_url, f"ignis serve {spec}".strip()
    try:
        model = asyncio.run(model_name(base_url, args.api_key))
        results = []
        for c in levels:
            n = args.requests or max(4 * c, 8)
            samples, wall = asyncio.run(level(base_url, model, items, concurrency=c, requests=n, rate=args.rate,
                                              timeout_s=args.timeout, api_key=args.api_key,
                                              ignore_eos=args.ignore_eos, on_done=_progress(label, c, n)))
            results.append(report.summarize(samples, wall, c))
        print(report.table(f"{label} ({model})", results), flush=True)
        return {"label": label, "base_url": base_url, "model": model, "levels": results}
    finally:
        if server is not None:
            server.stop()


def _progress(label: str, concurrency: int, total: int) -> Any:
    tty = sys.stderr.isatty()

    def show(done: int) -> None:
        if tty:
            width = 30
            bar = "#" * (width * done // total) + "." * (width - width * done // total)
            end = "\n" if done == total else ""
            print(f"\r  {label} c={concurrency} [{bar}] {done}/{total}", end=end, file=sys.stderr, flush=True)
        elif done == total or done % max(total // 4, 1) == 0:
            print(f"  {label} c={concurrency}: {done}/{total} requests", file=sys.stderr, flush=True)

    return show
