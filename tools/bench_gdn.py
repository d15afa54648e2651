"""The Gated DeltaNet recurrence kernels (ignis.kernels.gdn) at the Qwen3.5-27B shape against their state bytes, in
one run on one GPU.

For a decode (1 column, the state read and written) and a verify (8 columns, the state read once and each column
recorded) of one layer at 1 and 8 lanes, the commit's replay of 48 layers' kept columns, and (`--cases conv`) a
verify's short conv under the numba and the CUDA C++ kernel: µs a launch, from a CUDA graph of calls cycling over
enough lanes (or layers) that no state is read from L2, and that time over the launch's bytes (state, inputs,
outputs and records) at the copy bandwidth measured in the same run. `--once` runs each case once
after a warm-up instead, for a profiler (ncu) to attach to.

    python -m tools.bench_gdn --out gdn.json --kernels numba,cuda
    python -m tools.bench_gdn --cases conv --convs numba,cuda
    ncu --clock-control none -k regex:columns python -m tools.bench_gdn --once --cases verify --kernels cuda
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ignis.kernels import gdn, replay_cuda
from tools.round_timing import copy_bandwidth
from tools.round_work import QWEN35_27B
from tools.quant_products import graph_ms
from tools.variants import recurrence_kernel

# Qwen3.5-27B's Gated DeltaNet: 16 key heads, 48 value heads of 128 x 128, in 48 of its 64 layers (3 : 1), all of
# which the replay commits in one launch
HK, HV = QWEN35_27B["linear_num_key_heads"], QWEN35_27B["linear_num_value_heads"]
DK, DV = QWEN35_27B["linear_key_head_dim"], QWEN35_27B["linear_value_head_dim"]
LAYERS = QWEN35_27B["num_hidden_layers"] * 3 // 4
POOL = 64  # lanes of state the timed calls cycle over (8 lanes x 8 sets = 200 MB, four times the L2)


def inputs(b: int, c: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = torch.device("cuda")
    mixed = torch.randn(b, c, 2 * HK * DK + HV * DV, device=dev, generator=g)
    return {"mixed": gdn.normalise_qk(mixed, HK, DK).contiguous(),
            "ba": torch.randn(b, c, 2 * HV, device=dev, generator=g) * 2,
            "dt_bias": torch.randn(HV, device=dev, generator=g),
            "rate": -torch.rand(HV, device=dev, generator=g) * 2}


def timed(row: dict[str, Any], calls: Sequence[Callable[[], object]], reps: int, nbytes: int,
          bw: float) -> dict[str, Any]:
    """row with µs a call (tools.quant_products.graph_ms: one CUDA graph cycling over the calls) and that over the
    floor, `nbytes` at the copy bandwidth."""
    us = 1e3 * graph_ms(list(calls), reps)
    floor = 1e6 * nbytes / bw
    return {**row, "us": us, "floor_us": floor, "x_floor": us / floor}


def recurrence_case(kind: str, b: int, bw: float, reps: int, once: bool) -> dict[str, Any]:
    """A decode (kind "decode": 1 column, state written) or a verify (8 columns, recorded) of one layer."""
    c, write = (1, True) if kind == "decode" else (8, False)
    return columns_case(kind, b, c, write, not write, bw, reps, once)


def columns_case(kind: str, b: int, c: int, write: bool, recorded: bool, bw: float, reps: int,
                 once: bool) -> dict[str, Any]:
    """One layer's recurrence over c columns of b lanes, the state written or not, each column recorded or not."""
    dev = torch.device("cuda")
    state = torch.randn(POOL, HV, DK, DV, device=dev) * 0.1
    record = torch.zeros(POOL, c, HV, gdn.record_width(DK, DV), device=dev) if recorded else None
    x = inputs(b, c, seed=b * 10 + c)
    sets = [torch.arange(i * b, (i + 1) * b, device=dev) for i in range(POOL // b)]
    calls = [lambda lanes=lanes: gdn.columns(state, lanes, x["mixed"], x["ba"], x["dt_bias"], x["rate"], record,
                                             key_heads=HK, write_state=write, normalised=True) for lanes in sets]
    if once:
        calls[0]()
        torch.cuda.synchronize()
        calls[1]()
        torch.cuda.synchronize()
        return {"case": kind, "lanes": b, "cols": c}
    per_state = HV * DK * DV * 4
    nbytes = b * per_state * (2 if write else 1) + x["mixed"].nbytes + x["ba"].nbytes + b * c * HV * DV * 4
    if record is not None:
        nbytes += b * c * HV * record.shape[-1] * 4
    return timed({"case": kind, "lanes": b, "cols": c}, calls, reps, nbytes, bw)


def replay_case(b: int, bw: float, reps: int, once: bool, kept: int = 8) -> dict[str, Any]:
    """The commit of every layer's kept columns (by default all 8 of them: the most a round keeps) in one launch."""
    dev = torch.device("cuda")
    lanes_pool = 16  # 48 layers x 16 lanes of state: 2.4 GB
    state = torch.randn(LAYERS, lanes_pool, HV, DK, DV, device=dev) * 0.1
    record = torch.randn(LAYERS, lanes_pool, 8, HV, gdn.record_width(DK, DV), device=dev) * 0.1
    record[..., DK + DV] = -0.1  # g: a mild decay
    last = torch.full((b,), kept - 1, dtype=torch.int64, device=dev)
    sets = [torch.arange(i * b, (i + 1) * b, device=dev) for i in range(lanes_pool // b)]
    calls = [lambda lanes=lanes: gdn.replay(state, lanes, record, last) for lanes in sets]
    if once:
        calls[0]()
        torch.cuda.synchronize()
        return {"case": "replay", "lanes": b, "cols": kept}
    nbytes = LAYERS * b * (2 * HV * DK * DV * 4 + kept * HV * record.shape[-1] * 4)
    return timed({"case": "replay", "lanes": b, "cols": kept}, calls, reps, nbytes, bw)


def defer_cases(b: int, kept: int, bw: float, reps: int) -> list[dict[str, Any]]:
    """What deferring the commit's replay into the next round's recurrence could save a round, bounded by kernels that
    exist: the next verify would apply `kept` recorded columns (decay and update only) before its own 8, and write
    the state. At most it costs a verify of 8 + kept columns with the state written (`upper`: every pending column a
    whole column), at least one of 8 with the state written (`lower`: pending columns free); today's cost is the
    verify of 8 plus the 48-layer replay's share of a layer."""
    verify = columns_case("verify", b, 8, False, True, bw, reps, False)
    replay = replay_case(b, bw, reps, False, kept)
    upper = columns_case("defer-upper", b, 8 + kept, True, True, bw, reps, False)
    lower = columns_case("defer-lower", b, 8, True, True, bw, reps, False)
    now = verify["us"] + replay["us"] / LAYERS
    bounds = {"case": "defer-saving", "lanes": b, "cols": kept,
              "saving_ms_round_min": LAYERS * (now - upper["us"]) / 1e3,
              "saving_ms_round_max": LAYERS * (now - lower["us"]) / 1e3}
    return [verify, replay, upper, lower, bounds]


def conv_case(b: int, conv: str, bw: float, reps: int, once: bool) -> dict[str, Any]:
    """A verify's conv (8 columns, each column's input recorded, the window left alone) of b lanes through the numba
    or the CUDA C++ kernel (ignis.kernels.fused.CUDA_CONV), cycling over LAYERS layers' buffers as a round does, the
    conv's input a view of the layer's projection."""
    from ignis.kernels import fused

    dev, c = torch.device("cuda"), 8
    dim = 2 * HK * DK + HV * DV  # q | k | v channels
    layers = []
    for _ in range(LAYERS):
        proj = torch.randn(b, c, dim + HV * DV + 2 * HV, device=dev).bfloat16()  # qkv | z | b a, as the projection
        layers.append((torch.randn(b, 3, dim, device=dev).bfloat16(), proj[..., :dim],
                       torch.randn(dim, 4, device=dev), proj[..., dim + HV * DV :],
                       torch.empty(b, c, dim, device=dev).bfloat16()))
    lanes = torch.arange(b, device=dev)
    kept = fused.CUDA_CONV
    fused.CUDA_CONV = conv == "cuda"
    try:
        calls = [partial(fused.conv, w, lanes, r, wt, ba, rec, key_heads=HK, dk=DK) for w, r, wt, ba, rec in layers]
        row = {"case": "conv", "lanes": b, "cols": c, "kernel": conv}
        if once:
            calls[0]()
            torch.cuda.synchronize()
            return row
        # read: the inputs and the window; written: the float32 output, the record and the gates in float32
        nbytes = b * dim * 2 * (c + 3) + b * c * dim * (4 + 2) + b * c * 2 * HV * (2 + 4)
        return timed(row, calls, reps, nbytes, bw)
    finally:
        fused.CUDA_CONV = kept


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench_gdn")
    ap.add_argument("--cases", default="decode,verify,replay",
                    help="comma list of decode, verify, replay, defer (bounds on deferring the replay; numba only), "
                         "conv (a verify's conv under each of --convs)")
    ap.add_argument("--kept", type=int, default=5, help="columns a round keeps, for the defer case")
    ap.add_argument("--lanes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--once", action="store_true", help="each case once after a warm-up (for a profiler)")
    ap.add_argument("--kernels", default="numba",
                    help="comma list of tools.variants.GDN_KERNELS (auto, numba, cuda6, columns, chunk2, ..): the "
                         "decode's and verify's recurrence kernel (tools.variants.recurrence_kernel), each timed in turn")
    ap.add_argument("--replays", default="numba,cuda",
                    help="comma list of numba, cuda, cudaN: the replay case's kernels (ignis.kernels.gdn.CUDA_REPLAY; "
                         "cudaN: blocks of N state rows, ignis.kernels.replay_cuda.ROWS)")
    ap.add_argument("--convs", default="numba,cuda", help="comma list of numba, cuda: the conv case's kernels")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cases = args.cases.split(",")
    bw = 0.0 if args.once else copy_bandwidth(torch.device("cuda"))
    rows = []
    shipped_replay, shipped_rows = gdn.CUDA_REPLAY, replay_cuda.ROWS
    for kernel in args.kernels.split(","):
        recurrence_kernel(kernel)
        for b in args.lanes:
            for kind in ("decode", "verify"):
                if kind in cases:
                    rows.append({**recurrence_case(kind, b, bw, args.reps, args.once), "kernel": kernel})
            if "replay" in cases and kernel == args.kernels.split(",")[0]:
                for word in args.replays.split(","):
                    gdn.CUDA_REPLAY = word.startswith("cuda")
                    replay_cuda.ROWS = int(word[4:] or shipped_rows) if gdn.CUDA_REPLAY else shipped_rows
                    rows.append({**replay_case(b, bw, args.reps, args.once), "kernel": word})
                gdn.CUDA_REPLAY, replay_cuda.ROWS = shipped_replay, shipped_rows
            if "defer" in cases and kernel == "numba" and not args.once:
                rows += [{**r, "kernel": "numba"} for r in defer_cases(b, args.kept, bw, args.reps)]
    if "conv" in cases:
        rows += [conv_case(b, conv, bw, args.reps, args.once) for conv in args.convs.split(",") for b in args.lanes]
    for r in rows:
        if r["case"] == "defer-saving":
            print(f"numba defer   {r['lanes']}x{r['cols']}  a round would save {r['saving_ms_round_min']:.3f} to "
                  f"{r['saving_ms_round_max']:.3f} ms", flush=True)
        elif "us" in r:
            print(f"{r['kernel']:5s} {r['case']:7s} {r['lanes']}x{r['cols']}  "
                  f"{r['us']:8.1f} µs  floor {r['floor_us']:7.1f} µs  x{r['x_floor']:5.2f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_tb_s": bw / 1e12,
                                              "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
