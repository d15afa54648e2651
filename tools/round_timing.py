"""How the round benchmarks time things on one device: the copy and read bandwidths the floors use, a round through
`DeviceRound.run` (host work and its read-back included), rounds followed as the engine runs them with
engine.async_scheduling, a graph's replays back to back, where a round's time past its replay goes (`host_split`), and
a call's kernels from the profiler. tools.bench_round, bench_quant, bench_prefill and the other benchmarks share them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from ignis.engine.device_round import DeviceRound
from ignis.engine.scheduler import Decode


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
