"""tools.bench_round's random shortlist head: a drafter with none on disk gets one the backend loads (the timing
itself needs a GPU: BENCHMARKS.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from tiny import TINY

from ignis.backends.dflash2.shortlist import ShortlistHead
from ignis.backends.dflash2.weights import SHORTLIST
from ignis.model.random import random_model
from tools.round_work import random_shortlist


def test_a_random_shortlist_holds_the_heads_rows_of_distinct_sorted_ids(tmp_path: Path) -> None:
    model = random_model(TINY, seed=3, mtp=False, device="cpu", dtype=torch.float32)
    random_shortlist(model, tmp_path / "drafter", 40)
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    head = ShortlistHead(tmp_path / "drafter" / SHORTLIST, hidden=hidden, vocab=vocab, device=torch.device("cpu"),
                         dtype=torch.float32)
    ids = head.token_ids
    assert ids.shape == (40,) and torch.equal(ids, ids.unique()) and int(ids.max()) < vocab
    rows = (model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight).detach()[ids]
    # 4-bit codes, one scale a group (max |w| / 7, rounded to fp16): each weight within about half a step of its row
    steps = rows.reshape(40, -1, 32).abs().amax(-1, keepdim=True) / 7
    err = (head.weight - rows).reshape(40, -1, 32).abs()
    assert (err <= steps * 0.51 + 1e-6).all()


@pytest.mark.parametrize(("kind", "head", "weights"), [
    ("dflash2", "full", "model"), ("dflash2-shortlist-int4", "shortlist", "int4"), ("dflash2-head4", "int4", "model"),
    ("dflash2-head4-int4", "int4", "int4"), ("dflash2-head4-fp8", "int4", "fp8"), ("dflash2-auto", "auto", "auto"),
    ("dflash2-g4", "full", "int4-greedy"), ("dflash2-head4-g4", "int4", "int4-greedy"),
    ("dflash2-first", "auto", "auto")])
def test_each_drafting_case_loads_the_drafter_its_name_says(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                            kind: str, head: str, weights: str) -> None:
    import tools.round_work as bench

    seen: list[tuple[str, str, str]] = []
    monkeypatch.setattr(bench, "DFlash2", lambda ctx, drafter: seen.append(
        (ctx.config.spec.backend, ctx.config.spec.draft_head, ctx.config.spec.draft_weights)))
    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "config.json").write_text("{}")  # as if on disk: no random drafter is built
    model = random_model(TINY, seed=3, mtp=False, device="cpu", dtype=torch.float32)
    bench.build_backend(kind, 7, model, tmp_path, 1, 64, torch.device("cpu"), torch.float32)
    assert seen == [("dflash2", head, weights)]


@pytest.mark.parametrize(("kind", "first"), [("dflash2-auto", ""), ("dflash2-first", "mtp")])
def test_the_first_draft_case_builds_its_random_drafter_in_that_form(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                                     kind: str, first: str) -> None:
    import tools.round_work as bench

    forms: list[str] = []
    monkeypatch.setattr(bench, "DFlash2", lambda ctx, drafter: forms.append(drafter.config.first_draft))
    model = random_model(TINY, seed=3, mtp=True, device="cpu", dtype=torch.float32)
    bench.build_backend(kind, 7, model, tmp_path, 1, 64, torch.device("cpu"), torch.float32)
    assert forms == [first]


@pytest.mark.parametrize(("kind", "packed"), [("mtp", False), ("mtp-head4", True)])
def test_the_mtp_cases_draft_through_the_head_they_name(tmp_path: Path, kind: str, packed: bool) -> None:
    import tools.round_work as bench
    from ignis.backends.mtp import Mtp

    model = random_model(TINY, seed=3, mtp=True, device="cpu", dtype=torch.float32)
    backend = bench.build_backend(kind, 7, model, tmp_path, 1, 64, torch.device("cpu"), torch.float32)
    assert isinstance(backend, Mtp) and (backend.head is not None) == packed


def test_variants_are_every_combination_and_set_the_kernel_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    from ignis.backends import base as backends
    from ignis.backends.dflash2 import ring, selector
    from ignis.kernels import attention, fused, gdn, gdn_chunk, gdn_cuda, int4_tile, launch
    from ignis.model import ops
    from ignis.quant import fp8
    from tools import variants as kernel_variants

    args = argparse.Namespace(conv_blocks="256,1024", blas="cublas", stream="off,on", gdn="numba,cuda", conv="cuda",
                              pdl="off,on", gdn_pdl="auto", trigger="early", int4_tile="on,off", fp8_kernel="mma",
                              draw="triton", drafter_conv="joined", selector="triton", attention_blocks="264",
                              replay="cuda")
    variants = kernel_variants.combinations(args)
    assert len(variants) == 32 and len({tuple(v.values()) for v in variants}) == 32
    assert variants[0] == {"conv_blocks": "256", "blas": "cublas", "stream": "off", "gdn": "numba", "conv": "cuda",
                           "pdl": "off", "gdn_pdl": "auto", "trigger": "early", "int4_tile": "on", "fp8_kernel": "mma",
                           "draw": "triton", "drafter_conv": "joined", "selector": "triton", "attention_blocks": "264",
                           "replay": "cuda"}
    libraries: list[str] = []
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", libraries.append)
    for name in ("CONV_BLOCKS", "CUDA_CONV"):
        monkeypatch.setattr(fused, name, getattr(fused, name))
    for name in ("CUDA_COLUMNS", "CUDA_NORMED", "STEP", "CHUNK_VERIFY", "CUDA_REPLAY", "CHUNK_CONV_LANES"):
        monkeypatch.setattr(gdn, name, getattr(gdn, name))
    for name in ("BLOCKS", "KEEP_K"):
        monkeypatch.setattr(gdn_cuda, name, getattr(gdn_cuda, name))
    for name in ("SHAPE", "FEW"):
        monkeypatch.setattr(gdn_chunk, name, getattr(gdn_chunk, name))
    monkeypatch.setattr(ops, "STREAMING", ops.STREAMING)
    monkeypatch.setattr(launch, "PDL", launch.PDL)
    monkeypatch.setattr(launch, "GDN_PDL", launch.GDN_PDL)
    monkeypatch.setattr(launch, "EARLY_TRIGGER", launch.EARLY_TRIGGER)
    monkeypatch.setattr(int4_tile, "TILE_ROWS", int4_tile.TILE_ROWS)
    monkeypatch.setattr(fp8, "FP8_KERNEL", fp8.FP8_KERNEL)
    monkeypatch.setattr(backends, "DRAW_COLUMNS", backends.DRAW_COLUMNS)
    monkeypatch.setattr(ring, "JOIN_CONV", ring.JOIN_CONV)
    monkeypatch.setattr(selector, "FUSED", selector.FUSED)
    monkeypatch.setattr(attention, "TARGET_BLOCKS", attention.TARGET_BLOCKS)
    shipped = int4_tile.TILE_ROWS
    kernel_variants.apply_variant(variants[-2])
    assert int4_tile.TILE_ROWS == shipped is not None
    kernel_variants.apply_variant(variants[-1])
    assert int4_tile.TILE_ROWS is None  # off: int4_mma's own warps at every row count
    assert (fused.CONV_BLOCKS, libraries, ops.STREAMING, gdn.CUDA_COLUMNS, fused.CUDA_CONV, launch.PDL) == (
        1024, ["cublas", "cublas"], True, True, True, True)
    assert launch.EARLY_TRIGGER and fp8.FP8_KERNEL == "mma" and attention.TARGET_BLOCKS == 264
    assert gdn.CUDA_REPLAY
    kernel_variants.apply_variant({**variants[-1], "replay": "numba"})
    assert not gdn.CUDA_REPLAY
    kernel_variants.apply_variant({**variants[-1], "fp8_kernel": "triton"})
    assert fp8.FP8_KERNEL == "triton"
    assert gdn.CUDA_NORMED and (gdn_cuda.BLOCKS, gdn_cuda.KEEP_K) == (4, True)
    kernel_variants.recurrence_kernel("cuda6")  # the recurrence alone, bounded for six blocks an SM: k read again
    assert gdn.CUDA_COLUMNS and not gdn.CUDA_NORMED and (gdn_cuda.BLOCKS, gdn_cuda.KEEP_K) == (6, False)
    kernel_variants.recurrence_kernel("step")  # the conv joined to the shipped recurrence's launch
    assert gdn.STEP and gdn.CUDA_COLUMNS and (gdn_cuda.BLOCKS, gdn.CUDA_NORMED) == (6, None)
    kernel_variants.recurrence_kernel("step-normed")  # the conv, the recurrence and the gated norm in one launch
    assert gdn.STEP and gdn.CUDA_NORMED
    kernel_variants.recurrence_kernel("numba")
    assert not gdn.CUDA_COLUMNS and not gdn.STEP and not gdn.CHUNK_VERIFY  # a verify's columns one by one too
    kernel_variants.recurrence_kernel("chunk2x8")  # as shipped, a verify in chunk form: 2 columns a thread, 8 slices
    assert gdn.CHUNK_VERIFY and gdn.CUDA_COLUMNS and gdn_chunk.SHAPE == gdn_chunk.FEW == (2, 8, 2)
    kernel_variants.recurrence_kernel("columns")  # as shipped, a verify's columns one by one
    assert not gdn.CHUNK_VERIFY and gdn.STEP and (gdn_chunk.SHAPE, gdn_chunk.FEW) == ((2, 4, 4), (2, 8, 2))
    kernel_variants.recurrence_kernel("auto")
    assert gdn.CHUNK_VERIFY and (gdn_chunk.SHAPE, gdn_chunk.FEW) == ((2, 4, 4), (2, 8, 2))
    with pytest.raises(ValueError, match="--gdn"):
        kernel_variants.recurrence_kernel("cuda9")
    draws = kernel_variants.combinations(argparse.Namespace(**{**vars(args), "draw": "torch,triton,torch"}))
    assert [v["draw"] for v in draws[:3]] == ["torch", "triton", "torch"]  # a word may repeat: arms alternate
    kernel_variants.apply_variant(draws[0])
    assert backends.DRAW_COLUMNS == 0  # the torch reference's launches
    kernel_variants.apply_variant(draws[1])
    assert backends.DRAW_COLUMNS == 64 and ring.JOIN_CONV
    kernel_variants.apply_variant({**draws[1], "drafter_conv": "apart"})
    assert not ring.JOIN_CONV and selector.FUSED
    kernel_variants.apply_variant({**draws[1], "selector": "torch"})
    assert not selector.FUSED  # the numba top-k and torch's ops after the head


def test_every_case_is_timed_before_any_is_profiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """A round timed after a torch.profiler session shows a larger host part, so bench_model times every case before
    it profiles any; a case that fails keeps the others, and a failed profile keeps its case's timings."""
    from types import SimpleNamespace

    from tools import bench_round

    events: list[str] = []

    def fake_case(label, case, *_):  # type: ignore[no-untyped-def]
        name = f"{case.name} {case.lanes}x{case.k + 1}"
        if name == "verify 1x8":
            raise RuntimeError("cannot run")
        events.append(f"time {name}")
        return {"model": label, "case": case.name, "lanes": case.lanes, "cols": case.k + 1, "eager_ms": 2.0,
                "graph_ms": 1.0, "replay_ms": 1.0, "followed_ms": 1.0, "floor_ms": 1.0, "x_floor": 1.0,
                "x_floor_followed": 1.0, "host_split": {}}

    def fake_profile(case, *_):  # type: ignore[no-untyped-def]
        name = f"{case.name} {case.lanes}x{case.k + 1}"
        events.append(f"profile {name}")
        if name == "decode 8x1":
            raise RuntimeError("no profile")
        return {"gpu_ms_eager": 1.0, "kernels": 3, "top_kernels": [], "graph_gpu_ms": 0.0, "graph_top_kernels": []}

    monkeypatch.setattr(bench_round, "bench_case", fake_case)
    monkeypatch.setattr(bench_round, "profile_case", fake_profile)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    rope = SimpleNamespace(precompute=lambda *a: None)
    model = SimpleNamespace(embed_tokens=SimpleNamespace(weight=torch.zeros(1)), rope=rope, mtp=None)
    args = argparse.Namespace(cases="decode,verify", lanes=[1, 8], context=64)
    rows = bench_round.bench_model("m", model, Path("."), 1.0, args, torch.device("cpu"))  # type: ignore[arg-type]
    timed = [e for e in events if e.startswith("time")]
    assert events[: len(timed)] == timed and len(timed) == 3, events
    assert [r["case"] + str(r["lanes"]) for r in rows] == ["decode1", "decode8", "verify1", "verify8"]  # cases' order
    assert rows[0]["kernels"] == 3 and "profile_error" in rows[1] and rows[1]["graph_ms"] == 1.0 and "error" in rows[2]
    # any lane count a case is asked at, each case at each
    events.clear()
    args = argparse.Namespace(cases="dflash2,dflash2-h4", lanes=[2, 3], context=64)
    rows = bench_round.bench_model("m", model, Path("."), 1.0, args, torch.device("cpu"))  # type: ignore[arg-type]
    assert [r["case"] + str(r["lanes"]) for r in rows] == ["dflash22", "dflash23", "dflash2-h42", "dflash2-h43"]


def test_clocks_summarise_what_nvml_reported_while_a_case_was_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    """tools.gpu_clocks.Clocks against a fake NVML: medians, the lowest SM clock, the hottest reading and the capping
    reasons seen (idle aside); without NVML it records nothing and the benchmark goes on."""
    import sys
    import time
    from types import SimpleNamespace

    from tools import gpu_clocks

    readings = iter([(1980, 0x0), (1755, 0x4), (1980, 0x1)] * 1000)
    state = {"sm": 1980, "bits": 0}

    def clock(handle, which):  # type: ignore[no-untyped-def]
        if which == "sm":
            state["sm"], state["bits"] = next(readings)
            return state["sm"]
        return 3201

    fake = SimpleNamespace(nvmlInit=lambda: None, nvmlDeviceGetHandleByIndex=lambda i: i, NVML_CLOCK_SM="sm",
                           NVML_CLOCK_MEM="mem", NVML_TEMPERATURE_GPU=0, nvmlDeviceGetClockInfo=clock,
                           nvmlDeviceGetPowerUsage=lambda h: 412_000, nvmlDeviceGetTemperature=lambda h, s: 61,
                           nvmlDeviceGetCurrentClocksEventReasons=lambda h: state["bits"])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    with gpu_clocks.Clocks(0, period=0.001) as clocks:
        time.sleep(0.05)
    s = clocks.summary()
    assert s["samples"] >= 3 and s["sm_mhz_min"] == 1755 and s["mem_mhz"] == 3201 and s["power_w"] == 412.0
    assert s["temp_c_max"] == 61 and s["capped_by"] == ["sw_power_cap"]
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: import fails
    with gpu_clocks.Clocks(0) as clocks:
        pass
    assert clocks.summary() == {}


def test_a_4bit_targets_floor_counts_its_codes_scales_and_zeros() -> None:
    """`--models 27b-int4`: the target packed as `ignis quantize --head` packs it; its floor reads the packed
    projections and head (codes, scales, zero points) and the 16-bit tensors left, not the 16-bit weights."""
    from ignis.quant.linear import QuantLinear
    from tools.round_work import floor_bytes, pack_int4

    model = random_model(TINY, seed=3, mtp=False, device="cpu", dtype=torch.bfloat16)
    dense = floor_bytes(model, 0, 8)  # no lanes: the weights alone
    pack_int4(model)
    packed = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert packed  # the projections whose inputs groups of 128 divide (this small model's head takes 64: kept)
    skip = "embed_tokens.weight" if model.lm_head is not None else ""
    held = sum(p.nbytes for n, p in model.named_parameters() if n != skip)
    held += sum(t.nbytes for m in packed for t in m.buffers(recurse=False))
    assert floor_bytes(model, 0, 8) == held < dense


def test_followed_rounds_queue_each_round_before_reading_the_last(monkeypatch: pytest.MonkeyPatch) -> None:
    """time_followed runs the rounds as engine.async_scheduling does: a run of FOLLOWED rounds loads the lanes once,
    queues each later round from the last one before waiting for and reading the last, and reads the final one."""
    from tools import round_timing

    calls: list[str] = []

    class Rounds:
        def start(self, work):  # type: ignore[no-untyped-def]
            calls.append("start")
            return 0

        def follow(self, launched):  # type: ignore[no-untyped-def]
            calls.append(f"follow {launched}")
            return launched + 1

        def wait(self, launched):  # type: ignore[no-untyped-def]
            calls.append(f"wait {launched}")

        def collect(self, launched):  # type: ignore[no-untyped-def]
            calls.append(f"read {launched}")

    monkeypatch.setattr(round_timing, "FOLLOWED", 3)
    assert round_timing.time_followed(Rounds(), [], iters=1) >= 0.0  # type: ignore[arg-type]
    run = ["start", "follow 0", "wait 0", "read 0", "follow 1", "wait 1", "read 1", "wait 2", "read 2"]
    assert calls == run * 3  # two warm-up runs and the timed one
