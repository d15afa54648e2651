"""The decode/verify round against the memory floor, eager and as CUDA graphs, in one run on one device.

For the Qwen3.5-27B shape (random bf16 weights built on the GPU, no checkpoint on disk; 27b-int4, the same packed to 4
bits as `ignis quantize --head` packs them) and the built-in model, and for each case (plain decode; the target's verify
round with free drafts; mtp and dflash2 at 7 drafts, drafter included, proposing through the target's own head,
spec.draft_head = "full"; mtp-h4, mtp's drafts through the target's whole head in 4 bits, spec.draft_head = "int4";
dflash2-sl, dflash2 proposing through its 4-bit shortlist head, spec.draft_head = "shortlist":
the built-in drafter's own, a random one of SHORTLIST_TOKENS rows for the 27B; dflash2-sl-fp8 and dflash2-sl-int4, the
same with the drafter's projections in fp8 or 4-bit, spec.draft_weights; dflash2-h4 and dflash2-h4-int4, proposing
through the target's whole head in 4 bits, spec.draft_head = "int4", with the drafter's projections as they are, in
4-bit or, dflash2-h4-fp8, in fp8; dflash2-g4 and dflash2-h4-g4, the full or the 4-bit head with spec.draft_weights =
"int4-greedy"; dflash2-auto, the engine's defaults for the model and device: spec.draft_head and spec.draft_weights
"auto", at the 27B the 4-bit head and the drafter's 4-bit copy of its layers for greedy rounds of one or two lanes;
dflash2-first, the same with the 27B's random drafter in the first-draft form, slot 1 drafted by the target's MTP layer,
docs/adr/0017: the built-in model's drafter is loaded as it ships, whichever form it has) at 1
and 8 lanes: ms a round through `DeviceRound.run` (host work and the one read-back included), ms a round as the engine
runs them with engine.async_scheduling (`followed_ms`: each round queued before the host reads the last), the graph's replays back
to back (CUDA events: the device's time with the gaps between kernels, without the host's part), GPU kernel time and
kernels per round from the profiler (an eager round, profiled after every case's timings; with --graph-profile also the
graph replay's own kernels, `graph_top_kernels`: what a kernel costs inside the round rather than after a slow eager
launch), and the ratio to the floor: the bytes a round must move (the target's weights once, each lane's recurrent state
read and written, its keys and values read) over the device-to-device copy bandwidth measured in the same run (at its
start and again after every case: the higher of the two, since a fresh device's first copies can run slower). The
drafter is not in the floor: "x floor" of a drafting round is against the target's own floor. With --host-split, also
where a round's time past its back-to-back replay goes (`host_split`). Each row also holds the SM and memory clocks,
power and temperature NVML reported while its graph rounds were timed (tools.gpu_clocks), and what capped the clock if
anything did, and `x_read_floor`: the same bytes over the bandwidth at which a one-row product reads a 2 GiB weight in
the same run (`read_bandwidth`), which tells a machine's slower reads apart from the round's own losses. The requests
are greedy; with --sampled they sample as the acceptance tool's sampled suite does (T = 1.0, top-p 0.95, top-k 20: the
target's distribution shaped and drawn from, rejection sampling, drafts drawn from the drafter's distribution or, with
--draft-sampling greedy, taken as its argmax), each round under its sampled graph.

    python -m tools.bench_round --json round.json --md round.md
    python -m tools.bench_round --models 27b --cases mtp,dflash2 --sampled
    python -m tools.bench_round --models 27b --cases verify --lanes 8 --conv-blocks 1024,8192 --blas cublas,cublaslt

Kernel variants (`--attention-blocks`, `--conv-blocks`, `--blas`, `--stream`, `--gdn`, `--conv`, `--pdl`, `--gdn-pdl`,
`--int4-tile`, `--fp8-kernel`, `--draw`, `--drafter-conv`, `--selector`, `--replay`: comma lists) run as
every combination on each model, built once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ignis.artifact import BUILTIN
from ignis.backends import base as backends_base
from ignis.backends.base import SpecBackend
from ignis.backends.dflash2 import ring, selector
from ignis.backends.dflash2.backend import DFlash2
from ignis.engine.device_round import DeviceRound, Sampling
from ignis.engine.scheduler import Decode
from ignis.kernels import attention, fused, gdn, int4_tile, launch
from ignis.model import ops
from ignis.model.cache import LaneCache
from ignis.model.loader import load_model
from ignis.model.model import HybridModel
from ignis.model.random import random_model
from ignis.quant import fp8
from tools.gpu_clocks import Clocks
from tools.round_timing import (copy_bandwidth, eager_round, gpu_profile, host_split, read_bandwidth, time_followed,
                                time_replays, time_rounds)
from tools.round_work import (CASES, POSITION, QWEN35_27B, SAMPLED, Case, build_backend, decodes, floor_bytes,
                              pack_int4)
from tools.variants import PDL_SWITCH, apply_variant, combinations


def bench_model(label: str, model: HybridModel, path: Path, bw: float, args: argparse.Namespace,
                device: torch.device) -> list[dict[str, Any]]:
    rows = []
    dtype = model.embed_tokens.weight.dtype
    for rope in (model.rope, *([model.mtp.rope] if model.mtp is not None else [])):  # as the engine does
        rope.precompute(args.context + 16, device, dtype)
    cases = [dataclasses.replace(c, lanes=lanes) for c in CASES if c.name in args.cases.split(",")
             for lanes in args.lanes]
    lanes = max(c.lanes for c in cases)
    # every case's timings first, then every case's profiles: the host's part of a round timed after a profiler
    # session had run grew (0.07 -> 0.37 ms at 1 x 1 on the H200), so no timing follows one
    timed: list[tuple[Case, dict[str, Any]]] = []
    for case in cases:
        try:
            timed.append((case, bench_case(label, case, model, path, bw, args, lanes, device, dtype)))
        except Exception as e:  # noqa: BLE001 - a case that cannot run is a result; the cases after it still run
            timed.append((case, {"model": label, "case": case.name, "lanes": case.lanes, "cols": case.k + 1,
                                 "error": repr(e)[:500]}))
            print(f"{label:8s} {case.name:10s} {case.lanes}x{case.k + 1}  failed: {e!r}", flush=True)
        finally:
            torch.cuda.empty_cache()
    for case, row in timed:
        rows.append(row)
        if "error" in row:
            continue
        try:
            row.update(profile_case(case, model, path, args, lanes, device, dtype))
        except Exception as e:  # noqa: BLE001 - the case's timings stand without its profile
            row.update(gpu_ms_eager=float("nan"), kernels=0, top_kernels=[], graph_gpu_ms=0.0, graph_top_kernels=[],
                       profile_error=repr(e)[:500])
        finally:
            torch.cuda.empty_cache()
        print(f"{label:8s} {case.name:10s} {case.lanes}x{case.k + 1}  eager {row['eager_ms']:8.2f} ms  graph "
              f"{row['graph_ms']:8.2f} ms  replay {row['replay_ms']:8.2f} ms  followed {row['followed_ms']:8.2f} ms  "
              f"gpu(eager) {row['gpu_ms_eager']:8.2f} ms  "
              f"kernels {row['kernels']:5d}  "
              f"floor {row['floor_ms']:7.2f} ms  x{row['x_floor']:5.2f}", flush=True)
        c = row.get("clocks")
        if c:
            print(f"    clocks: SM {c['sm_mhz']:.0f} MHz (lowest {c['sm_mhz_min']}), memory {c['mem_mhz']:.0f} MHz, "
                  f"{c['power_w']} W, up to {c['temp_c_max']} C" + (f", capped by {', '.join(c['capped_by'])}"
                                                                   if c["capped_by"] else ""), flush=True)
        if row["host_split"]:
            print("    host split (ms): " + ", ".join(f"{k[:-3]} {v:.3f}" for k, v in row["host_split"].items()),
                  flush=True)
    return rows


def case_round(case: Case, model: HybridModel, path: Path, args: argparse.Namespace, lanes: int,
               device: torch.device, dtype: torch.dtype) -> tuple[DeviceRound, list[Decode], int, int]:
    """A fresh device round for the case: (the round, its lanes' work, the bucket and key span its graph is keyed by)."""
    backend = build_backend(case.backend, case.k, model, path, lanes, args.context, device, dtype)
    cache = LaneCache(model.config, lanes=lanes, context=args.context, max_cols=case.k + 1, device=device, dtype=dtype)
    dr = DeviceRound(model, cache, backend, device, sample_drafts=args.draft_sampling == "sampled",
                     rounds_per_sync=args.rounds_per_sync)
    span = dr.span_for(args.position + 1, args.rounds_per_sync)  # the lanes hold position + 1 tokens (decodes)
    bucket = next(b for b in dr.buckets if b >= case.lanes)
    return dr, decodes(case.lanes, case.k, args.position, args.sampled, args.top_k), bucket, span


def bench_case(label: str, case: Case, model: HybridModel, path: Path, bw: float, args: argparse.Namespace,
               lanes: int, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """The case's timings (its profile is `profile_case`'s, run after every case's timings: `bench_model`)."""
    dr, work, bucket, span = case_round(case, model, path, args, lanes, device, dtype)
    eager = time_rounds(dr, work, max(3, args.iters // 4))
    rounds = args.rounds_per_sync
    mode = dr.sampling_of(work)  # the graph key's sampling a round of these lanes takes
    followed_span = dr.span_for(args.position + 1, 2)  # a followed round's: the host's tokens are a round behind
    capture_s = dr.capture(sorted({(bucket, span, mode), (bucket, followed_span, mode)}))
    with Clocks(device.index or 0) as clocks:  # the SM clock the graph rounds ran at, and what capped it
        graph = time_rounds(dr, work, args.iters, rounds)
    followed = time_followed(dr, work, args.iters) if rounds == 1 else float("nan")
    replay = time_replays(dr.graphs[(bucket, span, mode)], args.iters)  # it replays one round's inputs again
    split = host_split(dr, work, bucket, span, args.iters, mode) if args.host_split else {}
    floor = floor_bytes(model, case.lanes, case.k + 1, args.position) / bw
    return {"model": label, "case": case.name, "lanes": case.lanes, "cols": case.k + 1, "eager_ms": 1e3 * eager,
            "graph_ms": 1e3 * graph, "replay_ms": 1e3 * replay, "followed_ms": 1e3 * followed,
            "rounds_per_sync": rounds, "floor_ms": 1e3 * floor, "x_floor": graph / floor,
            "x_floor_followed": followed / floor, "capture_s": capture_s, "host_split": split,
            "clocks": clocks.summary(), "greedy_copy": reads_greedy_copy(dr.backend, bucket, case.k, mode)}


def reads_greedy_copy(backend: SpecBackend, lanes: int, k: int, mode: int) -> bool:
    """Whether a round of `lanes` lanes drafting `k` under graph key sampling `mode` drafts with dflash2's 4-bit copy
    of its layers (spec.draft_weights = "int4-greedy", ignis.backends.dflash2.greedy_copy)."""
    return isinstance(backend, DFlash2) and backend.reads_copy(mode == Sampling.GREEDY, lanes, k)


def profile_case(case: Case, model: HybridModel, path: Path, args: argparse.Namespace, lanes: int,
                 device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """The case's round profiled, on a round built again (one case's buffers and drafter on the device at a time):
    an eager round's kernels and, with --graph-profile, the same round's kernels as the graph runs them (an eager
    round's small kernels start after slow host launches onto an idle device, so their durations there are not what
    they cost in a replay)."""
    dr, work, bucket, span = case_round(case, model, path, args, lanes, device, dtype)
    gpu, kernels, top = gpu_profile(partial(eager_round, dr, work))
    graph_gpu, graph_top = 0.0, list[dict[str, Any]]()
    if args.graph_profile:
        mode = dr.sampling_of(work)
        dr.capture([(bucket, span, mode)])
        graph_gpu, _, graph_top = gpu_profile(dr.graphs[(bucket, span, mode)].replay, top=40)
    return {"gpu_ms_eager": 1e3 * gpu, "kernels": kernels, "top_kernels": top, "graph_gpu_ms": 1e3 * graph_gpu,
            "graph_top_kernels": graph_top}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench_round")
    ap.add_argument("--models", default="builtin,27b",
                    help="comma list of builtin, 27b, 27b-int4 (the 27B's projections and head in 4 bits, as `ignis "
                         "quantize --head` makes them)")
    ap.add_argument("--context", type=int, default=2048, help="positions a lane holds (at least --position + 9)")
    ap.add_argument("--position", type=int, default=POSITION, help="every lane's anchor position while timing")
    ap.add_argument("--cases", default=",".join(c.name for c in CASES), help="comma list of "
                    + ", ".join(c.name for c in CASES))
    ap.add_argument("--lanes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8],
                    help="comma list of lane counts, each case at each (default 1, 8)")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--rounds-per-sync", type=int, default=1,
                    help="graph rounds queued before each read-back, each from the last one's outputs "
                         "(engine.rounds_per_sync): graph ms is a run's time over its rounds")
    ap.add_argument("--attention", default="auto", choices=attention.PATHS,
                    help="the attention kernels' path (ignis.kernels.attention.use)")
    ap.add_argument("--tokens-per-round", type=float, default=5.589,
                    help="dflash2 tokens per round of the built-in pair on held-out code (BENCHMARKS.md), for the "
                         "projected speed-up")
    ap.add_argument("--copy-tokens-per-round", type=float, default=5.518,
                    help="the same with the drafter's 4-bit copy of its layers drafting every round (spec.draft_weights "
                         "= int4-greedy at one lane, BENCHMARKS.md), for the projected speed-up of rounds that read it")
    ap.add_argument("--attention-blocks", default=str(attention.TARGET_BLOCKS),
                    help="comma list of the blocks attention's split plan aims at (ignis.kernels.attention.TARGET_BLOCKS)")
    ap.add_argument("--conv-blocks", default=str(fused.CONV_BLOCKS),
                    help="comma list: the GDN conv's block target (ignis.kernels.fused.conv_tile); raised, a verify's "
                         "columns spread over more blocks")
    ap.add_argument("--pdl", default=next(k for k, v in PDL_SWITCH.items() if v is launch.PDL),
                    help="comma list of auto, off, on: programmatic dependent launch of the kernels that take it "
                         "(ignis.kernels.launch.PDL; auto: as the round decides, on for a 4-bit target's rounds of "
                         "few rows; with --stream on, the streamed products load weights early)")
    ap.add_argument("--gdn-pdl", default=next(k for k, v in PDL_SWITCH.items() if v is launch.GDN_PDL),
                    help="comma list of auto, off, on: programmatic dependent launch of the Gated DeltaNet's CUDA C++ "
                         "conv and recurrence (ignis.kernels.launch.GDN_PDL; auto: where --pdl's kernels launch so; on: "
                         "every round)")
    ap.add_argument("--stream", default="on" if ops.STREAMING else "off",
                    help="comma list of off, on: whether the products ignis.model.ops.stream_shape picks run the "
                         "Triton weight-streaming kernel (ops.STREAMING)")
    ap.add_argument("--trigger", default="early" if launch.EARLY_TRIGGER else "late",
                    help="comma list of late, early: where a product launched programmatic-dependent lets the next "
                         "kernel launch (ignis.kernels.launch.EARLY_TRIGGER)")
    ap.add_argument("--int4-tile", default="on" if int4_tile.TILE_ROWS is not None else "off",
                    help="comma list of on, off: whether 4-bit products of 17 rows or more may run the tiled kernel "
                         "(ignis.kernels.int4_tile.TILE_ROWS; off: int4_mma's own warps at every row count)")
    ap.add_argument("--fp8-kernel", default=fp8.FP8_KERNEL,
                    help="comma list of mma, triton: the kernel of fp8 products at decode and verify rows "
                         "(ignis.quant.fp8.FP8_KERNEL)")
    ap.add_argument("--draw", default="triton" if backends_base.DRAW_COLUMNS else "torch",
                    help="comma list of triton, torch: how a sampled draft is shaped and drawn on CUDA (triton: one "
                         "launch a slot, ignis.kernels.draw_triton; torch: its reference, about thirty launches; "
                         "ignis.backends.base.DRAW_COLUMNS); a word may repeat, to alternate the arms")
    ap.add_argument("--drafter-conv", default="joined" if ring.JOIN_CONV else "apart",
                    help="comma list of joined, apart: whether the dflash2 drafter's side-1 grouped convs join the "
                         "next norm's launch (ignis.backends.dflash2.ring.JOIN_CONV) or take their own")
    ap.add_argument("--selector", default="triton" if selector.FUSED else "torch",
                    help="comma list of triton, torch: the dflash2 selector's work after the proposal head on CUDA "
                         "(triton: the top-k, the 4-bit head's rescoring and the greedy walk in five launches, "
                         "ignis.backends.dflash2.selector.FUSED; torch: the numba top-k and torch's ops)")
    ap.add_argument("--conv", default="auto",
                    help="comma list of auto, numba, cuda: the GDN conv kernel of decodes and verifies "
                         "(ignis.kernels.fused.CUDA_CONV; auto: by the round's rows)")
    ap.add_argument("--gdn", default="auto",
                    help="comma list of auto, numba, cuda, cuda4, cuda5, cuda6, step, step-normed, apart, chunk1, "
                         "chunk2, chunk2x8, columns: the recurrence kernel of decodes and verifies, and whether the "
                         "conv joins its launch (tools.variants.recurrence_kernel; auto: as ignis.kernels.gdn and "
                         "gdn_cuda are set)")
    ap.add_argument("--replay", default="cuda" if gdn.CUDA_REPLAY else "numba",
                    help="comma list of cuda, numba: the commit's replay of a verify's kept columns "
                         "(ignis.kernels.gdn.CUDA_REPLAY)")
    ap.add_argument("--blas", default="cublas",
                    help="comma list of torch's preferred BLAS library for the products (cublas, cublaslt: "
                         "torch.backends.cuda.preferred_blas_library); a round of ignis.model.ops.LT_MIN_ROWS rows or "
                         "more takes cuBLASLt whatever this says (ops.products_for)")
    ap.add_argument("--graph-profile", action="store_true",
                    help="also profile each case's graph replay: its own kernels' times, `graph_top_kernels`")
    ap.add_argument("--host-split", action="store_true",
                    help="also split each case's round past its replay into the host's steps and the launch onto an "
                         "idle device (`host_split`)")
    ap.add_argument("--sampled", action="store_true",
                    help="sampled requests (T = 1.0, top-p 0.95, top-k 20) instead of greedy ones")
    ap.add_argument("--top-k", type=int, default=SAMPLED.top_k,
                    help="with --sampled: the requests' top-k (0: off, so p is shaped over the whole vocabulary; 1 to "
                         "ignis.engine.device_sampling.CANDIDATES: over each row's largest logits)")
    ap.add_argument("--draft-sampling", choices=("sampled", "greedy"), default="sampled",
                    help="with --sampled: drafts drawn from the drafter's distribution, or its argmax "
                         "(spec.draft_sampling)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None)
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    attention.use(args.attention)
    # every combination of the variant options, each model built once; with more than one, a row's model names it
    variants = combinations(args)
    bw = copy_bandwidth(device)
    read_bw = read_bandwidth(device)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, a weight read by a one-row product {read_bw / 1e12:.2f} TB/s",
          flush=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:  # the 27B's random drafter and shortlist
        for label in args.models.split(","):
            if label == "builtin":
                model, path = load_model(BUILTIN, device=device, dtype=torch.bfloat16, exact=False), BUILTIN
            else:
                model = random_model(QWEN35_27B, seed=0, mtp=True, device=device, dtype=torch.bfloat16)
                if label == "27b-int4":
                    pack_int4(model)
                path = Path(tmp) / label
                path.mkdir()
            for variant in variants:
                apply_variant(variant)
                name = label if len(variants) == 1 else " ".join([label, *(f"{k}={v}" for k, v in variant.items())])
                rows += [{**r, **variant} for r in bench_model(name, model, path, bw, args, device)]
            del model
            torch.cuda.empty_cache()
    # The copy again, after every case, and the floors over the higher of the two: one machine's copies measured
    # 4.19 TB/s in its first process and 4.25 in the next three (a low figure flatters every ratio), and once 3.81
    # after a run's cases against 4.26 before them.
    bw_end = copy_bandwidth(device)
    if bw_end > bw:
        for r in rows:
            if "floor_ms" in r:
                r["floor_ms"] *= bw / bw_end
                r["x_floor"] = r["graph_ms"] / r["floor_ms"]
                r["x_floor_followed"] = r["followed_ms"] / r["floor_ms"]
    print(f"copy bandwidth again after the cases {bw_end / 1e12:.2f} TB/s: the floors take "
          f"{max(bw, bw_end) / 1e12:.2f}", flush=True)
    bw_start, bw = bw, max(bw, bw_end)
    timed = [r for r in rows if "error" not in r]
    for r in timed:  # the same bytes over the read bandwidth: what the round's ratio would be on the reads alone
        r["x_read_floor"] = r["graph_ms"] / (r["floor_ms"] * bw / read_bw)
        print(f"{r['model']:8s} {r['case']:9s} {r['lanes']}x{r['cols']}  x{r['x_floor']:5.2f} the copy floor "
              f"(x{r['x_floor_followed']:5.2f} followed), x{r['x_read_floor']:5.2f} the read floor", flush=True)
    projected = {}
    for label in {r["model"] for r in timed}:
        for lanes in (1, 8):
            off = [r for r in timed if r["model"] == label and r["case"] == "decode" and r["lanes"] == lanes]
            # the default drafter: "dflash2-auto" and "dflash2-first" key their own projections
            for case in ("dflash2", "dflash2-auto", "dflash2-first"):
                spec = [r for r in timed if r["model"] == label and r["case"] == case and r["lanes"] == lanes]
                if off and spec:
                    tokens = args.copy_tokens_per_round if spec[0].get("greedy_copy") else args.tokens_per_round
                    key = f"{label}:{lanes}" + ("" if case == "dflash2" else f":{case}")
                    projected[key] = tokens * off[0]["graph_ms"] / spec[0]["graph_ms"]
                    # the same with each round queued before the host reads the last (engine.async_scheduling)
                    projected[f"{key}:followed"] = tokens * off[0]["followed_ms"] / spec[0]["followed_ms"]
    result = {"device": torch.cuda.get_device_name(), "copy_tb_s": bw / 1e12, "copy_tb_s_start": bw_start / 1e12,
              "copy_tb_s_end": bw_end / 1e12, "read_tb_s": read_bw / 1e12,
              "context": args.context,
              "attention": args.attention, "position": args.position, "rows": rows, "projected_speedup": projected}
    print(json.dumps(projected))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.md:
        lines = ["| model | case | lanes x cols | eager ms | graph ms | followed ms | replay ms | eager/graph | GPU ms "
                 "(eager) | kernels | floor ms | graph / floor | followed / floor |",
                 "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['case']} | {r['lanes']} x {r['cols']} | {r['eager_ms']:.2f} | {r['graph_ms']:.2f} "
                  f"| {r['followed_ms']:.2f} | {r['replay_ms']:.2f} | {r['eager_ms'] / r['graph_ms']:.1f} "
                  f"| {r['gpu_ms_eager']:.2f} | {r['kernels']} | {r['floor_ms']:.2f} | {r['x_floor']:.2f} "
                  f"| {r['x_floor_followed']:.2f} |" for r in timed]
        lines += [f"| {r['model']} | {r['case']} | {r['lanes']} x {r['cols']} | failed: {r['error']} |"
                  for r in rows if "error" in r]
        Path(args.md).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
