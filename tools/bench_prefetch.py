"""What an L2 prefetch of a weight's first bytes takes off its product when the memory would otherwise idle first.

One call is a window of `--windows` µs in which the memory idles (torch.cuda._sleep: one thread spinning, as a
round's small kernels leave the memory mostly idle) and then the product x @ W^T (cuBLAS, bf16) at a 27B shape; with
a prefetch, ignis.kernels.l2_prefetch asks for W's first `--mb` MB on a side stream as the window starts (the fork
ignis.model.prefetch makes). Calls are timed as tools.quant_products times products (a CUDA graph cycling over
weight copies that defeat L2), so each figure is µs a call, window included; "saved" is the time without the prefetch
less the time with it, against the prefetched bytes' own time at the copy bandwidth ("ideal": what reading them from
memory costs the product at most).

    python -m tools.bench_prefetch --out prefetch.json
    python -m tools.bench_prefetch --shapes "mlp down" --rows 1 --windows 10 --mb 16 --forms all
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ignis.kernels.l2_prefetch import Form, prefetch
from tools.bench_round import copy_bandwidth
from tools.quant_products import SHAPES, graph_ms, weight_copies

FORMS = {"bulk": Form(), "bulk-wide": Form(blocks=132, threads=32, chunk=16384),
         "bulk-big": Form(blocks=16, threads=32, chunk=65536), "lines": Form(bulk=False, blocks=132, threads=128,
                                                                             chunk=2048)}
MB = 2**20


def call(w: torch.Tensor, x: torch.Tensor, cycles: int, nbytes: int, form: Form,
         side: torch.cuda.Stream) -> Callable[[], object]:
    """One window and product, the window's prefetch forked onto `side` and joined after the product."""

    def run() -> None:
        main = torch.cuda.current_stream()
        if nbytes:
            side.wait_stream(main)
            with torch.cuda.stream(side):
                prefetch(w, nbytes, form)
        if cycles:
            torch.cuda._sleep(cycles)
        F.linear(x, w)
        if nbytes:
            main.wait_stream(side)

    return run


def sweep(args: argparse.Namespace, bw: float) -> list[dict[str, Any]]:
    dev = torch.device("cuda")
    side = torch.cuda.Stream()
    ghz = torch.cuda.get_device_properties(dev).clock_rate / 1e6 if hasattr(
        torch.cuda.get_device_properties(dev), "clock_rate") else 1.98
    out: list[dict[str, Any]] = []
    shapes = [s for s in SHAPES if s[0] in args.shapes.split(",")] if args.shapes else SHAPES
    forms = list(FORMS) if args.forms == "all" else args.forms.split(",")
    for name, nout, ncols in shapes:
        wb = (torch.randn(nout, ncols, device=dev) * 0.02).bfloat16()
        copies = weight_copies(wb.nbytes, wb.clone)
        del wb
        for rows in args.rows:
            x = torch.randn(rows, ncols, device=dev).bfloat16()
            for window in args.windows:
                cycles = int(window * 1e3 * ghz)
                alone = graph_ms([call(w, x, cycles, 0, FORMS["bulk"], side) for w in copies], args.reps)
                sleep = graph_ms([lambda c=cycles: torch.cuda._sleep(c)], args.reps) if cycles else 0.0
                base = {"shape": name, "rows": rows, "window_us": window, "window_measured_us": 1e3 * sleep}
                out.append({**base, "mb": 0, "form": "none", "us": 1e3 * alone})
                print(f"{name:24s} rows {rows:2d} window {window:4.1f} us ({1e3 * sleep:5.1f})  no prefetch "
                      f"{1e3 * alone:7.1f} us", flush=True)
                for mb in args.mb:
                    for f in forms:
                        ms = graph_ms([call(w, x, cycles, int(mb * MB), FORMS[f], side) for w in copies], args.reps)
                        ideal = min(mb * MB, copies[0].nbytes) / bw * 1e6
                        out.append({**base, "mb": mb, "form": f, "us": 1e3 * ms, "saved_us": 1e3 * (alone - ms),
                                    "ideal_us": ideal})
                        print(f"{'':24s} {'':7s} {'':21s}  {mb:4.0f} MB {f:9s} {1e3 * ms:7.1f} us  saved "
                              f"{1e3 * (alone - ms):6.2f} of {ideal:5.2f}", flush=True)
        del copies
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="prefetch.json")
    ap.add_argument("--shapes", default="", help="comma list of tools.quant_products.SHAPES' names (default: all)")
    ap.add_argument("--rows", type=lambda s: [int(v) for v in s.split(",")], default=[1, 8])
    ap.add_argument("--windows", type=lambda s: [float(v) for v in s.split(",")], default=[3, 10, 25],
                    help="µs the memory idles before each product")
    ap.add_argument("--mb", type=lambda s: [float(v) for v in s.split(",")], default=[8, 16, 32])
    ap.add_argument("--forms", default="bulk,lines", help=f"comma list of {', '.join(FORMS)}, or all")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    t0 = time.time()
    bw = copy_bandwidth(torch.device("cuda"))
    rows = sweep(args, bw)
    result = {"device": torch.cuda.get_device_name(), "copy_tb_s": bw / 1e12, "rows": rows,
              "total_s": time.time() - t0}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"copy {bw / 1e12:.2f} TB/s; done in {time.time() - t0:.0f} s -> {args.out}")


if __name__ == "__main__":
    main()
