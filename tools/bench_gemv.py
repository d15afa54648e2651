"""The Triton weight-streaming product (ignis.kernels.gemv_triton) against cuBLAS at a decode's and a verify's rows,
its launch shapes swept, in one run on one GPU.

For each product of a Qwen3.5-27B decode step (the SHAPES of tools.bench_quant, plus the output head) and 1, 8 and
64 rows: bf16 `F.linear` (cuBLAS; again with torch's preferred BLAS library set to cuBLASLt, and through TunableOp,
which times the algorithms torch can call for the shape and keeps the fastest), then the Triton kernel on the same bf16 weight (`dense_gemv`) and on its fp8
codes (`fp8_gemv`), each at `choose`'s launch and at the variants of `plan` around it (tile width, step, warps,
stages, the split's target of programs a SM; above 16 rows, row tiles of 32 and 64 too). Every figure is a CUDA graph of calls cycling over enough weight
copies that none is read from L2 (tools.quant_products.graph_ms), in µs and over the form's own bytes at the copy
bandwidth measured in the same run. The summary names, per product and row count, the fastest launch of each form
and its ratio to cuBLAS: where the dense kernel beats cuBLAS, and which launch the fp8 kernel should take.

    python -m tools.bench_gemv --out gemv.json
    python -m tools.bench_gemv --out gemv.json --shapes "mlp down,o_proj / gdn out_proj" --rows 1,8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ignis.kernels.gemv_triton import Config, dense_gemv, fits, fp8_gemv, plan
from ignis.model.ops import blas_library
from ignis.quant.fp8 import quantize_fp8
from tools.quant_products import C, SHAPES, floor_ms, graph_ms, weight_copies
from tools.round_timing import copy_bandwidth

# the 27B's products, its output head, and a quantized Gated DeltaNet's gates b | a (dense beside 4-bit projections)
PRODUCTS = [*SHAPES, ("output head", C["vocab_size"], C["hidden_size"]),
            ("gdn gates b | a", 2 * C["linear_num_value_heads"], C["hidden_size"])]
# (block_n, block_k, programs a SM, warps, stages) around the default launch (64, 128, 4, 4, 4), one knob at a time
VARIANTS = [(32, 128, 4, 4, 4), (128, 128, 4, 8, 4), (64, 256, 4, 4, 4), (64, 256, 4, 8, 3), (64, 128, 2, 4, 4),
            (64, 128, 8, 4, 4), (64, 128, 4, 8, 4), (64, 128, 4, 4, 6)]
# Narrow tiles for a weight of at most NARROW_OUT output rows, which the default's 64-row tiles spread over few
# programs (the gates' 96 rows: 20); (block_n, block_k, programs a SM, warps, stages)
NARROW_OUT = 256
NARROW = [(16, 64, 4, 4, 3), (16, 64, 4, 2, 3), (16, 128, 4, 4, 4), (16, 128, 4, 2, 3), (32, 64, 4, 4, 3),
          (32, 128, 4, 4, 4), (16, 256, 4, 4, 2)]
# Wider row tiles for calls of more than 16 rows (a verify's 64: 16-row tiles read each weight tile four times), with
# the default launch's knobs and a few around them; (block_m, block_n, block_k, programs a SM, warps, stages)
WIDE = [(32, 64, 128, 4, 4, 4), (64, 64, 128, 4, 4, 4), (64, 128, 128, 4, 8, 4), (64, 64, 128, 2, 4, 4),
        (64, 64, 64, 4, 4, 4), (64, 128, 64, 4, 8, 3), (64, 64, 128, 1, 4, 4)]


def launches(nout: int, ncols: int, sms: int, rows: int) -> list[Config]:
    """The default launch first, then each variant that fits the shape and the rows (duplicates dropped)."""
    found = [plan(nout, ncols, sms)]
    narrow = NARROW if nout <= NARROW_OUT else []
    knobs = [(16, *v) for v in VARIANTS + narrow] + [w for w in WIDE if w[0] < 2 * rows]
    for bm, bn, bk, pps, warps, stages in knobs:
        if ncols % bk:
            continue
        c = plan(nout, ncols, sms, block_n=bn, block_k=bk, programs_per_sm=pps, warps=warps, stages=stages,
                 block_m=bm)
        if c not in found:
            found.append(c)
    return found


@contextmanager
def blas(form: str) -> Iterator[None]:
    """The BLAS setting a form is timed under: cuBLASLt preferred, TunableOp tuning each new shape, or torch's default."""
    if form == "bf16 cublaslt":
        with blas_library("cublaslt"):
            yield
    elif form == "bf16 tunableop":
        tunable = torch.cuda.tunable
        if hasattr(tunable, "write_file_on_exit"):  # gone from newer torch, which writes only when asked
            tunable.write_file_on_exit(False)
        tunable.enable(True)
        tunable.tuning_enable(True)
        try:
            yield
        finally:
            tunable.tuning_enable(False)
            tunable.enable(False)
    else:
        yield


def time_form(calls: list[Callable[[], object]], reps: int) -> dict[str, Any]:
    """ms of one call, or the error of a launch that does not compile or run (out of shared memory, say)."""
    try:
        return {"ms": graph_ms(calls, reps)}
    except Exception as e:  # noqa: BLE001 - a launch the device cannot run is a result of the sweep, not its end
        torch.cuda.synchronize()
        return {"error": repr(e)[:300]}


def sweep(bw: float, reps: int, names: list[str], row_counts: list[int]) -> list[dict[str, Any]]:
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    out: list[dict[str, Any]] = []
    for name, nout, ncols in (p for p in PRODUCTS if p[0] in names):
        if not fits(nout, ncols):
            continue
        w = torch.randn(nout, ncols, device=dev) * 0.02
        f8 = quantize_fp8(w)
        wb = w.bfloat16()
        del w
        nb, n8 = wb.nbytes, f8.weight.nbytes + f8.scale.nbytes
        cb = weight_copies(nb, wb.clone)
        c8 = weight_copies(n8, lambda: (f8.weight.clone(), f8.scale.clone()))
        for r in row_counts:
            x = torch.randn(r, ncols, device=dev).bfloat16()
            forms: list[tuple[str, int, Config | None, list[Callable[[], object]]]] = [
                (form, nb, None, [partial(F.linear, x, p) for p in cb])
                for form in ("bf16 cublas", "bf16 cublaslt", "bf16 tunableop")]
            configs = launches(nout, ncols, sms, r)
            for cfg in configs:
                forms.append(("bf16 triton", nb, cfg, [partial(dense_gemv, x, p, cfg) for p in cb]))
                forms.append(("fp8 triton", n8, cfg, [partial(fp8_gemv, x, q, s, cfg) for q, s in c8]))
            for form, nbytes, cfg, calls in forms:
                floor = floor_ms(nbytes, r, nout, ncols, bw)
                row: dict[str, Any] = {"product": name, "out": nout, "in": ncols, "rows": r, "form": form,
                                       "floor_ms": floor, "config": asdict(cfg) if cfg else None,
                                       "default": cfg == configs[0] if cfg else None}
                with blas(form):
                    row.update(time_form(calls, reps))
                if "ms" in row:
                    row["x_floor"] = row["ms"] / floor
                out.append(row)
                said = (f"{1e3 * row['ms']:8.1f} us  x{row['x_floor']:5.2f}" if "ms" in row
                        else f"failed: {row['error'][:80]}")
                print(f"{name:22s} rows {r:2d}  {form:14s} {str(asdict(cfg) if cfg else ''):80s} {said}", flush=True)
        del cb, c8
        torch.cuda.empty_cache()
    return out


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """Per product and row count: cuBLAS, and the fastest launch of each Triton form with its ratio to cuBLAS."""
    lines = []
    keys = dict.fromkeys((r["product"], r["rows"]) for r in rows)
    for product, nrows in keys:
        mine = [r for r in rows if r["product"] == product and r["rows"] == nrows and "ms" in r]
        cublas = next((r for r in mine if r["form"] == "bf16 cublas"), None)
        if cublas is None:
            continue
        said = [f"{product} rows {nrows}: cuBLAS {1e3 * cublas['ms']:.1f} us (x{cublas['x_floor']:.2f})"]
        for form in ("bf16 cublaslt", "bf16 tunableop", "bf16 triton", "fp8 triton"):
            runs = [r for r in mine if r["form"] == form]
            if not runs:
                continue
            best = min(runs, key=lambda r: r["ms"])
            default = next((r for r in runs if r["default"]), None)
            speed = cublas["ms"] / best["ms"]
            said.append(f"{form} best {1e3 * best['ms']:.1f} us (x{best['x_floor']:.2f}, {speed:.2f}x cuBLAS's speed) "
                        f"at {best['config']}"
                        + (f", default {1e3 * default['ms']:.1f} us" if default else ""))
        lines.append("; ".join(said))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench_gemv", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file for every number")
    ap.add_argument("--reps", type=int, default=10, help="graph replays a form (median)")
    ap.add_argument("--shapes", default=",".join(p[0] for p in PRODUCTS), help="comma list of product names")
    ap.add_argument("--rows", default="1,8,64", help="comma list of activation row counts")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.shapes.split(",")]
    unknown = set(names) - {p[0] for p in PRODUCTS}
    if unknown:
        ap.error(f"--shapes: unknown products {sorted(unknown)}; known: {[p[0] for p in PRODUCTS]}")
    t0 = time.perf_counter()
    bw = copy_bandwidth(torch.device("cuda"))
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s on {torch.cuda.get_device_name()}", flush=True)
    rows = sweep(bw, args.reps, names, [int(r) for r in args.rows.split(",")])
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "copy_tb_s": bw / 1e12, "rows": rows, "summary": summary(rows),
                              "total_s": time.perf_counter() - t0}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("\n".join(result["summary"]))
    print(f"done in {result['total_s']:.0f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
