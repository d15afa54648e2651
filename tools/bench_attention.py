"""Paged attention a call at the 27B attention shape: each path of ignis.kernels.attention.attend against the floor.

For 1 and 8 lanes, 1 and 8 columns (a decode; a verify of 7 drafts) and key spans of 1,024, 32,768 and 131,072 slots
(and 262,144 at one lane), every lane's columns at the end of its span: µs a call of each path (the numba kernel
where a KV head has at most 16 query rows, the Triton kernel, the reference: gather + SDPA), one call captured in a
CUDA graph and replayed after an L2 flush (median of CUDA events), and the ratio to the floor: the K and V bytes a
call must read (lanes x span x KV heads x head width x 2 bytes, twice) over the device-to-device copy bandwidth
measured in the same run. Each case gets a pool of its own, just big enough (the lanes' pages of 64 and the null
page); "auto" says which path the engine takes there, "err" the Triton output's relative distance to the reference.
--sweep also times the Triton kernel under other tiles and split sizes.

    python -m tools.bench_attention --json attention.json --md attention.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

NH, NKV, HD, PAGE = 24, 4, 256, 64  # Qwen3.5-27B's attention layers; the engine's pages
FLUSH_BYTES = 256 << 20  # more than an H200's 50 MB of L2
# --sweep's Triton tiles: (keys a tile, warps, stages); each compiles for sm_90 within an SM's shared memory at hd 256
SWEEP = [(32, 4, 2), (32, 8, 2), (32, 8, 3), (64, 8, 2), (16, 4, 3)]


@dataclass(frozen=True)
class Case:
    lanes: int
    columns: int
    span: int  # key slots each lane reads

    @property
    def rows(self) -> int:
        """Query rows a KV head: the group's query heads x the columns."""
        return NH // NKV * self.columns

    @property
    def floor_bytes(self) -> int:
        """K and V of every lane's span, bf16, read once."""
        return self.lanes * self.span * NKV * HD * 2 * 2


def cases(lanes: list[int], columns: list[int], spans: list[int], longest: int) -> list[Case]:
    """Every (lanes, columns, span), then the `longest` span at one lane (0: none)."""
    out = [Case(b, c, s) for s in spans for b in lanes for c in columns]
    return out + ([Case(1, c, longest) for c in columns] if longest else [])


def paths(case: Case) -> list[str]:
    """The paths worth timing: numba only where a block holds its rows (ignis.kernels.attention.MAX_ROWS)."""
    from ignis.kernels.attention import MAX_ROWS

    return (["numba"] if case.rows <= MAX_ROWS else []) + ["triton", "reference"]


def inputs(case: Case, seed: int = 0) -> dict[str, Any]:
    """A pool of the case's pages in shuffled order on the GPU, queries, the gate projection and the engine's mask."""
    from ignis.model.decode import DecodeStep
    from ignis.model.ops import Rope

    g = torch.Generator(device="cuda").manual_seed(seed)
    b, c, n = case.lanes, case.columns, -(-case.span // PAGE)
    table = (torch.randperm(b * n, device="cuda", generator=g) + 1).view(b, n)  # page 0: the null page
    kc = torch.randn(1 + b * n, PAGE, NKV, HD, device="cuda", generator=g).bfloat16()
    vc = torch.randn(1 + b * n, PAGE, NKV, HD, device="cuda", generator=g).bfloat16()
    lanes = torch.arange(b, device="cuda")
    positions = (case.span - c + torch.arange(c, device="cuda")).expand(b, c).contiguous()
    step = DecodeStep.build(lanes, positions, Rope(64, 1e7), torch.bfloat16, span=case.span, record=c > 1)
    q = torch.randn(b, NKV, case.rows, HD, device="cuda", generator=g).bfloat16()
    qkv = torch.randn(b * c, (2 * NH + 2 * NKV) * HD, device="cuda", generator=g).bfloat16()
    return {"q": q, "kc": kc, "vc": vc, "table": table, "lanes": lanes, "positions": positions, "span": step.span,
            "scale": HD**-0.5, "qkv": qkv, "nh": NH}


def call(x: dict[str, Any], path: str, **triton_args: Any) -> Callable[[], torch.Tensor]:
    """One attention call down `path` (triton_args: the Triton kernel's per_split and tile, for the sweep)."""
    from ignis.kernels import attention, attention_triton

    args = (x["q"], x["kc"], x["vc"], x["table"], x["lanes"], x["positions"], x["span"], x["scale"], x["qkv"], x["nh"])
    if triton_args:
        return lambda: attention_triton.attend(*args, **triton_args)

    def run() -> torch.Tensor:
        attention.use(path)  # type: ignore[arg-type]
        try:
            return attention.attend(*args)
        finally:
            attention.use("auto")

    return run


def graph_us(fn: Callable[[], torch.Tensor], iters: int, flush: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(median µs of one call captured in a CUDA graph, replayed after an L2 flush; the call's output)."""
    fn()  # compile and load before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends, strict=True):
        flush.zero_()
        s.record()
        graph.replay()
        e.record()
    torch.cuda.synchronize()
    return 1000 * statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)), out


def measure(case: Case, bw: float, iters: int, flush: torch.Tensor, sweep: bool) -> list[dict[str, Any]]:
    from ignis.kernels.attention import route, splits
    from ignis.kernels.attention_triton import Tiles, tiles

    x = inputs(case)
    floor_us = case.floor_bytes / bw * 1e6
    base = asdict(case) | {"rows": case.rows, "MB": case.floor_bytes / 1e6, "floor_us": floor_us, "auto": route(x["q"])}
    rows, outs = [], {}
    with torch.inference_mode():
        for path in paths(case):
            us, outs[path] = graph_us(call(x, path), iters, flush)
            rows.append(base | {"path": path, "us": us, "x_floor": us / floor_us})
        ref = outs["reference"].float()
        for r in rows:
            r["err"] = float((outs[r["path"]].float() - ref).norm() / ref.norm())
        if sweep:
            plan = splits(case.span, case.lanes, NKV, tiles(case.rows, HD, torch.bfloat16).keys)[1]
            for tile in (Tiles(*t) for t in SWEEP):
                whole = -(-case.span // tile.keys) * tile.keys  # one split
                for per in sorted({min(-(-m * plan // tile.keys) * tile.keys, whole) for m in (1, 4, 16)}):
                    us, out = graph_us(call(x, "triton", per_split=per, tile=tile), iters, flush)
                    err = float((out.float() - ref).norm() / ref.norm())
                    rows.append(base | {"path": f"triton {tile.keys}k {tile.warps}w {tile.stages}s per {per}",
                                        "us": us, "x_floor": us / floor_us, "err": err})
    del x, outs
    torch.cuda.empty_cache()
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    cols = [("lanes", "lanes", "d"), ("columns", "columns", "d"), ("span", "span", "d"), ("path", "path", "s"),
            ("µs", "us", ".1f"), ("floor µs", "floor_us", ".1f"), ("x floor", "x_floor", ".2f"), ("auto", "auto", "s"),
            ("err", "err", ".1e")]
    lines = ["| " + " | ".join(h for h, _, _ in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(format(r[key], fmt) for _, key, fmt in cols) + " |" for r in rows]
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--lanes", default="1,8")
    ap.add_argument("--columns", default="1,8")
    ap.add_argument("--spans", default="1024,32768,131072")
    ap.add_argument("--longest", type=int, default=262144, help="a span timed at one lane only (0: none)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="the Triton kernel under other tiles and split sizes too")
    ap.add_argument("--json", help="write every number here")
    ap.add_argument("--md", help="write the table here too")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention needs a CUDA device", file=sys.stderr)
        return 1
    from tools.round_timing import copy_bandwidth

    bw = copy_bandwidth(torch.device("cuda"))
    meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "copy_TBps": bw / 1e12,
            "date": time.strftime("%Y-%m-%d"), "argv": " ".join(sys.argv)}
    print(json.dumps(meta), flush=True)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    rows: list[dict[str, Any]] = []
    for case in cases(_ints(args.lanes), _ints(args.columns), _ints(args.spans), args.longest):
        for r in measure(case, bw, args.iters, flush, args.sweep):
            rows.append(r)
            print(json.dumps(r), flush=True)
        if args.json:  # saved as they come: a long run that fails late keeps what it measured
            Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = table(rows)
    print(md)
    if args.md:
        Path(args.md).write_text(f"`{meta['argv']}` on {meta['device']}, {meta['date']}, copy "
                                 f"{meta['copy_TBps']:.2f} TB/s\n\n{md}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
