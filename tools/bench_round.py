"""The decode/verify round against the memory floor, eager and as CUDA graphs, in one run on one device.

For the Qwen3.5-27B shape (random bf16 weights built on the GPU, no checkpoint on disk; 27b-int4, the same packed to 4
bits as `ignis quantize --head` packs them) and the built-in model, and for each case (plain decode; the target's verify
round with free drafts; mtp and dflash2 at 7 drafts, drafter included, dflash2 proposing through the target's own head,
spec.draft_head = "full"; dflash2-sl, dflash2 proposing through its 4-bit shortlist head, spec.draft_head = "shortlist":
the built-in drafter's own, a random one of SHORTLIST_TOKENS rows for the 27B; dflash2-sl-fp8 and dflash2-sl-int4, the
same with the drafter's projections in fp8 or 4-bit, spec.draft_weights; dflash2-h4 and dflash2-h4-int4, proposing
through the target's whole head in 4 bits, spec.draft_head = "int4", with the drafter's projections as they are, in
4-bit or, dflash2-h4-fp8, in fp8; dflash2-g4 and dflash2-h4-g4, the full or the 4-bit head with spec.draft_weights =
"int4-greedy"; dflash2-auto, the engine's defaults for the model and device: spec.draft_head and spec.draft_weights
"auto", at the 27B the 4-bit head and the drafter's 4-bit copy of its layers for greedy rounds of one or two lanes) at 1
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
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
import dataclasses
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import torch

from ignis.artifact import BUILTIN
from ignis.backends import base as backends_base
from ignis.backends.base import BackendContext, Choice, Committed, Proposal, SpecBackend
from ignis.backends.dflash2 import ring, selector
from ignis.backends.dflash2.backend import DFlash2
from ignis.backends.dflash2.config import DrafterConfig, drafter_config_json
from ignis.backends.dflash2.weights import SHORTLIST, random_drafter, spread_layer_ids
from ignis.backends.mtp import Mtp
from ignis.config import load_config
from ignis.engine.device_round import DeviceRound, Sampling
from ignis.engine.request import Request
from ignis.engine.sampling import make_generator
from ignis.engine.scheduler import Decode
from ignis.model.cache import LaneCache
from ignis.model.loader import load_model
from ignis.model import ops
from ignis.model.model import HybridModel
from ignis.kernels import attention, fused, gdn, int4_tile, launch
from tools.gpu_clocks import Clocks
from tools.variants import PDL_SWITCH, apply_variant, combinations
from ignis.model.random import random_model
from ignis.quant import fp8
from ignis.quant.linear import QuantLinear, to_mma, uses_mma
from ignis.train.shortlist import build as build_shortlist
from ignis.params import SamplingParams

# Qwen3.5-27B text model (research/qwen35.md): 64 layers, 48 Gated DeltaNet + 16 gated attention.
QWEN35_27B: dict[str, Any] = {
    "vocab_size": 248320, "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 64,
    "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16,
    "linear_num_value_heads": 48, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "max_position_embeddings": 262144, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "rms_norm_eps": 1e-6, "eos_token_id": [248044],
}
POSITION = 512  # every lane's anchor position while timing (a 512-token context)


class FreeDrafts:
    """A graph-safe backend whose drafts cost nothing (the anchor repeated): the target's own verify round."""

    name = "verify"
    tap_layers: tuple[int, ...] = ()
    graph_safe = True

    def __init__(self, k: int) -> None:
        self.draft_tokens = k

    def nbytes(self) -> int:
        return 0

    def reset(self, lane: int) -> None:
        pass

    def observe(self, obs: list[Any]) -> None:
        pass

    def propose(self, inp: Any) -> Proposal:
        raise NotImplementedError

    def propose_lanes(self, lanes: torch.Tensor, anchors: torch.Tensor, positions: torch.Tensor, k: int,
                      choice: Choice, span: int) -> Proposal:
        return Proposal(anchors[:, None].expand(-1, k), None)

    def observe_lanes(self, rows: Committed, span: int) -> None:
        pass


@dataclass
class Case:
    name: str
    backend: str  # off | verify | mtp | dflash2
    k: int
    lanes: int = 1


# every kind of round, once: each runs at every lane count --lanes asks for
CASES = [Case("decode", "off", 0), Case("verify", "verify", 7), Case("mtp", "mtp", 7), Case("dflash2", "dflash2", 7),
         Case("dflash2-sl", "dflash2-shortlist", 7), Case("dflash2-sl-fp8", "dflash2-shortlist-fp8", 7),
         Case("dflash2-sl-int4", "dflash2-shortlist-int4", 7), Case("dflash2-h4", "dflash2-head4", 7),
         Case("dflash2-h4-int4", "dflash2-head4-int4", 7), Case("dflash2-h4-fp8", "dflash2-head4-fp8", 7),
         Case("dflash2-auto", "dflash2-auto", 7), Case("dflash2-g4", "dflash2-g4", 7),
         Case("dflash2-h4-g4", "dflash2-head4-g4", 7)]
# a drafting case's suffix -> its spec.draft_weights
WEIGHT_SUFFIXES = {"-fp8": "fp8", "-int4": "int4", "-g4": "int4-greedy"}
# the random 27B drafter's shortlist head (spec.draft_head = "shortlist"): as many tokens as docs/drafter-training.md's
# 27B command keeps (--shortlist 32768); the built-in drafter has its own (4,096)
SHORTLIST_TOKENS = 32768


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a 2 GiB device-to-device copy (bytes read plus bytes written), median of 20."""
    x = torch.randn(2**29, device=device)  # 2 GiB fp32
    y = torch.empty_like(x)
    return 2 * x.nbytes / _median_s(lambda: y.copy_(x))


def read_bandwidth(device: torch.device) -> float:
    """Bytes per second of reading a 2 GiB bf16 weight once as a one-row product does (cuBLAS, [16384, 65536] @ [65536,
    1]), median of 20. A round reads its weights this way, and machines whose copies run alike have been seen to
    differ here: beside the copy bandwidth that the floors use, it tells the machine's share of a ratio apart."""
    w = torch.randn(2**14, 2**16, device=device, dtype=torch.bfloat16)
    v = torch.randn(2**16, 1, device=device, dtype=torch.bfloat16)
    return w.nbytes / _median_s(lambda: torch.mm(w, v))


def _median_s(call: Callable[[], object]) -> float:
    """Seconds of one call by CUDA events, the median of 20 after 5 warm-up calls."""
    times = []
    for i in range(25):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        call()
        b.record()
        b.synchronize()
        if i >= 5:
            times.append(a.elapsed_time(b) / 1000)
    return statistics.median(times)


def pack_int4(model: HybridModel) -> None:
    """The model as `ignis quantize --head` and the loader would hold it: every projection and the output head in
    4 bits over groups of 128, in the mma kernel's order where it runs, fused again."""
    from tools.bench_quant import fuse_and_own, to_int4

    to_int4(model, 128, head=True)
    if uses_mma(model.embed_tokens.weight.device, model.embed_tokens.weight.dtype):
        to_mma(model, model.embed_tokens.weight.dtype)
    fuse_and_own(model)


def floor_bytes(model: HybridModel, lanes: int, cols: int, position: int = POSITION) -> int:
    """Bytes a round must move: the target's weights once (the embedding only where it is the output head too),
    and per lane the recurrent state read and written plus the keys and values of its context (`position` slots and
    the round's columns) read."""
    c = model.config
    skip = {"embed_tokens.weight"} if model.lm_head is not None else set()
    weights = sum(p.nbytes for n, p in model.named_parameters() if not n.startswith("mtp.") and n not in skip)
    weights += sum(t.nbytes for n, m in model.named_modules() if isinstance(m, QuantLinear) and not n.startswith("mtp.")
                   for t in m.buffers(recurse=False))  # a 4-bit target's codes, scales and zero points
    elt = model.embed_tokens.weight.element_size()
    gdn = sum(1 for t in c.layer_types if t == "linear_attention")
    attn = len(c.layer_types) - gdn
    state = gdn * (2 * 4 * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim)
    kv = attn * 2 * c.num_key_value_heads * c.head_dim * elt * (position + cols)
    return weights + lanes * (state + kv)


def build_backend(kind: str, k: int, model: HybridModel, path: Path, lanes: int, context: int,
                  device: torch.device, dtype: torch.dtype) -> SpecBackend:
    if kind in ("off", "verify"):
        return FreeDrafts(k)
    head, weights = "full", "model"
    if kind == "dflash2-auto":  # what the engine's defaults resolve to for this model and device
        kind, head, weights = "dflash2", "auto", "auto"
    elif kind.startswith("dflash2-"):
        weights = next((w for s, w in WEIGHT_SUFFIXES.items() if kind.endswith(s)), "model")
        if kind.startswith(("dflash2-shortlist", "dflash2-head4")):
            head = "shortlist" if kind.startswith("dflash2-shortlist") else "int4"
        kind = "dflash2"
    overrides = {"model.path": str(path), "spec.backend": kind, "spec.draft_tokens": k, "spec.draft_head": head,
                 "spec.draft_weights": weights, "log.level": "warning"}
    ctx = BackendContext(model, load_config(overrides=overrides), path, lanes, context, device, dtype)
    if kind == "mtp":
        return Mtp(ctx)
    drafter = None
    if not (path / "drafter" / "config.json").is_file():
        if head == "shortlist":
            random_shortlist(model, path / "drafter", SHORTLIST_TOKENS)
        cfg = DrafterConfig.from_dict(drafter_config_json(
            model.config, num_layers=5, num_heads=32, num_kv_heads=8, head_dim=128, block_size=8,
            mask_token_id=model.config.vocab_size - 1, target_layer_ids=spread_layer_ids(model.config.num_hidden_layers, 5),
            selector_rank=256, selector_top_k=16), model.config)
        drafter = random_drafter(cfg, seed=1, device=device, dtype=dtype)
    return DFlash2(ctx, drafter)


def random_shortlist(model: HybridModel, drafter_dir: Path, tokens: int) -> None:
    """A shortlist head for a drafter that has none on disk: the target's output rows of `tokens` random ids
    (ignis.backends.dflash2.shortlist's format), so a round can be timed with spec.draft_head = "shortlist"."""
    if (drafter_dir / SHORTLIST).is_file():
        return
    head = model.lm_head.weight if model.lm_head is not None else model.embed_tokens.weight
    counts = torch.zeros(head.shape[0])  # one count each for `tokens` random ids: the shortlist keeps them in id order
    counts[torch.randperm(head.shape[0], generator=torch.Generator().manual_seed(0))[:tokens]] = 1.0
    build_shortlist(head, drafter_dir / SHORTLIST, counts, tokens)


# the sampled rounds' requests (--sampled): the acceptance tool's sampled suite's parameters
SAMPLED = SamplingParams(max_tokens=4096, temperature=1.0, top_p=0.95, top_k=20)


def decodes(lanes: int, k: int, position: int = POSITION, sampled: bool = False,
            top_k: int = SAMPLED.top_k) -> list[Decode]:
    """`lanes` requests at `position`, each drafting `k`: greedy, or sampled as `SAMPLED` with its top-k `top_k` (the
    target's draws, rejection sampling and drafts drawn from the drafter's distribution)."""
    out = []
    params = msgspec.structs.replace(SAMPLED, top_k=top_k) if sampled else SamplingParams(max_tokens=4096,
                                                                                          temperature=0.0)
    for lane in range(lanes):
        r = Request(id=str(lane), prompt=[1] * position, params=params,
                    stop_ids=frozenset(), generator=make_generator(lane), seed=lane)
        r.tokens.append(2)
        r.lane, r.computed = lane, position
        out.append(Decode(r, k))
    return out


def time_rounds(dr: DeviceRound, work: list[Decode], iters: int, rounds: int = 1) -> float:
    """Seconds a round, median of `iters` runs of `rounds` chained rounds each (engine.rounds_per_sync), each run
    ending with its one read-back."""
    # each run ends with the rounds' one read-back: the host has the tokens
    return median_wall_s(lambda: dr.run(work, rounds), iters, warmup=3) / rounds


def median_wall_s(call: Callable[[], object], iters: int, warmup: int = 2) -> float:
    """Host seconds of one call that ends with its own read-back, the median of `iters` after `warmup` calls."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


FOLLOWED = 8  # rounds of a followed run: the lanes' inputs are loaded again after it, so positions stay in the span


def time_followed(dr: DeviceRound, work: list[Decode], iters: int) -> float:
    """Seconds a round as the engine runs them with engine.async_scheduling: runs of FOLLOWED rounds, the first from
    the host's inputs (`DeviceRound.start`), each later one queued from the last one's outputs on the device
    (`DeviceRound.follow`) before the host waits for and reads the last one; median over `iters` runs of a run's time
    over its rounds. The host's wait and read-back overlap the next round; one load a run does not."""
    def one() -> None:
        launched = dr.start(work)
        for _ in range(FOLLOWED - 1):
            following = dr.follow(launched)
            dr.wait(launched)
            dr.collect(launched)
            launched = following
        dr.wait(launched)
        dr.collect(launched)

    return median_wall_s(one, iters) / FOLLOWED


def eager_round(dr: DeviceRound, work: list[Decode]) -> None:
    """One round run eagerly, even where a graph is captured for its shape: the launches a round issues."""
    graphs, dr.graphs = dr.graphs, {}
    try:
        dr.run(work)
    finally:
        dr.graphs = graphs


def time_replays(graph: torch.cuda.CUDAGraph, iters: int) -> float:
    """Seconds a replay of `graph` takes back to back on the device (CUDA events around `iters` replays): the round's
    device time with its kernels' gaps, without the host's input writes and read-back that `time_rounds` includes."""
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


SLEEP_CYCLES = 8_000_000  # a sleep kernel of about 4 ms at the H200's clock: a graph launched behind it is queued


def host_split(dr: DeviceRound, work: list[Decode], bucket: int, span: int, iters: int,
               sampling: int) -> dict[str, float]:
    """Where a round's time past its back-to-back replay goes, ms medians of `iters` rounds each after 2 ms of an idle
    device: `DeviceRound.run`'s steps (the inputs' write and upload, the graph's launch call, the read-back queued, the
    wait, the read); one replay timed by CUDA events from an idle device; and one launched behind a sleep kernel, so
    that the launch is done before the device reaches it. The first against the last is what launching onto an idle
    device costs; the replay call against the wait, how much of the launch the device waits for. The round's graph for
    (bucket, span, sampling) is captured."""
    from ignis.engine.device_round import Launched, synchronize

    buf, graph = dr.buffers[bucket], dr.graphs[(bucket, span, sampling)]
    steps: dict[str, list[float]] = {n: [] for n in ("load", "replay_call", "send", "wait", "collect")}
    idle: list[float] = []
    queued: list[float] = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(iters):
        torch.cuda.synchronize(dr.device)
        time.sleep(0.002)
        t = [time.perf_counter()]
        buf.load(work, dr.sample_drafts)
        t.append(time.perf_counter())
        graph.replay()
        t.append(time.perf_counter())
        buf.send(0)
        t.append(time.perf_counter())
        synchronize(dr.device)
        t.append(time.perf_counter())
        dr.collect(Launched(work, buf, 1))
        t.append(time.perf_counter())
        for name, a, b in zip(steps, t, t[1:]):
            steps[name].append(1e3 * (b - a))
        for behind, out in ((False, idle), (True, queued)):
            torch.cuda.synchronize(dr.device)
            time.sleep(0.002)
            if behind:
                torch.cuda._sleep(SLEEP_CYCLES)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
    split = {f"{name}_ms": statistics.median(v) for name, v in steps.items()}
    return {**split, "replay_idle_ms": statistics.median(idle), "replay_queued_ms": statistics.median(queued)}


def gpu_profile(fn: Callable[[], object], top: int = 25) -> tuple[float, int, list[dict[str, Any]]]:
    """(GPU time in s, kernels and copies, the `top` costliest kernel names with their count and total µs) of one
    call of fn after a warm one, from torch.profiler."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    fn()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    events = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = {}
    for e in events:
        by_name.setdefault(e.name[:90], []).append(e.device_time_total)
    ranked = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:top]
    costliest: list[dict[str, Any]] = [{"kernel": n, "count": len(t), "us": round(sum(t), 1)} for n, t in ranked]
    return sum(e.device_time_total for e in events) / 1e6, len(events), costliest


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
            for case in ("dflash2", "dflash2-auto"):  # the default drafter: "dflash2-auto" keys its own projection
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
