"""tools.bench_quant's in-memory conversions make the models the loader makes: a fused model packed in place equals
the same weights converted to a checkpoint by `ignis quantize` and loaded, and converted to fp8 in place equals the
loader's fp8 conversion (so the benchmark's 27B-shape decode steps time the engine's own models)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny import TINY

from ignis.model.loader import load_model
from ignis.model.random import save_random_checkpoint
from ignis.quant.convert import convert
from ignis.quant.fp8 import to_fp8
from ignis.quant.linear import Permuted
from tools.bench_quant import act_order, fuse_and_own, to_int4
from tools.quant_quality import prefill_logits


def test_in_place_int4_and_fp8_equal_the_loaders(tmp_path: Path) -> None:
    save_random_checkpoint(tmp_path / "src", TINY, seed=5, mtp=False)
    convert(tmp_path / "src", tmp_path / "int4", group=64)
    ids = torch.randint(3, 512, (30,), generator=torch.Generator().manual_seed(2))

    model = load_model(tmp_path / "src", device="cpu", dtype=torch.float32, exact=False)  # fused, as random_model's
    dense = prefill_logits(model, ids)
    assert to_int4(model, 64) == 6 * 3 + 2 * 4 + 8 * 3
    fuse_and_own(model)
    loaded = load_model(tmp_path / "int4", device="cpu", dtype=torch.float32, exact=False)
    torch.testing.assert_close(prefill_logits(model, ids), prefill_logits(loaded, ids), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(prefill_logits(model, ids), dense, rtol=1e-3, atol=1e-3)  # it did change the model
    # --act-order-ab: the same codes held in act-order form, every product gathering x first; the model's function
    # stays (its sums only run in another order), and projections of one input stay fused under one order
    int4 = prefill_logits(model, ids)
    assert act_order(model) == 6 * 3 + 2 * 4 + 8 * 3
    fused = [m.qkv_proj for m in model.modules() if hasattr(m, "qkv_proj")]
    assert fused and all(isinstance(w, Permuted) for w in fused)
    torch.testing.assert_close(prefill_logits(model, ids), int4, rtol=1e-5, atol=1e-5)

    model = load_model(tmp_path / "src", device="cpu", dtype=torch.float32, exact=False)
    to_fp8(model)
    fuse_and_own(model)
    loaded = load_model(tmp_path / "src", device="cpu", dtype=torch.float32, exact=False, fp8=True)
    torch.testing.assert_close(prefill_logits(model, ids), prefill_logits(loaded, ids), rtol=1e-5, atol=1e-5)


def test_triton_sweep_configs_and_summary() -> None:
    """--sweep-triton times the table's choice first and only launch shapes the kernel takes; the summary names the
    fastest config a (shape, rows) beside the table's."""
    from dataclasses import asdict

    from ignis.kernels.int4_triton import check, choose
    from tools.quant_summary import summary
    from tools.quant_products import SHAPES, triton_configs

    for _, nout, ncols in SHAPES:
        for rows in (1, 8, 64):
            configs = triton_configs(rows, nout, ncols, 128, 132)
            assert configs[0] == choose(rows, nout, ncols, 128, 132) and len(set(configs)) == len(configs) > 8
            for c in configs:
                check(c, ncols, 128)
    c0, c1 = triton_configs(8, 5120, 17408, 128, 132)[:2]
    sweep = [{"shape": "mlp down", "rows": 8, "table": True, **asdict(c0), "ms": 0.02, "x_floor": 2.0},
             {"shape": "mlp down", "rows": 8, "table": False, **asdict(c1), "ms": 0.01, "x_floor": 1.0},
             {"shape": "mlp down", "rows": 8, "table": False, **asdict(c1), "error": "out of resources"}]
    line, = summary({"sweep_triton": sweep})
    assert line.startswith("Triton sweep, mlp down,  8 rows: best x1.00") and line.endswith("the table's x2.00")


def test_policies_are_valid_launches_and_summarised() -> None:
    """--policies: every candidate is a launch the kernel takes at every 27B shape, the first is the table's, and
    the summary names the best beside it."""
    from ignis.kernels import int4_triton as it
    from tools.quant_summary import summary
    from tools.quant_products import POLICIES, SHAPES, STEP_COUNTS

    assert POLICIES[0] == (*it.TABLE[16], it.PROGRAMS_PER_SM) and set(STEP_COUNTS) == {n for n, _, _ in SHAPES}
    saved = dict(it.TABLE)
    try:
        for bn, warps, stages, pps in POLICIES:
            it.tune({16: (bn, warps, stages), 32: (bn, warps, stages)}, pps)
            for _, nout, ncols in SHAPES:
                for rows in (1, 8):
                    c = it.choose(rows, nout, ncols, 128, 132)
                    assert (c.block_n, c.warps, c.stages) == (bn, warps, stages)
                    it.check(c, ncols, 128)
    finally:
        it.tune(saved, it.PROGRAMS_PER_SM)
    assert it.choose(1, 34816, 5120, 128, 132) == it.Config(16, *saved[16][:1], 128, 1, *saved[16][1:])
    sums = [{"policy": [128, 4, 4, 2], "step_ms_1": 4.0, "step_ms_8": 4.2},
            {"policy": [64, 4, 4, 4], "step_ms_1": 2.0, "step_ms_8": 2.1}]
    line, = summary({"policies": {"rows": [], "sums": sums, "best": sums[1]}})
    assert line == ("Triton policies: best (64, 4, 4, 4) (block_n, warps, stages, programs a SM): a decode step's int4 "
                    "products 2.000 ms at 1 row and 2.100 at 8; the table's (128, 4, 4, 2) 4.000 and 4.200")


def test_gemv_sweep_launches_and_summary() -> None:
    """tools.bench_gemv times the default launch first and only launches the kernel takes at every product it
    sweeps; the summary names each form's fastest launch and its speed against cuBLAS."""
    from ignis.kernels.gemv_triton import choose
    from tools.bench_gemv import PRODUCTS, launches, summary

    for _, nout, ncols in PRODUCTS:
        configs = launches(nout, ncols, 132, rows=1)
        assert configs[0] == choose(nout, ncols, 132) and len(set(configs)) == len(configs) >= 7
        assert {c.block_m for c in configs} == {16}  # one row: only the 16-row tile
        wide = launches(nout, ncols, 132, rows=64)
        assert wide[: len(configs)] == configs and {c.block_m for c in wide} == {16, 32, 64}
        for c in wide:
            assert ncols % c.block_k == 0 and (ncols // c.block_k) % c.split_k == 0
    base = {"product": "mlp down", "rows": 1, "floor_ms": 0.04}
    rows = [{**base, "form": "bf16 cublas", "ms": 0.05, "x_floor": 1.25, "config": None, "default": None},
            {**base, "form": "bf16 triton", "ms": 0.06, "x_floor": 1.5, "config": {"block_n": 64}, "default": True},
            {**base, "form": "bf16 triton", "ms": 0.04, "x_floor": 1.0, "config": {"block_n": 32}, "default": False},
            {**base, "form": "bf16 triton", "error": "out of resources", "config": {"block_n": 256}, "default": False}]
    line, = summary(rows)
    assert line == ("mlp down rows 1: cuBLAS 50.0 us (x1.25); bf16 triton best 40.0 us (x1.00, 1.25x cuBLAS's speed) "
                    "at {'block_n': 32}, default 60.0 us")


def test_mma_sweep_splits_and_summary() -> None:
    """--sweep-mma times int4_mma's own launch first, then only splits of the input the kernel takes (every part at
    least a unit, at most 1,024 threads, counters within the device's), each once; the summary names the fastest a
    (shape, rows) beside the chosen one."""
    import math
    from dataclasses import asdict

    from ignis.kernels.int4_mma import launch, ringed, row_tiles, split
    from ignis.kernels.launch import SPLIT_COUNTERS
    from tools.quant_summary import summary
    from tools.quant_products import SHAPES, mma_shapes

    for _, nout, ncols in SHAPES:
        for rows in (1, 8):
            shapes = mma_shapes(nout, ncols, 128, 132, rows)
            plain = launch(split(nout, ncols, 128, 132), row_tiles(rows))
            assert shapes[0] == ringed(plain, row_tiles(rows), nout, ncols, 128)  # what int4_mma runs
            assert plain in shapes and not any(s.ring for s in shapes[1:])  # the rest on the plain loop
            assert len(set(shapes)) == len(shapes) > 6
            units = ncols // (64 * shapes[0].unit)
            for s in shapes:
                assert s.ks * s.kw <= units and 32 * s.kw * s.rb <= 1024 and s.unit == shapes[0].unit
                assert s.ks == 1 or math.ceil(nout // 16 / (s.rb * s.f)) <= SPLIT_COUNTERS
    o_proj = mma_shapes(5120, 6144, 128, 132, 1)
    assert {s.ks for s in o_proj} == {1, 2, 3, 4}  # the product whose blocks leave a wave part-empty gets every split
    s0, s1 = o_proj[:2]
    sweep = [{"shape": "o_proj", "rows": 1, "chosen": True, **asdict(s0), "ms": 0.008, "x_floor": 2.0},
             {"shape": "o_proj", "rows": 1, "chosen": False, **asdict(s1), "ms": 0.005, "x_floor": 1.25},
             {"shape": "o_proj", "rows": 1, "chosen": False, **asdict(s1), "error": "out of resources"}]
    line, = summary({"sweep_mma": sweep})
    assert line == (f"mma sweep, o_proj,  1 rows: best x1.25 (ks {s1.ks} kw {s1.kw}), the chosen x2.00 (ks {s0.ks} kw "
                    f"{s0.kw})")


def test_the_hot_sweep_is_summarised_cold_one_copy_then_windowed() -> None:
    """--sweep-hot's rows (a failed launch left out) become one line a (shape, rows): x floor from DRAM, from one copy,
    then windowed."""
    from tools.quant_summary import summary

    sweep = [{"shape": "o_proj", "rows": 1, "form": "cold", "ms": 0.0072, "x_floor": 1.31},
             {"shape": "o_proj", "rows": 1, "form": "one copy", "ms": 0.0066, "x_floor": 1.19},
             {"shape": "o_proj", "rows": 1, "form": "window", "ms": 0.0059, "x_floor": 1.07},
             {"shape": "o_proj", "rows": 8, "form": "cold", "error": "out of resources"}]
    assert summary({"sweep_hot": sweep}) == [
        "mma from DRAM, one copy and windowed, o_proj,  1 rows: cold x1.31, one copy x1.19, window x1.07"]


def test_the_hot_sweep_sums_a_decode_steps_products_as_the_step_runs_them() -> None:
    """Where all five products are timed in a form, the summary adds their time over their floor together, each
    counted as often as a 27B decode step runs it (STEP_COUNTS): a form missing a product is left out."""
    from tools.quant_summary import summary
    from tools.quant_products import SHAPES, STEP_COUNTS

    sweep = []
    for i, (name, _, _) in enumerate(SHAPES):
        sweep.append({"shape": name, "rows": 1, "form": "cold", "ms": 0.01 * (i + 1), "x_floor": 1.0 + 0.1 * i})
        if i:  # the windowed form lacks the first product
            sweep.append({"shape": name, "rows": 1, "form": "window", "ms": 0.01, "x_floor": 1.0})
    ms = sum(STEP_COUNTS[name] * 0.01 * (i + 1) for i, (name, _, _) in enumerate(SHAPES))
    floor = sum(STEP_COUNTS[name] * 0.01 * (i + 1) / (1.0 + 0.1 * i) for i, (name, _, _) in enumerate(SHAPES))
    assert summary({"sweep_hot": sweep})[-1] == (
        f"mma from DRAM, a decode step's products together,  1 rows: cold x{ms / floor:.2f}")
    assert f"x{ms / floor:.2f}" != "x1.00" and "window" not in summary({"sweep_hot": sweep})[-1]


def test_the_mma_loads_sweep_changes_only_what_leaves_the_sums_alone() -> None:
    """--sweep-mma-loads times int4_mma's own launch first, then its step's chunks (divisors of the unit holding whole
    groups), loads ahead (0-3), feature blocks a warp (the chosen F or 1), at one row tile the ring loop and, above 8
    rows, warps sharing x (RB 2, 4) where they fit, each once, with the split (KS, KW, unit) as chosen: no launch it
    times changes a row's bits. The summary names the fastest beside the chosen one."""
    from dataclasses import asdict

    from ignis.kernels.int4_mma import SHARED, launch, ringed, row_tiles, split
    from tools.quant_summary import summary
    from tools.quant_products import SHAPES, mma_loads

    for _, nout, ncols in SHAPES:
        for rows in (1, 8, 16, 64):
            base = launch(split(nout, ncols, 128, 132), row_tiles(rows))
            shapes = mma_loads(nout, ncols, 128, 132, rows)
            assert shapes[0] == ringed(base, row_tiles(rows), nout, ncols, 128)  # what int4_mma runs
            assert base in shapes and len(set(shapes)) == len(shapes) >= 4
            for s in shapes:
                assert (s.ks, s.kw, s.unit, s.rb) == (base.ks, base.kw, base.unit, base.rb)
                assert s.f in (1, base.f) or s.rg > 1
                assert base.unit % s.u == 0 and (64 * s.u) % 128 == 0 and 0 <= s.ahead <= 3
                assert s.rg == 1 or (s.rg <= row_tiles(rows)
                                     and (s.kw - 1) * s.f * row_tiles(rows) // s.rg * 512 <= SHARED)
            assert rows > 8 or all(s.rg == 1 for s in shapes)
            assert (rows <= 8) == any(s.ring for s in shapes)  # the ring loop at one row tile only
    assert {s.rg for s in mma_loads(34816, 5120, 128, 132, 64)} == {1, 2, 4, 8}  # gate_up at 64 rows
    assert {s.rg for s in mma_loads(34816, 5120, 128, 132, 16)} == {1, 2}
    ring = next(s for s in mma_loads(5120, 6144, 128, 132, 1) if s.ring)
    line, = summary({"sweep_mma_loads": [{"shape": "o_proj", "rows": 1, "chosen": False, **asdict(ring), "ms": 0.006,
                                          "x_floor": 1.5}]})
    assert f"(ks 1 kw 8 f 1 u {ring.u} ahead {ring.ahead} rg 1 ring)" in line
    xring = next(s for s in mma_loads(5120, 6144, 128, 132, 1) if s.xring)
    line, = summary({"sweep_mma_loads": [{"shape": "o_proj", "rows": 1, "chosen": False, **asdict(xring),
                                          "ms": 0.006, "x_floor": 1.5}]})
    assert f"u {xring.u} ahead {xring.ahead} rg 1 ring xring)" in line
    s0, s1 = mma_loads(5120, 6144, 128, 132, 1)[:2]
    sweep = [{"shape": "o_proj", "rows": 1, "chosen": True, **asdict(s0), "ms": 0.008, "x_floor": 2.0},
             {"shape": "o_proj", "rows": 1, "chosen": False, **asdict(s1), "ms": 0.006, "x_floor": 1.5}]
    line, = summary({"sweep_mma_loads": sweep})
    assert line == (f"mma loads, o_proj,  1 rows: best x1.50 (ks {s1.ks} kw {s1.kw} f {s1.f} u {s1.u} ahead "
                    f"{s1.ahead} rg 1), the chosen "
                    f"x2.00 (f {s0.f} u {s0.u} ahead {s0.ahead} rg 1 ring)")  # o_proj ships on the ring


def test_a_windowed_sweep_names_the_fastest_launch_from_l2_beside_its_cold_figure() -> None:
    """With --window each swept launch carries its windowed figures too; the summary adds, a (shape, rows), the
    launch fastest windowed with its cold figure, beside the chosen one's (a launch timed cold only is left out)."""
    from dataclasses import asdict

    from tools.quant_summary import summary
    from tools.quant_products import mma_loads

    s0, s1, s2 = mma_loads(5120, 6144, 128, 132, 1)[:3]
    sweep = [{"shape": "o_proj", "rows": 1, "chosen": True, **asdict(s0), "ms": 0.007, "x_floor": 1.3,
              "ms_window": 0.006, "x_floor_window": 1.07},
             {"shape": "o_proj", "rows": 1, "chosen": False, **asdict(s1), "ms": 0.009, "x_floor": 1.6,
              "ms_window": 0.005, "x_floor_window": 0.9},
             {"shape": "o_proj", "rows": 1, "chosen": False, **asdict(s2), "ms": 0.004, "x_floor": 0.8}]
    windowed, cold = summary({"sweep_mma_loads": sweep})
    assert windowed == (f"mma loads windowed, o_proj,  1 rows: best x0.90 (cold x1.60; ks {s1.ks} kw {s1.kw} f {s1.f} "
                        f"u {s1.u} ahead {s1.ahead} rg 1), the chosen x1.07 (cold x1.30)")
    assert cold.startswith("mma loads, o_proj,  1 rows: best x0.80")


def test_the_deep_sweep_takes_every_split_onto_the_ring_at_one_row_tile_only() -> None:
    from tools.quant_products import DEEP_RINGS, SHAPES, mma_deep, mma_shapes

    for _, nout, ncols in SHAPES:
        splits = {(s.ks, s.kw) for s in mma_shapes(nout, ncols, 128, 132, 1)}
        one = mma_deep(nout, ncols, 128, 132, 1)
        assert {(s.ks, s.kw, s.u, s.ahead, s.xring) for s in one if s.ring} == {
            (ks, kw, *ring) for ks, kw in splits for ring in DEEP_RINGS}
        assert not any(s.ring for s in mma_deep(nout, ncols, 128, 132, 16))


def test_a_decode_steps_floor_counts_every_packed_byte_once() -> None:
    """The 27B decode step's floor (step_floor_bytes): a 4-bit model's codes, scales and zero points once (round_work's
    floor_bytes already holds them) in place of the dense weights they replace, an fp8 model's weights and scales
    once; and a model packed before fusing (as the A/Bs without a bf16 step build it) has the fused-first one's
    weights."""
    from ignis.model.random import random_model
    from ignis.quant.fp8 import Fp8Linear
    from ignis.quant.linear import QuantLinear
    from tools.bench_quant import step_floor_bytes
    from tools.round_work import floor_bytes

    dense = random_model(TINY, seed=0, mtp=False, device="cpu", dtype=torch.bfloat16)
    models = []
    for fuse in (True, False):
        model = random_model(TINY, seed=0, mtp=False, device="cpu", dtype=torch.bfloat16, fuse=fuse)
        to_int4(model, 64)
        fuse_and_own(model)
        names = [n for n, m in model.named_modules() if isinstance(m, QuantLinear)]
        replaced = sum(dense.get_submodule(n).weight.nbytes for n in names)
        packed = sum(b.nbytes for n in names for b in model.get_submodule(n).buffers())
        assert names and step_floor_bytes(model, 1, 1) == floor_bytes(dense, 1, 1) - replaced + packed
        models.append(model)
    assert all(torch.equal(a, b) for a, b in zip(models[0].state_dict().values(), models[1].state_dict().values()))
    assert to_fp8(dense) > 0
    fp8 = sum(b.nbytes for m in dense.modules() if isinstance(m, Fp8Linear) for b in m.buffers())
    assert fp8 > 0 and step_floor_bytes(dense, 1, 1) == floor_bytes(dense, 1, 1) + fp8


def test_the_ring_ab_switches_only_its_products_and_puts_the_policy_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """--ring-ab "off": the spec's products on the plain loop and choose's split, every other product as shipped;
    "on": the spec's ring launches and splits too; the shipped policy in force again after, whatever the steps did."""
    from ignis.kernels import int4_mma
    from tools.quant_arms import ring_ab, ring_launches, splits

    shipped_rings, shipped_splits = {(5120, 6144): (2, 2, False), (16384, 5120): (2, 1, True)}, {(14336, 5120): (1, 4)}
    monkeypatch.setattr(int4_mma, "RING_LAUNCHES", shipped_rings)
    monkeypatch.setattr(int4_mma, "SPLITS", shipped_splits)
    seen = []

    def step(label: str) -> dict[str, float]:
        seen.append((label, dict(int4_mma.RING_LAUNCHES), dict(int4_mma.SPLITS)))
        return {"graph_ms": 1.0, "replay_ms": 1.0}

    out = ring_ab(step, "o_proj:2:1:1,mlp down:2:2:0:1:8")
    assert list(out) == ["int4_head_ring_off", "int4_head_ring_on", "int4_head_ring_off_again",
                         "int4_head_ring_on_again"]
    off = ({(16384, 5120): (2, 1, True)}, {(14336, 5120): (1, 4)})
    on = ({(16384, 5120): (2, 1, True), (5120, 6144): (2, 1, True), (5120, 17408): (2, 2, False)},
          {(14336, 5120): (1, 4), (5120, 17408): (1, 8)})
    assert [state[1:] for state in seen] == [off, on, off, on]
    assert int4_mma.RING_LAUNCHES is shipped_rings and int4_mma.SPLITS is shipped_splits
    assert splits("mlp down:1:8,attn:1:2") == {(5120, 17408): (1, 8), (14336, 5120): (1, 2)}
    for bad in ("o_proj:2:2", "nothing:2:2:0"):
        with pytest.raises(ValueError):
            ring_launches(bad)
    with pytest.raises(ValueError):
        splits("mlp down:1")


def test_the_shape_ab_takes_one_shapes_entries_away_and_puts_them_back() -> None:
    """--shape-ab's "without" arm: the product's shape missing from RING_LAUNCHES, SPLITS and SHAPE_TILES, every other
    entry kept; the shipped dicts themselves in force again after, also when the timing fails; a name that is no
    product is refused before any GPU work. --sweep-fixed's line is the least-squares one."""
    from ignis.kernels import int4_mma, int4_tile
    from tools.bench_quant import main
    from tools.quant_launch import _line, product_shape, without

    down = product_shape("mlp down")
    assert down == (5120, 17408)
    kept = int4_mma.RING_LAUNCHES, int4_mma.SPLITS, int4_tile.SHAPE_TILES
    assert all(down in d for d in kept)  # what ships for mlp down
    with pytest.raises(RuntimeError), without(down):
        assert not any(down in d for d in (int4_mma.RING_LAUNCHES, int4_mma.SPLITS, int4_tile.SHAPE_TILES))
        assert int4_mma.RING_LAUNCHES == {k: v for k, v in kept[0].items() if k != down} != {}
        raise RuntimeError("a timing that fails")
    assert (int4_mma.RING_LAUNCHES, int4_mma.SPLITS, int4_tile.SHAPE_TILES) == kept
    assert all(a is b for a, b in zip((int4_mma.RING_LAUNCHES, int4_mma.SPLITS, int4_tile.SHAPE_TILES), kept))
    with pytest.raises(ValueError, match="no 27B product named 'down'"):
        main(["--out", "unused.json", "--shape-ab", "down"])
    assert _line([(1.0, 3.0), (2.0, 5.0), (4.0, 9.0)]) == pytest.approx((1.0, 2.0))


def test_a_candidate_launch_replaces_one_products_entries_for_its_arm_only() -> None:
    """--candidate "U:AHEAD:XRING[:KS:KW]": `trying` gives the product that ring launch (and split, where named; its
    shipped split where not) and leaves every other product's; both dicts are the shipped ones again after, also when
    the arm fails; a malformed candidate, or one without --shape-ab, is refused before any GPU work."""
    from ignis.kernels import int4_mma
    from tools.bench_quant import main
    from tools.quant_launch import Candidate, product_shape, trying

    in_proj = product_shape("gdn in_proj")
    kept = int4_mma.RING_LAUNCHES, int4_mma.SPLITS
    candidate = Candidate.parse("2:2:1:1:2")
    assert candidate == Candidate((2, 2, True), (1, 2))
    with pytest.raises(RuntimeError), trying(in_proj, candidate):
        assert int4_mma.RING_LAUNCHES == {**kept[0], in_proj: (2, 2, True)}
        assert int4_mma.SPLITS == {**kept[1], in_proj: (1, 2)}
        raise RuntimeError("a timing that fails")
    assert int4_mma.RING_LAUNCHES is kept[0] and int4_mma.SPLITS is kept[1]
    with trying(in_proj, Candidate.parse("2:1:0")):
        assert int4_mma.RING_LAUNCHES[in_proj] == (2, 1, False) and int4_mma.SPLITS is kept[1]
    for bad in ("2:2", "2:x:1", "2:2:1:1"):
        with pytest.raises(ValueError, match="--candidate takes"):
            Candidate.parse(bad)
    with pytest.raises(ValueError, match="--shape-ab"):
        main(["--out", "unused.json", "--candidate", "2:2:1"])


def test_an_ab_keeps_every_arm_it_times_however_often_a_value_comes_back() -> None:
    """`ab`'s arms alternated three times: six steps, six entries (a value met a third time got its own key, not the
    second's), the switch put back after."""
    import types

    from tools.quant_arms import ab

    module = types.SimpleNamespace(FLAG=False)
    seen = []

    def step(label: str) -> dict[str, float]:
        seen.append(module.FLAG)
        return {"graph_ms": float(len(seen)), "replay_ms": 1.0}

    out = ab(step, "flag", module, "FLAG", (False, True) * 3, "flag")
    assert list(out) == ["flag_False", "flag_True", "flag_False_again", "flag_True_again", "flag_False_again2",
                         "flag_True_again2"]
    assert [r["graph_ms"] for r in out.values()] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert seen == [False, True] * 3 and module.FLAG is False


def test_the_blocks_sweep_times_a_launch_at_one_two_and_three_blocks_an_sm_beside_its_own() -> None:
    """--sweep-blocks: mlp down's and o_proj's launches at their own 5,120 outputs (2.42 blocks of threads an SM on
    132 SMs) and at widths of exactly 1, 2 and 3 an SM; the products it names are the 27B's 5,120-output ones."""
    from tools.quant_launch import BLOCK_PRODUCTS, block_widths, product_shape

    assert block_widths(5120, 132) == [2112, 4224, 5120, 6336]
    assert block_widths(4224, 132) == [2112, 4224, 6336]
    assert [product_shape(name)[0] for name in BLOCK_PRODUCTS] == [5120, 5120]
