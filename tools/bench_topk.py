"""Top-k kernel benchmark on a CUDA device: ours against torch.topk and against the bandwidth floor.

    python -m tools.bench_topk --out topk.md --json topk.json --sweep

For every (rows, vocabulary, k, dtype) of the grid it checks that ours equals the reference, then reports, in µs
(CUDA events, medians; "flushed" means a 256 MB memset right before, so the logits come from DRAM):
- floor: bytes of the logits read once / the device-to-device copy bandwidth measured in the same run;
- cold: one call captured in a CUDA graph, replayed after a flush: device time, no host cost;
- warm: ten calls in one graph, back to back, per call (logits L2-resident where they fit, as after the LM head);
- eager: one plain call after a flush (the host's launch cost shows where it exceeds the flush);
- the same three for torch.topk, and the host-side cost of one eager call of each.
--sweep times other splits of the row (blocks per SM, minimum words per block) through the launcher's own `launch`.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import torch

from ignis.kernels.topk import topk, topk_reference
from ignis.kernels.topk_launch import BLOCKS_PER_SM, MIN_WORDS, Plan, launch, plan, split, words

FLUSH_BYTES = 256 << 20


def _events_median_us(fn: Callable[[], Any], iters: int, flush: torch.Tensor | None) -> float:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        if flush is not None:
            flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return 1000 * statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def _graph(fn: Callable[[], Any], calls: int) -> torch.cuda.CUDAGraph:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    return graph


def _graph_cold_us(fn: Callable[[], Any], iters: int, flush: torch.Tensor) -> float:
    """Device time of one call from a cold L2: a one-call graph replayed after each flush (no host cost inside)."""
    return _events_median_us(_graph(fn, 1).replay, iters, flush)


def _graph_warm_us(fn: Callable[[], Any], calls: int = 10, replays: int = 20) -> float:
    """Per-call time of `calls` back-to-back calls in one graph (inputs L2-warm where they fit)."""
    return _events_median_us(_graph(fn, calls).replay, replays, None) / calls


def _host_us(fn: Callable[[], Any], calls: int = 300) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return 1e6 * host / calls


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 2 GiB device-to-device copy (median of 10)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    us = _events_median_us(lambda: dst.copy_(src), 10, None)
    return 2 * src.numel() / (us * 1e-6)


def _correct(x: torch.Tensor, k: int) -> bool:
    vals, ids = topk(x, k)
    ref_vals, ref_ids = topk_reference(x, k)
    return torch.equal(ids, ref_ids) and torch.equal(vals, ref_vals)


def cuda_row(x: torch.Tensor, k: int, flush: torch.Tensor, iters: int, shapes: list[tuple[int, int]]) -> dict:
    """The two-launch CUDA C++ kernel (ignis.kernels.topk_cuda) on x at each (BLOCKS_PER_SM, MIN_SHARE) of `shapes`:
    exact against the reference, and its cold and warm µs."""
    from ignis.kernels import topk_cuda

    ref_vals, ref_ids = topk_reference(x, k)
    shipped = (topk_cuda.BLOCKS_PER_SM, topk_cuda.MIN_SHARE)
    out: dict[str, Any] = {}
    try:
        for per_sm, share in shapes:
            topk_cuda.BLOCKS_PER_SM, topk_cuda.MIN_SHARE = per_sm, share
            vals, ids = topk_cuda.topk(x, k)
            name = f"cuda_{per_sm}_{share}"
            out[f"{name}_exact"] = torch.equal(ids, ref_ids) and torch.equal(vals, ref_vals)
            fn = lambda: topk_cuda.topk(x, k)  # noqa: E731
            out[f"{name}_cold_us"] = _graph_cold_us(fn, iters, flush)
            out[f"{name}_warm_us"] = _graph_warm_us(fn)
    finally:
        topk_cuda.BLOCKS_PER_SM, topk_cuda.MIN_SHARE = shipped
    return out


def grid_row(rows: int, ncols: int, k: int, dtype: torch.dtype, bw: float, flush: torch.Tensor, iters: int,
             cuda_shapes: list[tuple[int, int]] | None = None) -> dict:
    x = torch.randn(rows, ncols, device="cuda").to(dtype)
    floor = x.numel() * x.element_size() / bw * 1e6
    ours = lambda: topk(x, k)  # noqa: E731
    theirs = lambda: torch.topk(x, k)  # noqa: E731
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    p = plan(rows, ncols, k, dtype == torch.bfloat16, sms)
    return {
        "rows": rows, "cols": ncols, "k": k, "dtype": str(dtype).removeprefix("torch."), "nblk": p.nblk,
        "MB": x.numel() * x.element_size() / 1e6, "floor_us": floor, "correct": _correct(x, k),
        "ours_eager_us": _events_median_us(ours, iters, flush), "ours_cold_us": _graph_cold_us(ours, iters, flush),
        "ours_warm_us": _graph_warm_us(ours), "torch_eager_us": _events_median_us(theirs, iters, flush),
        "torch_cold_us": _graph_cold_us(theirs, iters, flush), "torch_warm_us": _graph_warm_us(theirs),
        **(cuda_row(x, k, flush, iters, cuda_shapes) if cuda_shapes and k <= 32 else {}),
    }


def sweep(bw: float, flush: torch.Tensor, iters: int) -> list[dict]:
    """Other splits of the row, through `launch` with buffers of their own (the launcher's are sized for its plan)."""
    from numba import cuda

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ws = torch.empty(1 << 22, dtype=torch.int64, device="cuda")
    counters = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
    counters_nb = cuda.as_cuda_array(counters)
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (1, 8, 56, 256):
            x = torch.randn(rows, 248320, device="cuda").to(dtype)
            half = dtype == torch.bfloat16
            ref_vals, ref_ids = topk_reference(x, 16)
            for bps in (1, 2, 4, 8):
                for min_words in (1024, 2048, 4096):
                    nwords = words(248320, half)
                    nblk, chunk = split(nwords, min(math.ceil(bps * sms / rows), math.ceil(nwords / min_words)))
                    p = Plan(nblk, chunk, 0 if nblk == 1 else 16 * math.ceil(nblk * 16 / 16))
                    vals = torch.empty(rows, 16, dtype=dtype, device="cuda")
                    ids = torch.empty(rows, 16, dtype=torch.int64, device="cuda")
                    fn = lambda: launch(x, 248320, 16, p, ws, counters_nb, vals, ids)  # noqa: E731
                    fn()
                    ok = torch.equal(ids, ref_ids) and torch.equal(vals, ref_vals)
                    us = _graph_cold_us(fn, iters, flush)
                    out.append({"dtype": str(dtype).removeprefix("torch."), "rows": rows, "blocks_per_sm": bps,
                                "min_words": min_words, "nblk": nblk, "correct": ok, "eager_us": us,
                                "floor_us": x.numel() * x.element_size() / bw * 1e6})
    return out


def _table(rows: list[dict], cols: list[tuple[str, str, str]]) -> str:
    lines = ["| " + " | ".join(h for h, _, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(format(r[key], fmt) for _, key, fmt in cols) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,7,8,56,256")
    ap.add_argument("--cols", default="8192,151936,248320")
    ap.add_argument("--k", default="8,16")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--cuda", default="", help="the CUDA C++ kernel (k <= 32) too, at each BLOCKS_PER_SMxMIN_SHARE "
                    "of this comma list (e.g. 4x256,8x128); its figures go to the JSON lines")
    ap.add_argument("--out", help="write the markdown report here too")
    ap.add_argument("--json", help="write every number here")
    ap.add_argument("--commit", help="the commit measured, where the checkout has no git metadata")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    import numba
    from numba import cuda

    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = {
        "device": torch.cuda.get_device_name(0), "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__, "numba": numba.__version__, "numba_cuda_impl": cuda.implementation,
        "commit": args.commit or rev or "unknown", "date": time.strftime("%Y-%m-%d"), "argv": " ".join(sys.argv),
        "blocks_per_sm": BLOCKS_PER_SM, "min_words": MIN_WORDS,
    }
    try:
        import numba_cuda

        meta["numba_cuda"] = numba_cuda.__version__
    except (ImportError, AttributeError):
        meta["numba_cuda"] = "unknown"
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    bw = copy_bandwidth()
    meta["copy_TBps"] = bw / 1e12
    t0 = time.perf_counter()
    for dtype in (torch.float32, torch.bfloat16):
        for k in (8, 40):
            topk(torch.randn(2, 4096, device="cuda").to(dtype), k)  # compile all four kernels
    torch.cuda.synchronize()
    meta["compile_s"] = time.perf_counter() - t0
    from ignis.kernels.topk_launch import kernel

    for half in (False, True):
        for two in (False, True):
            disp = kernel(half, two)
            try:  # registers and local memory (spills) per thread, as the driver reports them
                meta[f"regs_{'bf16' if half else 'fp32'}_k{64 if two else 32}"] = (
                    disp.get_regs_per_thread(), disp.get_local_mem_per_thread())
            except (AttributeError, TypeError) as e:
                meta["regs_error"] = repr(e)
    x1 = torch.randn(1, 8192, device="cuda")
    meta["host_us_ours"] = _host_us(lambda: topk(x1, 8))
    meta["host_us_torch"] = _host_us(lambda: torch.topk(x1, 8))
    print(json.dumps(meta), flush=True)

    grid = []
    for dtype_name in args.dtypes.split(","):
        for rows in map(int, args.rows.split(",")):
            for ncols in map(int, args.cols.split(",")):
                for k in map(int, args.k.split(",")):
                    shapes = [tuple(map(int, w.split("x"))) for w in args.cuda.split(",") if w]
                    r = grid_row(rows, ncols, k, getattr(torch, dtype_name), bw, flush, args.iters,
                                 shapes)  # type: ignore[arg-type]
                    r["x_floor"] = r["ours_cold_us"] / r["floor_us"]
                    r["vs_torch"] = r["torch_cold_us"] / r["ours_cold_us"]
                    grid.append(r)
                    print(json.dumps(r), flush=True)
    report = [
        f"{meta['date']}, commit {meta['commit']}, {meta['device']} ({meta['sms']} SMs), torch {meta['torch']}, "
        f"numba {meta['numba']}, numba-cuda {meta['numba_cuda']} ({meta['numba_cuda_impl']}); copy bandwidth "
        f"{meta['copy_TBps']:.2f} TB/s; compile of four kernels {meta['compile_s']:.1f} s; host cost of one eager "
        f"call {meta['host_us_ours']:.1f} µs (torch.topk {meta['host_us_torch']:.1f} µs). All times µs, medians.",
        "",
        _table(grid, [("rows", "rows", "d"), ("V", "cols", "d"), ("k", "k", "d"), ("dtype", "dtype", "s"),
                      ("blocks/row", "nblk", "d"), ("floor", "floor_us", ".1f"), ("ours cold", "ours_cold_us", ".1f"),
                      ("ours warm", "ours_warm_us", ".1f"), ("ours eager", "ours_eager_us", ".1f"),
                      ("torch cold", "torch_cold_us", ".1f"), ("torch warm", "torch_warm_us", ".1f"),
                      ("torch eager", "torch_eager_us", ".1f"), ("ours/floor", "x_floor", ".2f"),
                      ("torch/ours", "vs_torch", ".1f"), ("exact", "correct", "")]),
    ]
    sw: list[dict] = []
    if args.sweep:
        sw = sweep(bw, flush, args.iters)
        report += ["", "Split sweep (k=16, V=248320, device time from a cold L2):", "",
                   _table(sw, [("dtype", "dtype", "s"), ("rows", "rows", "d"), ("blocks/SM", "blocks_per_sm", "d"),
                               ("min words", "min_words", "d"), ("blocks/row", "nblk", "d"),
                               ("µs", "eager_us", ".1f"), ("floor", "floor_us", ".1f"), ("exact", "correct", "")])]
    text = "\n".join(report)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "grid": grid, "sweep": sw}, f, indent=1)


if __name__ == "__main__":
    main()
