"""Prefill on one device: the device prefill's graph pieces against the host round's eager forward.

For the built-in model and the Qwen3.5-27B shape (random bf16 weights built on the GPU), with `off` and with the
dflash2 drafter (which observes every prompt row), at a few prompt lengths on one lane: ms from the prompt to its
first token on the host (the one read-back included) through `DevicePrefill.run` (graph replays) and through the
host round (`Runner.host_round`, one eager forward), prompt tokens a second, and for one 128-row piece the GPU time
and its costliest kernels from the profiler.

    python -m tools.bench_prefill --json prefill.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ignis.artifact import BUILTIN
from ignis.engine.device_prefill import DevicePrefill, pieces
from ignis.engine.device_round import DeviceRound
from ignis.engine.request import Request
from ignis.engine.round import Runner
from ignis.engine.sampling import make_generator
from ignis.engine.scheduler import Prefill, RoundPlan
from ignis.model import gdn
from ignis.model.cache import LaneCache
from ignis.model.loader import load_model
from ignis.model.random import random_model
from ignis.params import SamplingParams
from tools.round_timing import gpu_profile, median_wall_s
from tools.round_work import QWEN35_27B, build_backend

LENGTHS = [16, 100, 500, 2000]


def request(n: int) -> Request:
    r = Request(id="p", prompt=[(7 * i) % 1000 + 5 for i in range(n)], params=SamplingParams(max_tokens=8,
                temperature=0.0), stop_ids=frozenset(), generator=make_generator(0), seed=0)
    r.lane = 0
    return r


def piece_profile(dp: DevicePrefill, rows: int) -> tuple[float, list[dict[str, Any]]]:
    """(GPU ms, costliest kernels) of one eager piece of `rows` rows on the scratch lane."""
    buf = dp.buffers[rows]
    buf.idle(dp.cache.scratch)
    seconds, _, top = gpu_profile(partial(dp.forward, buf, dp.span(rows)), top=15)
    return 1e3 * seconds, top


def bench(label: str, model: Any, path: Path, backend_kind: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    device = torch.device(args.device)
    dtype = model.embed_tokens.weight.dtype
    k = 7 if backend_kind == "dflash2" else 0
    backend = build_backend(backend_kind, k, model, path, 1, args.context, device, dtype)
    cache = LaneCache(model.config, lanes=1, context=args.context, max_cols=k + 1, device=device, dtype=dtype)
    model.rope.precompute(args.context + 16, device, dtype)
    dr = DeviceRound(model, cache, backend, device, sample_drafts=True)
    dp = DevicePrefill(model, cache, backend, device)
    runner = Runner(model, cache, backend, device, True, dr, None, dp)
    keys = sorted({(c, dp.span(s + c)) for n in args.lengths for s, c in pieces(0, n, dp.largest)} | {(128, dp.span(128))})
    capture_s = dp.capture(torch.cuda.graph_pool_handle(), keys) if device.type == "cuda" else 0.0
    rows = []
    for n in args.lengths:
        def device_prefill(n: int = n) -> None:
            r = request(n)
            cache.reset(0)
            backend.reset(0)
            assert dp.run(r, n) is not None

        def host_prefill(n: int = n) -> None:
            r = request(n)
            cache.reset(0)
            backend.reset(0)
            runner.host_round(RoundPlan([], [], [Prefill(r, n)]))

        dev, host = median_wall_s(device_prefill, args.iters), median_wall_s(host_prefill, args.iters)
        row = {"model": label, "backend": backend_kind, "tokens": n, "pieces": len(pieces(0, n, dp.largest)),
               "device_ms": 1e3 * dev, "host_ms": 1e3 * host, "device_tok_s": n / dev, "host_tok_s": n / host}
        rows.append(row)
        print(f"{label:8s} {backend_kind:8s} {n:6d} tokens  device {1e3 * dev:8.2f} ms ({row['pieces']} pieces, "
              f"{n / dev:9.0f} tok/s)  host {1e3 * host:8.2f} ms ({n / host:9.0f} tok/s)", flush=True)
    if device.type != "cuda":
        return rows
    gpu_ms, top = piece_profile(dp, 128)
    print(f"{label:8s} {backend_kind:8s} one 128-row piece: {gpu_ms:.3f} ms of GPU time; capture {capture_s:.1f} s",
          flush=True)
    for t in top[:8]:
        print(f"    {t['us']:9.1f} us  x{t['count']:4d}  {t['kernel']}", flush=True)
    rows.append({"model": label, "backend": backend_kind, "piece_rows": 128, "piece_gpu_ms": gpu_ms, "top": top,
                 "capture_s": capture_s})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench_prefill")
    ap.add_argument("--models", default="builtin,27b", help="comma list of builtin, 27b")
    ap.add_argument("--backends", default="off,dflash2")
    ap.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=LENGTHS)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda", help="cuda; cpu runs the same code (no graphs) for a quick check")
    ap.add_argument("--model-path", default=None, help="a checkpoint to use for 'builtin' (default: the built-in)")
    ap.add_argument("--chunked-columns", type=int, default=None,
                    help="pieces of at least this many rows run fla's chunked recurrence (0: never; default: the "
                         "model's own, ignis.model.gdn.CHUNKED_COLUMNS)")
    args = ap.parse_args(argv)
    if args.chunked_columns is not None:
        gdn.CHUNKED_COLUMNS = args.chunked_columns
    rows: list[dict[str, Any]] = []
    for label in args.models.split(","):
        if label == "builtin":
            path = Path(args.model_path) if args.model_path else BUILTIN
            dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
            model = load_model(path, device=args.device, dtype=dtype, exact=False)
            for b in args.backends.split(","):
                rows += bench(label, model, path, b, args)
        else:
            model = random_model(QWEN35_27B, seed=0, mtp=False, device=torch.device("cuda"), dtype=torch.bfloat16)
            with tempfile.TemporaryDirectory() as tmp:
                for b in args.backends.split(","):
                    rows += bench(label, model, Path(tmp), b, args)
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        Path(args.json).write_text(json.dumps({"device": name, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
