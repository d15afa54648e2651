"""Keeping only the committed prefix of a Gated DeltaNet layer's state: select versus replay, in memory and time.

select: the verify pass writes the state after every column to scratch, and commit copies the chosen one.
replay: the verify pass keeps only each column's (q, k, v, g, beta), and commit re-runs the committed columns from
        the state before the round.
Both run the same per-token recurrence (ignis.model.delta_rule.recurrent_step) at a real layer's shape; the tool
prints per-layer time for a verify plus commit, the extra memory each strategy holds per lane, and the ratio.

    python -m tools.bench_state --lanes 1 --lanes 8 --draft-tokens 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from ignis.model.delta_rule import recurrent_step


def _inputs(lanes: int, cols: int, hv: int, dk: int, dv: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(lanes, cols, hv, dk, generator=g), dim=-1).to(device) * dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(lanes, cols, hv, dk, generator=g), dim=-1).to(device)
    v = torch.randn(lanes, cols, hv, dv, generator=g).to(device)
    decay = -torch.rand(lanes, cols, hv, generator=g).to(device)
    beta = torch.rand(lanes, cols, hv, generator=g).to(device)
    return q, k, v, decay, beta


def select(state: torch.Tensor, scratch: torch.Tensor, x: tuple[torch.Tensor, ...], accepted: int) -> torch.Tensor:
    q, k, v, g, b = x
    s = state
    for j in range(q.shape[1]):
        s, _ = recurrent_step(s, q[:, j], k[:, j], v[:, j], g[:, j], b[:, j])
        scratch[:, j].copy_(s)
    state.copy_(scratch[:, accepted])
    return state


def replay(state: torch.Tensor, x: tuple[torch.Tensor, ...], accepted: int) -> torch.Tensor:
    q, k, v, g, b = x
    s = state
    for j in range(q.shape[1]):  # verify: outputs only, nothing kept but the inputs
        s, _ = recurrent_step(s, q[:, j], k[:, j], v[:, j], g[:, j], b[:, j])
    s = state
    for j in range(accepted + 1):  # commit: the kept columns again, from the state before the round
        s, _ = recurrent_step(s, q[:, j], k[:, j], v[:, j], g[:, j], b[:, j])
    state.copy_(s)
    return state


def _time(fn, reps: int) -> float:
    if torch.cuda.is_available():
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) * 1000)
        return statistics.median(times)
    import time

    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench_state")
    ap.add_argument("--lanes", type=int, action="append", default=None)
    ap.add_argument("--draft-tokens", type=int, default=7)
    ap.add_argument("--value-heads", type=int, default=48)  # Qwen3.5-27B: 48 value heads of 128 x 128
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--gdn-layers", type=int, default=48)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hv, d, cols = args.value_heads, args.head_dim, args.draft_tokens + 1
    rows = []
    for lanes in args.lanes or [1, 8]:
        x = _inputs(lanes, cols, hv, d, d, device)
        state = torch.zeros(lanes, hv, d, d, device=device)
        scratch = torch.zeros(lanes, cols, hv, d, d, device=device)
        state_mib = state[0].nbytes / 2**20
        inputs_mib = sum(t[0].nbytes for t in x) / 2**20
        for accepted in (0, args.draft_tokens // 2, args.draft_tokens):
            for fn in (lambda: select(state, scratch, x, accepted), lambda: replay(state, x, accepted)):
                fn()  # warm-up
            t_sel = _time(lambda: select(state, scratch, x, accepted), args.reps)
            t_rep = _time(lambda: replay(state, x, accepted), args.reps)
            row = {
                "lanes": lanes, "draft_tokens": args.draft_tokens, "accepted": accepted,
                "select_us_per_layer": round(t_sel, 1), "replay_us_per_layer": round(t_rep, 1),
                "replay_over_select": round(t_rep / t_sel, 3),
                "select_extra_mib_per_lane_all_layers": round(cols * state_mib * args.gdn_layers, 1),
                "replay_extra_mib_per_lane_all_layers": round(inputs_mib * args.gdn_layers, 2),
            }
            rows.append(row)
            print(row, flush=True)
    print(json.dumps({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
