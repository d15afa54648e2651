"""Quantized weights on one GPU, in one run: the 4-bit GEMV against its floor and against bf16 and fp8 products, a
Qwen3.5-27B-shape decode step with int4, fp8 and bf16 weights, and the built-in model's quality with each.

1. Copy bandwidth (tools.bench_round.copy_bandwidth): the floors below are bytes over it.
2. Products at the 27B shapes for 1, 8, 16 and 64 rows, each a CUDA graph of calls cycling over enough copies of the
   weight that none is still in L2: the int4 kernels, numba on CUDA cores ("int4", ignis.kernels.int4_gemv), Triton
   on tensor cores ("int4 triton", ignis.kernels.int4_triton, its table's choice) and CUDA C++ with the weight as the
   tensor cores' 16-row operand ("int4 mma", ignis.kernels.int4_mma, its codes repacked), bf16 F.linear, fp8
   (ignis.quant.fp8.fp8_linear: the Triton kernel up to 64 rows, torch._scaled_mm beyond) and, at 64 rows, the int4
   reference (dequantize + F.linear). "x floor" is ms over the form's own bytes (weight, scales, zero points, x and y) at the copy bandwidth.
   Then the numba kernel's alternative shapes of work (ignis.kernels.int4_gemv.Tuning) at three of the shapes, and
   with --sweep-triton the Triton kernel's launch shapes (ignis.kernels.int4_triton.Config) at the same three shapes
   for 1, 8 and 64 rows: the table (int4_triton.TABLE) is what this sweep picks. With --policies, whole launch
   policies of the Triton kernel (its 16-row tile and the split's target) over all five products at 1 and 8 rows,
   summed as a decode step runs them; the best stays in force for the decode step below.
3. A decode step of one lane at a 512-token context (random weights built on the GPU, as tools.bench_round does)
   through DeviceRound with CUDA graphs, bf16 then the same weights packed to int4 (group 128, products through the
   kernel --int4-kernel names), then with the output head packed too (`ignis quantize --head`), then converted to
   fp8; speed-ups are bf16 ms over int4 or fp8 ms, floors are each model's weight bytes plus the lane's state and K/V.
4. The built-in model in bf16 on the GPU, as shipped, int4 (group 128; and with its head, `--head`) and fp8:
   perplexity, greedy agreement and logit error against bf16 (tools.quant_quality.compare) over held-out prompts, and
   dflash2 tokens a round (ignis.acceptance.measure, 7 drafts, greedy, eager rounds) with each target.

    python -m tools.bench_quant --out quant.json
    python -m tools.bench_quant --out sweep.json --skip tunings,decode,quality --sweep-triton
    python -m tools.bench_quant --out policies.json --skip products,tunings,quality --policies --int4-kernel triton
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ignis.artifact import BUILTIN
from ignis.kernels.int4_gemv import Tuning, int4_gemv, kernel, row_tile
from ignis.kernels.int4_mma import int4_mma, pack
from ignis.kernels.int4_triton import Config, check, choose, int4_triton
from ignis.model.model import HybridModel
from ignis.quant.format import dequantize, quantize, quantized_name
from ignis.quant.fp8 import Fp8Linear, Fp8Weight, fp8_linear, quantize_fp8, to_fp8
from ignis.quant.linear import QuantLinear, set_kernel, to_mma, uses_mma
from tools.bench_round import POSITION, QWEN35_27B, build_backend, copy_bandwidth, decodes, floor_bytes, time_rounds

C = QWEN35_27B
GDN_Z = C["linear_num_value_heads"] * C["linear_value_head_dim"]
GDN_QKV = 2 * C["linear_num_key_heads"] * C["linear_key_head_dim"] + GDN_Z
ATTN_QKV = (2 * C["num_attention_heads"] + 2 * C["num_key_value_heads"]) * C["head_dim"]
H, I = C["hidden_size"], C["intermediate_size"]
# (name, out, in): the products of a 27B decode step (the GDN qkv and z run as two packed products in a quantized
# model; their sum is the fused bf16 in_proj's size less the two 48-row gates).
SHAPES = [("mlp gate_up", 2 * I, H), ("mlp down", H, I), ("gdn in_proj qkv+z", GDN_QKV + GDN_Z, H),
          ("attn qkv", ATTN_QKV, H), ("o_proj / gdn out_proj", H, C["num_attention_heads"] * C["head_dim"])]
ROWS = (1, 8, 16, 64)
FLUSH = 256 * 2**20  # bytes of weight copies a timed graph cycles over (the H200's L2 is 50 MB)
GROUP = 128


def graph_ms(calls: list[Callable[[], object]], reps: int) -> float:
    """ms per call of `calls` (each on its own weight copy), replayed as one CUDA graph of at least 32 calls."""
    for c in calls:
        c()  # compile, load, pick algorithms
    torch.cuda.synchronize()
    seq = calls * math.ceil(32 / len(calls))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in seq:
            c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in seq:
            c()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / len(seq))
    del graph
    return statistics.median(times)


def _int4_reference(x: torch.Tensor, qw: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    return F.linear(x, dequantize(qw, s, z, x.dtype))


def _copies(nbytes: int, make: Callable[[], Any]) -> list[Any]:
    return [make() for _ in range(max(1, min(16, FLUSH // nbytes)))]


def _int4_copies(nout: int, ncols: int, dev: torch.device) -> tuple[int, list[tuple[torch.Tensor, ...]]]:
    """A random [nout, ncols] weight packed to int4 (bf16 scales): its bytes, and enough copies of (qweight, scales,
    qzeros) that a graph cycling over them reads none from L2."""
    qw, s, z = quantize(torch.randn(nout, ncols, device=dev) * 0.02, GROUP)
    s = s.bfloat16()
    n4 = qw.nbytes + s.nbytes + z.nbytes
    return n4, _copies(n4, lambda: (qw.clone(), s.clone(), z.clone()))


def products(bw: float, reps: int) -> list[dict[str, Any]]:
    rows_out = []
    dev = torch.device("cuda")
    for name, nout, ncols in SHAPES:
        w = torch.randn(nout, ncols, device=dev) * 0.02
        qw, s, z = quantize(w, GROUP)
        s = s.bfloat16()
        f8 = quantize_fp8(w)
        wb = w.bfloat16()
        del w
        n4, nb, n8 = qw.nbytes + s.nbytes + z.nbytes, wb.nbytes, f8.weight.nbytes + f8.scale.nbytes
        c4 = _copies(n4, lambda: (qw.clone(), s.clone(), z.clone()))
        cb = _copies(nb, wb.clone)
        c8 = _copies(n8, lambda: Fp8Weight(f8.weight.clone(), f8.scale.clone()))
        cm = [pack(*p, torch.bfloat16) for p in c4]
        nm = cm[0].codes.nbytes + cm[0].zs.nbytes
        for r in ROWS:
            x = torch.randn(r, ncols, device=dev).bfloat16()
            forms: dict[str, tuple[int, list[Callable[[], object]]]] = {
                "int4": (n4, [partial(int4_gemv, x, *p) for p in c4]),
                "int4 triton": (n4, [partial(int4_triton, x, *p) for p in c4]),
                "int4 mma": (nm, [partial(int4_mma, x, p) for p in cm]),
                "bf16": (nb, [partial(F.linear, x, p) for p in cb]),
                "fp8": (n8, [partial(fp8_linear, x, p) for p in c8]),
            }
            if r == ROWS[-1]:  # where the kernel meets prefill-sized inputs: what packed_linear does above 64 rows
                forms["int4 reference"] = (n4, [partial(_int4_reference, x, *p) for p in c4])
            io = 2 * r * (ncols + nout)
            for form, (nbytes, calls) in forms.items():
                ms = graph_ms(calls, reps)
                floor = (nbytes + io) / bw * 1e3
                rows_out.append({"shape": name, "out": nout, "in": ncols, "rows": r, "form": form, "ms": ms,
                                 "floor_ms": floor, "x_floor": ms / floor})
                print(f"{name:22s} {nout:6d}x{ncols:<6d} rows {r:3d}  {form:15s} {1e3 * ms:8.1f} us  "
                      f"floor {1e3 * floor:7.1f} us  x{ms / floor:5.2f}", flush=True)
        del c4, cb, c8, cm
        torch.cuda.empty_cache()
    return rows_out


TUNINGS = [Tuning(4, 4, 8), Tuning(2, 4, 8), Tuning(8, 4, 8), Tuning(4, 8, 4), Tuning(4, 2, 16), Tuning(4, 4, 16)]


def kernel_info(t: Tuning, rt: int) -> dict[str, Any]:
    """Registers and local memory a thread of the compiled bf16 kernel uses (spills show as local memory)."""
    disp = kernel("bf16", "bf16", rt, t.ot, t.warps)
    try:
        return {"regs": disp.get_regs_per_thread(), "local_bytes": disp.get_local_mem_per_thread()}
    except (AttributeError, KeyError, TypeError) as e:  # a numba-cuda without these queries: say so, keep timing
        return {"info_error": repr(e)}


def tunings(bw: float, reps: int) -> list[dict[str, Any]]:
    """The int4 kernel's shapes of work (output rows a warp, warps a block, blocks a SM aimed at) at the largest and
    the smallest products, 1 and 8 rows; the first is the default (ignis.kernels.int4_gemv.TUNING)."""
    rows_out = []
    dev = torch.device("cuda")
    for name, nout, ncols in (SHAPES[0], SHAPES[1], SHAPES[4]):
        n4, c4 = _int4_copies(nout, ncols, dev)
        for r in (1, 8):
            x = torch.randn(r, ncols, device=dev).bfloat16()
            floor = (n4 + 2 * r * (ncols + nout)) / bw * 1e3
            for t in TUNINGS:
                ms = graph_ms([partial(int4_gemv, x, p[0], p[1], p[2], tuning=t) for p in c4], reps)
                info = kernel_info(t, row_tile(r))
                rows_out.append({"shape": name, "rows": r, "ot": t.ot, "warps": t.warps,
                                 "blocks_per_sm": t.blocks_per_sm, "ms": ms, "x_floor": ms / floor, **info})
                print(f"tuning {name:22s} rows {r}  ot {t.ot} warps {t.warps} blocks/SM {t.blocks_per_sm:2d}  "
                      f"{1e3 * ms:8.1f} us  x{ms / floor:5.2f}  {info}", flush=True)
        del c4
        torch.cuda.empty_cache()
    return rows_out


def triton_configs(rows: int, nout: int, ncols: int, group: int, sms: int) -> list[Config]:
    """The table's choice first, then one knob at a time around it (and larger tiles with a split that keeps the
    programs' count): what --sweep-triton times."""
    base = choose(rows, nout, ncols, group, sms)
    found = [base]
    split2 = 2 * base.split_k
    variants: list[dict[str, int]] = [{"block_n": 64}, {"block_n": 256}, {"warps": 8}, {"warps": 2}]
    variants += [{"stages": n} for n in (2, 3, 4, 5)] + [{"split_k": n} for n in (1, 2, 4, 8, 16)]
    variants += [{"block_k": base.block_k // 2}, {"block_n": 256, "split_k": split2},
                 {"block_n": 256, "warps": 8, "split_k": split2}, {"block_n": 64, "warps": 2}]
    for v in variants:
        c = replace(base, **v)
        try:
            check(c, ncols, group)
        except ValueError:
            continue
        if c not in found:
            found.append(c)
    return found


def sweep_triton(bw: float, reps: int) -> list[dict[str, Any]]:
    """The Triton kernel's launch shapes at the largest and the smallest products, 1, 8 and 64 rows: us and x floor
    a config (a config that does not compile or launch is reported, not fatal)."""
    rows_out = []
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for name, nout, ncols in (SHAPES[0], SHAPES[1], SHAPES[4]):
        n4, c4 = _int4_copies(nout, ncols, dev)
        for r in (1, 8, 64):
            x = torch.randn(r, ncols, device=dev).bfloat16()
            floor = (n4 + 2 * r * (ncols + nout)) / bw * 1e3
            for i, c in enumerate(triton_configs(r, nout, ncols, GROUP, sms)):
                row: dict[str, Any] = {"shape": name, "rows": r, "table": i == 0, **asdict(c)}
                try:
                    ms = graph_ms([partial(int4_triton, x, p[0], p[1], p[2], config=c) for p in c4], reps)
                    row.update(ms=ms, x_floor=ms / floor)
                    said = f"{1e3 * ms:8.1f} us  x{ms / floor:5.2f}"
                except Exception as e:  # noqa: BLE001 - out of shared memory or registers: say so, keep sweeping
                    row["error"] = repr(e)[:300]
                    said = f"failed: {row['error'][:100]}"
                rows_out.append(row)
                print(f"triton {name:22s} rows {r:2d}  {'table' if i == 0 else '     '} bm {c.block_m:2d} bn "
                      f"{c.block_n:3d} bk {c.block_k:3d} split {c.split_k:2d} warps {c.warps} stages {c.stages}  "
                      f"{said}", flush=True)
        del c4
        torch.cuda.empty_cache()
    return rows_out


# Launch policies of the Triton int4 kernel: (block_n, warps, stages) of the 16-row tile, and the split's target of
# programs per SM. The first is the table's. ncu at 52056dc: the table's gate_up product at one row ran 272 programs
# of 155 registers (0.69 waves, 2 warps a scheduler, 0.42 instructions a cycle, 35% of DRAM bandwidth), so the
# candidates trade tile width and registers for programs in flight.
POLICIES = [(128, 4, 4, 2), (128, 4, 4, 4), (128, 4, 3, 4), (128, 8, 4, 4), (64, 4, 4, 2), (64, 4, 4, 4),
            (64, 4, 4, 6), (64, 4, 3, 4), (64, 2, 4, 4), (32, 2, 4, 4), (32, 2, 4, 8)]
# how many times a 27B decode step runs each of SHAPES (48 GDN and 16 attention layers, each with an MLP)
STEP_COUNTS = {"mlp gate_up": 64, "mlp down": 64, "gdn in_proj qkv+z": 48, "attn qkv": 16, "o_proj / gdn out_proj": 64}


def policies(bw: float, reps: int) -> dict[str, Any]:
    """Each of POLICIES over the five 27B products at 1 and 8 rows: us a product, and a decode step's products (each
    shape times its count in the step) at 1 and at 8 rows. The best (least sum of the two) stays in force for the
    rest of the run (the decode step), and is reported; ties keep the earlier policy."""
    from ignis.kernels import int4_triton as it

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    weights = {}
    for name, nout, ncols in SHAPES:
        weights[name] = (*_int4_copies(nout, ncols, dev), nout, ncols)
    rows_out, sums = [], []
    for pol in POLICIES:
        bn, warps, stages, pps = pol
        it.tune({16: (bn, warps, stages), 32: (bn, warps, stages)}, pps)
        total = {1: 0.0, 8: 0.0}
        for name, (n4, c4, nout, ncols) in weights.items():
            for r in (1, 8):
                x = torch.randn(r, ncols, device=dev).bfloat16()
                ms = graph_ms([partial(int4_triton, x, *p) for p in c4], reps)
                floor = (n4 + 2 * r * (ncols + nout)) / bw * 1e3
                cfg = it.choose(r, nout, ncols, GROUP, sms)
                rows_out.append({"policy": pol, "shape": name, "rows": r, "split_k": cfg.split_k, "ms": ms,
                                 "x_floor": ms / floor})
                total[r] += STEP_COUNTS[name] * ms
                print(f"policy {pol}  {name:22s} rows {r}  split {cfg.split_k:2d}  {1e3 * ms:7.1f} us  "
                      f"x{ms / floor:5.2f}", flush=True)
        sums.append({"policy": pol, "step_ms_1": total[1], "step_ms_8": total[8]})
        print(f"policy {pol}: a decode step's int4 products {total[1]:.3f} ms at 1 row, {total[8]:.3f} at 8",
              flush=True)
    best = min(sums, key=lambda e: e["step_ms_1"] + e["step_ms_8"])
    bn, warps, stages, pps = best["policy"]
    it.tune({16: (bn, warps, stages), 32: (bn, warps, stages)}, pps)
    print(f"best policy {best['policy']} (block_n, warps, stages, programs a SM), in force from here", flush=True)
    del weights
    torch.cuda.empty_cache()
    return {"rows": rows_out, "sums": sums, "best": best}


def layouts(bw: float, reps: int) -> list[dict[str, Any]]:
    """The Triton kernel at its table's launch over the five 27B products at 1 and 8 rows, its codes row-major (the
    format's layout) and k-blocked (int4_triton.k_blocked: a K step's rows contiguous): us and x floor each."""
    from ignis.kernels.int4_triton import choose, k_blocked

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows_out = []
    for name, nout, ncols in SHAPES:
        bk = choose(1, nout, ncols, GROUP, sms).block_k
        n4, row_major = _int4_copies(nout, ncols, dev)
        forms = {"row-major": row_major, "k-blocked": [(k_blocked(qw, bk), s, z) for qw, s, z in row_major]}
        for r in (1, 8):
            x = torch.randn(r, ncols, device=dev).bfloat16()
            floor = (n4 + 2 * r * (ncols + nout)) / bw * 1e3
            for form, c4 in forms.items():
                ms = graph_ms([partial(int4_triton, x, *p) for p in c4], reps)
                rows_out.append({"shape": name, "rows": r, "layout": form, "ms": ms, "x_floor": ms / floor})
                print(f"layout {form:9s} {name:22s} rows {r}  {1e3 * ms:7.1f} us  x{ms / floor:5.2f}", flush=True)
        del forms
        torch.cuda.empty_cache()
    return rows_out


def to_int4(model: nn.Module, group: int, head: bool = False) -> int:
    """Pack every projection `ignis quantize` would pack (with `head`, as `--head` does: the output head too), in place
    on the model's device (scales in the model dtype, as the loader keeps them). Returns how many were packed."""
    done = 0
    for name, m in list(model.named_modules()):
        stored = f"{name}.weight" if name.startswith("mtp.") else f"model.{name}.weight"
        if isinstance(m, nn.Linear) and quantized_name(stored, tuple(m.weight.shape), group, head):
            qw, s, z = quantize(m.weight, group)
            with torch.device("meta"):
                q = QuantLinear(m.in_features, m.out_features, group)
            q.qweight, q.scales, q.qzeros = qw, s.to(m.weight.dtype), z
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, q)
            done += 1
    return done


def fuse_and_own(model: HybridModel) -> None:
    """After a conversion: fuse again (quantized projections join, the old fused bf16 matrices are dropped) and give
    the dense linears left (the GDN gates) their own storage, so the old fused matrices are freed."""
    model.fuse()
    for m in model.modules():
        if isinstance(m, nn.Linear) and m.weight.untyped_storage().nbytes() > m.weight.nbytes:
            m.weight = nn.Parameter(m.weight.detach().clone(), requires_grad=False)
    torch.cuda.empty_cache()


def decode_step(label: str, model: HybridModel, bw: float, context: int, iters: int) -> dict[str, Any]:
    from ignis.engine.device_round import DeviceRound
    from ignis.model.cache import LaneCache

    dev, dtype = torch.device("cuda"), torch.bfloat16
    model.rope.precompute(context + 16, dev, dtype)
    with tempfile.TemporaryDirectory() as tmp:
        backend = build_backend("off", 0, model, Path(tmp), 8, context, dev, dtype)
    cache = LaneCache(model.config, lanes=8, context=context, max_cols=1, device=dev, dtype=dtype)
    dr = DeviceRound(model, cache, backend, dev, sample_drafts=True)
    work = decodes(1, 0)
    eager = time_rounds(dr, work, 3)
    span = next(s for s in dr.spans if s >= POSITION + 1)
    bucket = next(b for b in dr.buckets if b >= 1)
    dr.capture([(bucket, span, False)])
    graph = time_rounds(dr, work, iters)
    # floor_bytes counts parameters; a converted projection's codes and scales are buffers
    packed = sum(b.nbytes for n, m in model.named_modules() if isinstance(m, (QuantLinear, Fp8Linear))
                 and not n.startswith("mtp.") for b in m.buffers())
    floor = (floor_bytes(model, 1, 1) + packed) / bw
    print(f"27B decode step  {label:5s}  graph {1e3 * graph:7.2f} ms  eager {1e3 * eager:7.2f} ms  floor "
          f"{1e3 * floor:6.2f} ms  x{graph / floor:5.2f}", flush=True)
    del dr, cache, backend
    torch.cuda.empty_cache()
    return {"weights": label, "graph_ms": 1e3 * graph, "eager_ms": 1e3 * eager, "floor_ms": 1e3 * floor,
            "x_floor": graph / floor}


def decode_steps(bw: float, context: int, iters: int) -> dict[str, Any]:
    from ignis.model.random import random_model

    dev = torch.device("cuda")
    out: dict[str, Any] = {}
    model = random_model(C, seed=0, mtp=False, device=dev, dtype=torch.bfloat16)
    out["bf16"] = decode_step("bf16", model, bw, context, iters)
    t0 = time.perf_counter()
    packed = to_int4(model, GROUP)
    if uses_mma(dev, torch.bfloat16):  # as the loader holds a quantized model for the mma kernel
        to_mma(model, torch.bfloat16)
    fuse_and_own(model)
    out["int4_packed"], out["int4_convert_s"] = packed, time.perf_counter() - t0
    out["int4"] = decode_step("int4", model, bw, context, iters)
    out["int4_head_packed"] = to_int4(model, GROUP, head=True)  # `ignis quantize --head`: the output head as well
    if uses_mma(dev, torch.bfloat16):
        to_mma(model, torch.bfloat16)
    out["int4_head"] = decode_step("int4 head", model, bw, context, iters)
    del model
    torch.cuda.empty_cache()
    model = random_model(C, seed=0, mtp=False, device=dev, dtype=torch.bfloat16)
    out["fp8_converted"] = to_fp8(model)
    fuse_and_own(model)
    out["fp8"] = decode_step("fp8", model, bw, context, iters)
    del model
    torch.cuda.empty_cache()
    for form in ("int4", "int4_head", "fp8"):
        out[f"speedup_{form}"] = out["bf16"]["graph_ms"] / out[form]["graph_ms"]
    print(f"27B decode step speed-up over bf16: int4 x{out['speedup_int4']:.2f} (output head too "
          f"x{out['speedup_int4_head']:.2f}), fp8 x{out['speedup_fp8']:.2f}")
    return out


def quality(prompts_n: int, tokens: int, accept_n: int, max_tokens: int, device: str = "cuda") -> dict[str, Any]:
    """Built-in model quality with each weight form (bf16 on CUDA; fp32 on the CPU, where fp8 runs its reference)."""
    from ignis.config import load_config

    from ignis.acceptance import measure
    from ignis.engine.core import Engine
    from ignis.model.loader import load_model
    from ignis.params import SamplingParams
    from ignis.quant.convert import convert
    from ignis.tokenizer import Tokenizer
    from tools.quant_quality import compare

    tok = Tokenizer.from_dir(BUILTIN)
    lines = (BUILTIN / "heldout_prompts.jsonl").read_text().splitlines()
    prompts = [tok.encode(json.loads(line)["prompt"]) for line in lines if line.strip()]
    out: dict[str, Any] = {"prompts": prompts_n, "tokens": tokens}
    with tempfile.TemporaryDirectory() as tmp:
        int4, int4_head = Path(tmp) / "int4", Path(tmp) / "int4-head"
        convert(BUILTIN, int4, group=GROUP)
        convert(BUILTIN, int4_head, group=GROUP, head=True)  # its tied head as a packed copy of the embedding
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        ref = load_model(BUILTIN, device=device, dtype=dtype, exact=False)
        forms = {"int4": (int4, False), "int4_head": (int4_head, False), "fp8": (BUILTIN, True)}
        for form, (path, fp8) in forms.items():
            model = load_model(path, device=device, dtype=dtype, exact=False, fp8=fp8)
            out[form] = compare(ref, model, [p[-tokens:] for p in prompts[:prompts_n]])
            del model
        del ref
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        for form, path, weights in (("bf16", BUILTIN, "auto"), ("int4", int4, "auto"), ("int4_head", int4_head, "auto"),
                                    ("fp8", BUILTIN, "fp8")):
            cfg = load_config(overrides={"model.path": str(path), "model.device": device,
                                         "model.dtype": str(dtype).removeprefix("torch."),
                                         "model.weights": weights, "spec.backend": "dflash2", "spec.draft_tokens": 7,
                                         "engine.lanes": 4, "engine.cuda_graphs": False,
                                         "log.level": "warning"})
            engine = Engine(cfg)
            tally, _ = measure(engine, prompts[:accept_n], params, "code")
            out.setdefault("dflash2_tokens_per_round", {})[form] = tally.tokens_per_round
            out.setdefault("dflash2", {})[form] = tally.as_dict()
            del engine
            if device == "cuda":
                torch.cuda.empty_cache()
    print("built-in quality:",
          json.dumps({k: out[k] for k in ("int4", "int4_head", "fp8", "dflash2_tokens_per_round")}))
    return out


def summary(result: dict[str, Any]) -> list[str]:
    """The lines the issue's done-when asks for."""
    lines = []
    prods = result.get("products", [])
    for r in ROWS:
        at = {(p["shape"], p["form"]): p for p in prods if p["rows"] == r}
        if not at:
            continue
        worst = max(p["x_floor"] for (_, form), p in at.items() if form == "int4")
        vs = [at[sh, "bf16"]["ms"] / at[sh, "int4"]["ms"] for sh, form in at if form == "int4"]
        vs8 = [at[sh, "bf16"]["ms"] / at[sh, "fp8"]["ms"] for sh, form in at if form == "fp8"]
        lines.append(f"int4 GEMV, {r:2d} rows: worst x{worst:.2f} of its floor; bf16 time / int4 time "
                     f"{min(vs):.2f}..{max(vs):.2f}; bf16 / fp8 {min(vs8):.2f}..{max(vs8):.2f}")
        mma = [p for (_, form), p in at.items() if form == "int4 mma"]
        if mma:
            vm = [at[sh, "bf16"]["ms"] / at[sh, "int4 mma"]["ms"] for sh, form in at if form == "int4 mma"]
            lines.append(f"int4 mma, {r:2d} rows: x{min(p['x_floor'] for p in mma):.2f}..x"
                         f"{max(p['x_floor'] for p in mma):.2f} of its floor; bf16 time / mma time "
                         f"{min(vm):.2f}..{max(vm):.2f}")
        tri = [p for (_, form), p in at.items() if form == "int4 triton"]
        if tri:
            vt = [at[sh, "int4"]["ms"] / at[sh, "int4 triton"]["ms"] for sh, form in at if form == "int4 triton"]
            lines.append(f"int4 Triton, {r:2d} rows: worst x{max(p['x_floor'] for p in tri):.2f} of its floor; numba "
                         f"time / Triton time {min(vt):.2f}..{max(vt):.2f}")
    best: dict[tuple[str, int], dict[str, Any]] = {}
    for p in result.get("sweep_triton", []):
        key = (p["shape"], p["rows"])
        if "ms" in p and (key not in best or p["ms"] < best[key]["ms"]):
            best[key] = p
    for (shape, r), p in best.items():
        table = next(q for q in result["sweep_triton"] if q["shape"] == shape and q["rows"] == r and q["table"])
        lines.append(f"Triton sweep, {shape}, {r:2d} rows: best x{p['x_floor']:.2f} (bm {p['block_m']} bn "
                     f"{p['block_n']} bk {p['block_k']} split {p['split_k']} warps {p['warps']} stages {p['stages']}), "
                     f"the table's x{table.get('x_floor', float('nan')):.2f}")
    pol = result.get("policies")
    if pol:
        b, table = pol["best"], pol["sums"][0]
        lines.append(f"Triton policies: best {tuple(b['policy'])} (block_n, warps, stages, programs a SM): a decode "
                     f"step's int4 products {b['step_ms_1']:.3f} ms at 1 row and {b['step_ms_8']:.3f} at 8; the "
                     f"table's {tuple(table['policy'])} {table['step_ms_1']:.3f} and {table['step_ms_8']:.3f}")
    dec = result.get("decode")
    if dec:
        lines.append(f"27B decode step, 1 lane, graphs: bf16 {dec['bf16']['graph_ms']:.2f} ms, int4 "
                     f"{dec['int4']['graph_ms']:.2f} ms (x{dec['speedup_int4']:.2f}), int4 with the output head "
                     f"{dec['int4_head']['graph_ms']:.2f} ms (x{dec['speedup_int4_head']:.2f}), fp8 "
                     f"{dec['fp8']['graph_ms']:.2f} ms (x{dec['speedup_fp8']:.2f})")
    q = result.get("quality")
    if q:
        lines.append(f"built-in perplexity: bf16 {q['int4']['ppl_reference']:.3f}, int4 "
                     f"{q['int4']['ppl_quantized']:.3f}, int4 with the head {q['int4_head']['ppl_quantized']:.3f}, "
                     f"fp8 {q['fp8']['ppl_quantized']:.3f}; dflash2 tokens a round: "
                     + ", ".join(f"{k} {v:.2f}" for k, v in q["dflash2_tokens_per_round"].items()))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench_quant", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file for every number")
    ap.add_argument("--reps", type=int, default=10, help="graph replays a product (median)")
    ap.add_argument("--iters", type=int, default=30, help="timed decode rounds a form (median)")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts for perplexity")
    ap.add_argument("--tokens", type=int, default=256, help="last tokens of each for perplexity")
    ap.add_argument("--accept-prompts", type=int, default=8, help="held-out prompts decoded with dflash2")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--skip", default="", help="comma list of products, tunings, decode, quality")
    ap.add_argument("--sweep-triton", action="store_true",
                    help="time the Triton int4 kernel's launch shapes at three 27B shapes, 1, 8 and 64 rows")
    ap.add_argument("--layouts", action="store_true",
                    help="time the Triton int4 kernel on row-major and k-blocked codes at the five 27B products")
    ap.add_argument("--policies", action="store_true",
                    help="time the Triton int4 kernel's launch policies over a decode step's products and keep the "
                         "best for the decode step")
    ap.add_argument("--int4-kernel", default="auto", choices=["auto", "mma", "numba", "triton"],
                    help="the kernel int4 products run with in the decode step and the quality runs")
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    if not args.sweep_triton:
        skip.add("sweep_triton")
    if not args.policies:
        skip.add("policies")
    if not args.layouts:
        skip.add("layouts")
    set_kernel(args.int4_kernel)
    t0 = time.perf_counter()
    bw = copy_bandwidth(torch.device("cuda"))
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s on {torch.cuda.get_device_name()}", flush=True)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "copy_tb_s": bw / 1e12, "group": GROUP, "int4_kernel": args.int4_kernel}
    out = Path(args.out)
    steps = [("products", lambda: products(bw, args.reps)), ("tunings", lambda: tunings(bw, args.reps)),
             ("sweep_triton", lambda: sweep_triton(bw, args.reps)), ("policies", lambda: policies(bw, args.reps)),
             ("layouts", lambda: layouts(bw, args.reps)),
             ("decode", lambda: decode_steps(bw, args.context, args.iters)),
             ("quality", lambda: quality(args.prompts, args.tokens, args.accept_prompts, args.max_tokens))]
    for name, step in steps:
        if name in skip:
            continue
        t = time.perf_counter()
        result[name] = step()
        result[f"{name}_s"] = time.perf_counter() - t
        out.write_text(json.dumps(result, indent=1))  # what is done so far survives a later failure
    result["total_s"] = time.perf_counter() - t0
    result["summary"] = summary(result)
    out.write_text(json.dumps(result, indent=1))
    print("\n".join(result["summary"]))
    print(f"done in {result['total_s']:.0f} s -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
