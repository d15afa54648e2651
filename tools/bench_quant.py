"""Quantized weights on one GPU, in one run: the 4-bit GEMV against its floor and against bf16 and fp8 products, a
Qwen3.5-27B-shape decode step with int4, fp8 and bf16 weights, and the built-in model's quality with each.

1. Copy bandwidth (tools.round_timing.copy_bandwidth): the floors below are bytes over it.
2. Products at the 27B shapes for 1, 8, 16 and 64 rows, each a CUDA graph of calls cycling over enough copies of the
   weight that none is still in L2: the int4 kernels, numba on CUDA cores ("int4", ignis.kernels.int4_gemv), Triton
   on tensor cores ("int4 triton", ignis.kernels.int4_triton, its table's choice) and CUDA C++ with the weight as the
   tensor cores' 16-row operand ("int4 mma", ignis.kernels.int4_mma, its codes repacked), bf16 F.linear, fp8
   (ignis.quant.fp8.fp8_linear: the Triton kernel up to 64 rows, torch._scaled_mm beyond) and, at 64 rows, the int4
   reference (dequantize + F.linear). "x floor" is ms over the form's own bytes (weight, scales, zero points, x and y)
   at the copy bandwidth (tools.quant_products runs these and the sweeps below). Then the numba kernel's alternative
   shapes of work (ignis.kernels.int4_gemv.Tuning) at three of the shapes, and with --sweep-triton the Triton
   kernel's launch shapes (ignis.kernels.int4_triton.Config) at the same three shapes for 1, 8 and 64 rows: the table
   (int4_triton.TABLE) is what this sweep picks. With --policies, whole launch
   policies of the Triton kernel (its 16-row tile and the split's target) over all five products at 1 and 8 rows,
   summed as a decode step runs them; the best stays in force for the decode step below. With --sweep-mma, the mma
   kernel's splits of the input (blocks of threads and warps along it) at all five products, 1 and 8 rows; with
   --sweep-mma-loads, its step sizes and steps loaded ahead (which change no sums) at 1, 8, 16 and 64 rows; with
   --window as well, each of these sweeps' launches also windowed (its codes from L2, as --sweep-hot's). With
   --sweep-hot, the mma kernel at 1 to 64 rows with its weight read from DRAM, from one copy (L2 where it fits) and,
   to 16 rows, windowed (every block reading a few blocks' codes, which L2 holds: the launch without DRAM's wait);
   its summary also weighs the five products as a decode step runs them (quant_products.STEP_COUNTS).
   --tile-rounds, the 27B's 4-bit verify rounds of 1 to 8 lanes x 8 columns with the tiled kernel on and off, and bf16.
   --sweep-tile, the tiled kernel (int4_tile) against int4_mma's own warps and bf16 at 1 to 64 rows, bits checked.
   --shape-ab NAME, one product as int4_mma runs it and without its shape's own launch entries (with --candidate,
   with that ring launch and split instead, and the decode step below with each), 1 to 64 rows, twice;
   --sweep-fixed, the fixed time of a launch (o_proj's over 3,072-24,576 columns, also windowed, beside a copy and
   a bf16 GEMV). --sweep-blocks, mlp down's and o_proj's launches over 1, 2 and 3 blocks of threads an SM of
   outputs beside their own, cold and windowed (tools.quant_launch). --x-pad row0 runs every step with the mma
   kernel's padded rows reading row 0's x (the same bits), --x-pad-ab the int4-head decode step with it off and on,
   twice.
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
    python -m tools.bench_quant --out mma.json --skip products,tunings,decode,quality --sweep-mma
    python -m tools.bench_quant --out loads.json --skip products,tunings,decode,quality --sweep-mma-loads
    python -m tools.bench_quant --out loads.json --skip products,tunings,decode,quality --sweep-mma-loads --window
    python -m tools.bench_quant --out hot.json --skip products,tunings,decode,quality --sweep-hot
    python -m tools.bench_quant --out tile.json --skip products,tunings,decode,quality --sweep-tile
    python -m tools.bench_quant --out rounds.json --skip products,tunings,decode,quality --tile-rounds
    python -m tools.bench_quant --out ring.json --skip products,tunings,quality,bf16,fp8 --ring-ab "o_proj:2:2:0"
    python -m tools.bench_quant --out ab.json --skip products,tunings,decode,quality --shape-ab "mlp down" --pdl on
    python -m tools.bench_quant --out c.json --skip products,tunings,quality,bf16,fp8 --shape-ab "gdn in_proj" \
        --candidate 2:2:1:1:2 --pdl on
    python -m tools.bench_quant --out fixed.json --skip products,tunings,decode,quality --sweep-fixed
    python -m tools.bench_quant --out blocks.json --skip products,tunings,decode,quality --sweep-blocks --pdl on
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ignis.artifact import BUILTIN
from ignis.kernels import int4_mma as mma_kernel
from ignis.kernels import launch
from ignis.model.model import HybridModel
from ignis.quant.format import quantize, quantized_name
from ignis.quant import fp8
from ignis.quant.fp8 import Fp8Linear, to_fp8
from ignis.quant import linear as quant_linear
from ignis.quant.linear import QuantLinear, set_kernel, to_mma, uses_mma
from tools.round_timing import copy_bandwidth, gpu_profile, time_followed, time_replays, time_rounds
from tools.round_work import POSITION, build_backend, decodes, floor_bytes
from tools.variants import PDL_SWITCH, TRIGGERS
from tools.quant_rounds import LANES, tile_rounds
from tools import quant_arms as arms
from tools.quant_launch import Candidate, shape_ab, sweep_blocks, sweep_fixed
from tools.quant_summary import summary
from tools.quant_tile import sweep_tile
from tools.quant_products import (C, GROUP, layouts, policies, product_shape, products, sweep_hot, sweep_mma,
                                  sweep_triton, tunings)


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


def act_order(model: HybridModel, seed: int = 0) -> int:
    """Hold every packed projection in act-order form (ignis.quant.linear.Permuted), as an act-order checkpoint loads:
    a random order of its input columns within each group, one order for the projections of a module that read the
    same input (q, k and v; gate and up) as GPTQ's act-order gives them, the codes' columns moved to match
    (QuantLinear.reorder), then fused again. The model's function stays; each product gathers x first. Returns how
    many projections took an order."""
    orders: dict[tuple[str, int], torch.Tensor] = {}
    done = 0
    for name, m in model.named_modules():
        if not isinstance(m, QuantLinear):
            continue
        key = (name.rpartition(".")[0], m.in_features)
        if key not in orders:
            g = torch.Generator().manual_seed(seed + len(orders))
            within = torch.argsort(torch.rand(m.in_features // m.group, m.group, generator=g), dim=1)
            orders[key] = (within + torch.arange(0, m.in_features, m.group)[:, None]).reshape(-1).to(torch.int32)
        m.reorder(orders[key])
        done += 1
    fuse_and_own(model)
    return done


def fuse_and_own(model: HybridModel) -> None:
    """After a conversion: fuse again (quantized projections join, the old fused bf16 matrices are dropped) and give
    the dense linears left (the GDN gates) their own storage, so the old fused matrices are freed."""
    model.fuse()
    for m in model.modules():
        if isinstance(m, nn.Linear) and m.weight.untyped_storage().nbytes() > m.weight.nbytes:
            m.weight = nn.Parameter(m.weight.detach().clone(), requires_grad=False)
    torch.cuda.empty_cache()


def step_floor_bytes(model: HybridModel, lanes: int, cols: int) -> int:
    """Bytes a round of `lanes` x `cols` must move: round_work.floor_bytes (parameters, a 4-bit projection's codes,
    scales and zero points, the lanes' state and K/V) and an fp8 projection's weight and scales, buffers it does not
    count; each byte once."""
    fp8_bytes = sum(b.nbytes for n, m in model.named_modules() if isinstance(m, Fp8Linear)
                    and not n.startswith("mtp.") for b in m.buffers())
    return floor_bytes(model, lanes, cols) + fp8_bytes


def decode_step(label: str, model: HybridModel, bw: float, context: int, iters: int,
                profile: bool = False, lanes: int = 1, k: int = 0) -> dict[str, Any]:
    """The model's round of `lanes` lanes x k + 1 columns (k drafts that cost nothing: a verify; 0: a decode step) in a
    CUDA graph: ms a round, the replay's, the eager round's and the floor's."""
    from ignis.engine.device_round import DeviceRound
    from ignis.model.cache import LaneCache

    dev, dtype = torch.device("cuda"), torch.bfloat16
    model.rope.precompute(context + 16, dev, dtype)
    with tempfile.TemporaryDirectory() as tmp:
        backend = build_backend("verify" if k else "off", k, model, Path(tmp), 8, context, dev, dtype)
    cache = LaneCache(model.config, lanes=8, context=context, max_cols=k + 1, device=dev, dtype=dtype)
    dr = DeviceRound(model, cache, backend, dev, sample_drafts=True)
    work = decodes(lanes, k)
    eager = time_rounds(dr, work, 3)
    span = dr.span_for(POSITION + 1)  # the lanes hold POSITION + 1 tokens, as bench_round's
    bucket = next(b for b in dr.buckets if b >= lanes)
    dr.capture(sorted({(bucket, span, False), (bucket, dr.span_for(POSITION + 1, 2), False)}))
    graph = time_rounds(dr, work, iters)
    followed = time_followed(dr, work, iters)  # as the engine runs them: each queued before the last is read
    replay = time_replays(dr.graphs[(bucket, span, False)], iters)
    # with --graph-profile, the replay's own kernels (what each costs inside the step) and their sum; off by default,
    # since the steps timed after a profiler session took up to 0.7 ms more on the host
    kernel_s, top = 0.0, list[dict[str, Any]]()
    if profile:
        kernel_s, _, top = gpu_profile(dr.graphs[(bucket, span, False)].replay, top=40)
    floor = step_floor_bytes(model, lanes, k + 1) / bw
    print(f"27B {lanes} x {k + 1} round  {label:5s}  graph {1e3 * graph:7.2f} ms  followed {1e3 * followed:7.2f} ms  "
          f"replay {1e3 * replay:7.2f} ms  kernels "
          f"{1e3 * kernel_s:7.2f} ms  eager {1e3 * eager:7.2f} ms  floor {1e3 * floor:6.2f} ms  x{graph / floor:5.2f}",
          flush=True)
    del dr, cache, backend
    torch.cuda.empty_cache()
    return {"weights": label, "graph_ms": 1e3 * graph, "followed_ms": 1e3 * followed, "replay_ms": 1e3 * replay,
            "kernel_ms": 1e3 * kernel_s,
            "eager_ms": 1e3 * eager, "floor_ms": 1e3 * floor, "x_floor": graph / floor, "graph_top_kernels": top}


def decode_steps(bw: float, context: int, iters: int, swiglu_ab: bool = False,
                 profile: bool = False, gdn_pdl_ab: bool = False,
                 trigger_ab: bool = False, act_order_ab: bool = False, ring_ab: str | None = None,
                 skip: frozenset[str] = frozenset(), candidate: tuple[str, Candidate] | None = None,
                 x_pad_ab: bool = False) -> dict[str, Any]:
    """The 27B decode step in bf16, int4, int4 with the output head packed and fp8 (its products through the kernel
    ignis.quant.fp8.FP8_KERNEL names, then through the Triton one: "fp8_triton"); with `swiglu_ab` the int4-head
    step again with SwiGLU in the gate | up product's store (SWIGLU_ROWS 8) and without (0), on the same model; with
    `gdn_pdl_ab` the int4-head step with each of GDN_PDL_ARMS; with `trigger_ab` with launch.EARLY_TRIGGER off, on, off;
    with `ring_ab` with its products' ring loop off, on, off, on (`ring_ab`); with `candidate` (a
    product's name and a quant_launch.Candidate) with that product as shipped and as the candidate has it, twice;
    with `x_pad_ab` with int4_mma.X_PAD_ROW0 off, on, off, on; with `act_order_ab` the int4-head step again with
    every projection act-order (`act_order`: a gather of x ahead of each product), after the int4-head step it is
    compared with. `skip` "bf16" and "fp8" leave out those forms' steps (and the speed-ups over bf16): without bf16's
    step the model is packed before it is fused, so the 27B fits an 80 GB card."""
    from ignis.model.random import random_model

    dev = torch.device("cuda")
    out: dict[str, Any] = {}
    # without bf16's step the model is packed before it is fused: no fused bf16 copy of its projections
    model = random_model(C, seed=0, mtp=False, device=dev, dtype=torch.bfloat16, fuse="bf16" not in skip)
    if "bf16" not in skip:
        out["bf16"] = decode_step("bf16", model, bw, context, iters, profile)
    t0 = time.perf_counter()
    packed = to_int4(model, GROUP)
    if uses_mma(dev, torch.bfloat16):  # as the loader holds a quantized model for the mma kernel
        to_mma(model, torch.bfloat16)
    fuse_and_own(model)
    out["int4_packed"], out["int4_convert_s"] = packed, time.perf_counter() - t0
    out["int4"] = decode_step("int4", model, bw, context, iters, profile)
    out["int4_head_packed"] = to_int4(model, GROUP, head=True)  # `ignis quantize --head`: the output head as well
    if uses_mma(dev, torch.bfloat16):
        to_mma(model, torch.bfloat16)
    out["int4_head"] = decode_step("int4 head", model, bw, context, iters, profile)
    step = partial(decode_step, model=model, bw=bw, context=context, iters=iters, profile=profile)
    if swiglu_ab:
        out.update(arms.ab(step, "int4_head_swiglu", quant_linear, "SWIGLU_ROWS", (8, 0),
                           "SwiGLU in the store to rows"))
    if gdn_pdl_ab:
        out.update(arms.gdn_pdl_ab(step))
    if trigger_ab:
        out.update(arms.ab(step, "int4_head_trigger", launch, "EARLY_TRIGGER", (0, 1, 0), "early trigger"))
    if ring_ab:
        out.update(arms.ring_ab(step, ring_ab))
    if candidate is not None:
        out.update(arms.candidate_ab(step, *candidate))
    if x_pad_ab:
        out.update(arms.ab(step, "int4_head_x_pad", mma_kernel, "X_PAD_ROW0", (0, 1, 0, 1), "x of the padded rows",
                           ("zero", "row0", "zero", "row0")))
    if act_order_ab:  # last: it changes the model
        out["int4_head_act_order_packed"] = act_order(model)
        out["int4_head_act_order"] = step("int4 head, act-order")
        print(f"act-order over int4 head: x{out['int4_head_act_order']['graph_ms'] / out['int4_head']['graph_ms']:.3f}"
              f" graph, x{out['int4_head_act_order']['followed_ms'] / out['int4_head']['followed_ms']:.3f} followed",
              flush=True)
    del model
    torch.cuda.empty_cache()
    forms: tuple[str, ...] = ("int4", "int4_head")
    if "fp8" not in skip:
        forms += ("fp8", "fp8_triton")
        model = random_model(C, seed=0, mtp=False, device=dev, dtype=torch.bfloat16)
        out["fp8_converted"] = to_fp8(model)
        fuse_and_own(model)
        out["fp8"] = decode_step("fp8", model, bw, context, iters, profile)
        kept = fp8.FP8_KERNEL  # the same weights through the Triton kernel (ignis.kernels.gemv_triton)
        try:
            fp8.FP8_KERNEL = "triton"
            out["fp8_triton"] = decode_step("fp8 triton", model, bw, context, iters, profile)
        finally:
            fp8.FP8_KERNEL = kept
        del model
        torch.cuda.empty_cache()
    if "bf16" not in out:
        return out
    for form in forms:
        out[f"speedup_{form}"] = out["bf16"]["graph_ms"] / out[form]["graph_ms"]
        # steps as the engine runs them with engine.async_scheduling: each queued before the host reads the last
        out[f"speedup_{form}_followed"] = out["bf16"]["followed_ms"] / out[form]["followed_ms"]
    print("27B decode step speed-up over bf16: " + ", ".join(
        f"{form} x{out[f'speedup_{form}']:.2f} (followed x{out[f'speedup_{form}_followed']:.2f})" for form in forms),
        flush=True)
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
        for form, (path, as_fp8) in forms.items():
            model = load_model(path, device=device, dtype=dtype, exact=False, fp8=as_fp8)
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
    ap.add_argument("--skip", default="",
                    help="comma list of products, tunings, decode, quality, and bf16 and fp8 (the decode step's forms)")
    ap.add_argument("--sweep-triton", action="store_true",
                    help="time the Triton int4 kernel's launch shapes at three 27B shapes, 1, 8 and 64 rows")
    ap.add_argument("--sweep-mma", action="store_true",
                    help="time the mma int4 kernel's input splits at the five 27B products, 1 and 8 rows")
    ap.add_argument("--sweep-mma-loads", action="store_true",
                    help="time the mma int4 kernel's step sizes and loads ahead at the five 27B products, 1 to 64 rows")
    ap.add_argument("--sweep-rows", default=None,
                    help="the rows (a comma list) the --sweep-mma* sweeps time instead of their own")
    ap.add_argument("--sweep-mma-deep", action="store_true",
                    help="time the mma int4 kernel's input splits with 2 and 3 steps loaded ahead at the five 27B "
                         "products, 1 row")
    ap.add_argument("--window", action="store_true",
                    help="the --sweep-mma* sweeps time each launch windowed too (its codes from L2: what it takes "
                         "when DRAM costs it nothing)")
    ap.add_argument("--sweep-hot", action="store_true",
                    help="time int4_mma at 1 to 64 rows with its weight from DRAM, one copy and windowed")
    ap.add_argument("--tile-rounds", nargs="?", const=",".join(map(str, LANES)), default=None,
                    help="the 27B's 4-bit verify rounds with the tiled kernel on and off, and bf16, at these lanes x 8 "
                         "columns (a comma list; tools.quant_rounds)")
    ap.add_argument("--sweep-tile", action="store_true",
                    help="the tiled 4-bit kernel's launches against int4_mma and bf16 at 1-64 rows (tools.quant_tile)")
    ap.add_argument("--layouts", action="store_true",
                    help="time the Triton int4 kernel on row-major and k-blocked codes at the five 27B products")
    ap.add_argument("--policies", action="store_true",
                    help="time the Triton int4 kernel's launch policies over a decode step's products and keep the "
                         "best for the decode step")
    ap.add_argument("--int4-kernel", default="auto", choices=["auto", "mma", "numba", "triton"],
                    help="the kernel int4 products run with in the decode step and the quality runs")
    ap.add_argument("--pdl", default="auto", choices=list(PDL_SWITCH),
                    help="programmatic dependent launch of the kernels that take it (ignis.kernels.launch.PDL; auto: as "
                         "the round decides, so the decode steps' 4-bit rounds take it and the products alone do not)")
    ap.add_argument("--swiglu-ab", action="store_true",
                    help="time the int4-head decode step with SwiGLU in the product's store and without, one model")
    ap.add_argument("--swiglu-rows", type=int, default=None,
                    help="rows up to which a 4-bit MLP's gate | up runs SwiGLU in the product's store "
                         "(ignis.quant.linear.SWIGLU_ROWS; default: as set there)")
    ap.add_argument("--gdn-pdl-ab", action="store_true",
                    help="time the int4-head decode step with each of GDN_PDL_ARMS (the GDN's conv and recurrence "
                         "launched programmatic-dependent or not, the recurrence applying the gated norm or not)")
    ap.add_argument("--trigger-ab", action="store_true",
                    help="time the int4-head decode step with launch.EARLY_TRIGGER off, on, off (one model)")
    ap.add_argument("--ring-ab", nargs="?", const="o_proj:2:2:0", default=None,
                    help="time the int4-head decode step with these products on the ring loop (int4_mma.RING_LAUNCHES "
                         "and, for an item with KS:KW, int4_mma.SPLITS; name:U:AHEAD:XRING[:KS:KW],..., default "
                         "o_proj:2:2:0) and on the plain loop and choose's split, off, on, off, on (one model)")
    ap.add_argument("--shape-ab", default=None, metavar="NAME",
                    help="time one 27B product (a tools.quant_products.SHAPES name or its start) as int4_mma runs it "
                         "and without its shape's RING_LAUNCHES, SPLITS and SHAPE_TILES entries, 1 to 64 rows, twice "
                         "(tools.quant_launch)")
    ap.add_argument("--candidate", default=None, metavar="U:AHEAD:XRING[:KS:KW]",
                    help="with --shape-ab, its arms are the product as shipped and with this ring launch (and split), "
                         "and the decode step's int4-head form is timed with each, shipped, candidate, twice")
    ap.add_argument("--sweep-fixed", action="store_true",
                    help="the time a 4-bit launch pays whatever its bytes: o_proj's launch over 3,072-24,576 columns, "
                         "PDL on and off, beside a copy and a bf16 GEMV of the same bytes (tools.quant_launch)")
    ap.add_argument("--sweep-blocks", action="store_true",
                    help="mlp down's and o_proj's launches over 1, 2 and 3 blocks of threads an SM of outputs beside "
                         "their own 5,120, cold and windowed, 1 and 8 rows (tools.quant_launch)")
    ap.add_argument("--splits", default=None,
                    help="4-bit products' input splits for the whole run (int4_mma.SPLITS; name:KS:KW,...)")
    ap.add_argument("--act-order-ab", action="store_true",
                    help="time the int4-head decode step again with every projection act-order (a gather of x ahead "
                         "of each product, as for a GPTQ desc_act checkpoint)")
    ap.add_argument("--trigger", default="early" if launch.EARLY_TRIGGER else "late", choices=list(TRIGGERS),
                    help="where products launched programmatic-dependent let the next kernel launch, for the whole run "
                         "(ignis.kernels.launch.EARLY_TRIGGER: early, before their own wait; late, after their loop)")
    ap.add_argument("--x-pad", default="row0" if mma_kernel.X_PAD_ROW0 else "zero", choices=["zero", "row0"],
                    help="what the 4-bit mma kernel's lanes of the rows past a call's load, for the whole run "
                         "(int4_mma.X_PAD_ROW0: zeros, or row 0's x, whose sums are never stored; the same bits)")
    ap.add_argument("--x-pad-ab", action="store_true",
                    help="time the int4-head decode step with int4_mma.X_PAD_ROW0 off, on, off, on (one model)")
    ap.add_argument("--graph-profile", action="store_true",
                    help="also profile each decode step's graph replay: its own kernels' times")
    args = ap.parse_args(argv)
    launch.PDL = PDL_SWITCH[args.pdl]
    launch.EARLY_TRIGGER = TRIGGERS[args.trigger]
    mma_kernel.X_PAD_ROW0 = args.x_pad == "row0"
    if args.swiglu_rows is not None:
        quant_linear.SWIGLU_ROWS = args.swiglu_rows
    skip = set(filter(None, args.skip.split(",")))
    if not args.sweep_triton:
        skip.add("sweep_triton")
    if not args.sweep_mma:
        skip.add("sweep_mma")
    if not args.sweep_mma_loads:
        skip.add("sweep_mma_loads")
    if not args.sweep_mma_deep:
        skip.add("sweep_mma_deep")
    if not args.sweep_hot:
        skip.add("sweep_hot")
    if not args.sweep_tile:
        skip.add("sweep_tile")
    if args.tile_rounds is None:
        skip.add("tile_rounds")
    if not args.policies:
        skip.add("policies")
    if not args.layouts:
        skip.add("layouts")
    if args.shape_ab is None:
        skip.add("shape_ab")
    else:
        product_shape(args.shape_ab)  # a name that is no product fails here, before any GPU work
    candidate = None if args.candidate is None else Candidate.parse(args.candidate)
    if candidate is not None and args.shape_ab is None:
        raise ValueError("--candidate is tried on the product --shape-ab names")
    if not args.sweep_fixed:
        skip.add("sweep_fixed")
    if not args.sweep_blocks:
        skip.add("sweep_blocks")
    set_kernel(args.int4_kernel)
    rows = tuple(int(n) for n in args.sweep_rows.split(",")) if args.sweep_rows else None
    if args.ring_ab is not None:
        arms.ring_launches(args.ring_ab)  # a spec that names no product fails here, before any GPU work
    if args.splits is not None:
        mma_kernel.SPLITS = arms.splits(args.splits)
    t0 = time.perf_counter()
    bw = copy_bandwidth(torch.device("cuda"))
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s on {torch.cuda.get_device_name()}", flush=True)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "copy_tb_s": bw / 1e12, "group": GROUP, "int4_kernel": args.int4_kernel,
                              "pdl": args.pdl, "swiglu_rows": quant_linear.SWIGLU_ROWS, "splits": args.splits,
                              "x_pad": args.x_pad}
    out = Path(args.out)
    steps = [("products", lambda: products(bw, args.reps)), ("tunings", lambda: tunings(bw, args.reps)),
             ("sweep_triton", lambda: sweep_triton(bw, args.reps)),
             ("sweep_mma", lambda: sweep_mma(bw, args.reps, rows=rows, window=args.window)),
             ("sweep_mma_loads", lambda: sweep_mma(bw, args.reps, loads=True, rows=rows, window=args.window)),
             ("sweep_mma_deep", lambda: sweep_mma(bw, args.reps, deep=True, rows=rows, window=args.window)),
             ("sweep_hot", lambda: sweep_hot(bw, args.reps)),
             ("sweep_tile", lambda: sweep_tile(bw, args.reps)),
             ("shape_ab", lambda: shape_ab(bw, args.reps, args.shape_ab, candidate)),
             ("sweep_fixed", lambda: sweep_fixed(bw, args.reps)),
             ("sweep_blocks", lambda: sweep_blocks(bw, args.reps)),
             ("tile_rounds", lambda: tile_rounds(bw, args.context, args.iters,
                                                 tuple(int(n) for n in (args.tile_rounds or "").split(",")))),
             ("policies", lambda: policies(bw, args.reps)),
             ("layouts", lambda: layouts(bw, args.reps)),
             ("decode", lambda: decode_steps(bw, args.context, args.iters, args.swiglu_ab, args.graph_profile,
                                                  args.gdn_pdl_ab, args.trigger_ab, args.act_order_ab,
                                                  args.ring_ab, frozenset(skip),
                                                  None if candidate is None else (args.shape_ab, candidate),
                                                  args.x_pad_ab)),
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
