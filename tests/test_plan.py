"""Memory plans at the Qwen3.5-27B shape (config.json files only, no weights) for every GPU profile, `ignis config
show --model`, and `ignis serve` refusing a plan that cannot fit, with its numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from q27b import write_27b
from tiny import tiny_checkpoint

from ignis.cli import main
from ignis.config import load_config
from ignis.model.loader import load_model
from ignis.plan import GIB, memory_plan
from ignis.quant.convert import convert
from ignis.quant.linear import uses_mma
from tools.round_work import QWEN35_27B

KV_PER_POSITION = 16 * 2 * 4 * 256 * 2  # attention layers x (K, V) x KV heads x head_dim x bf16 bytes = 64 KiB


@pytest.fixture(scope="module")
def q27b(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("27b")
    return {"int4": write_27b(root / "int4", True), "bf16": write_27b(root / "bf16", False)}


DFLASH2 = {"spec.backend": "dflash2", "spec.draft_tokens": 7}
# profile -> (weights it states, whether the 27B with its drafter fits, total GiB as its comment states)
PROFILES = {"rtx5090": ("int4", True, 28.6), "rtxpro6000": ("bf16", True, 75.3), "h200": ("bf16", True, 75.3),
            "rtx50-16gb": ("int4", False, 27.8)}


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_each_profile_plans_the_27b_with_its_drafter(profile: str, q27b: dict[str, Path]) -> None:
    weights, fits, total = PROFILES[profile]
    cfg = load_config(profile=profile, overrides=DFLASH2)
    assert cfg.model.weights == weights
    plan = memory_plan(cfg, q27b[weights])
    items = {i.name: i.nbytes for i in plan.items}
    lanes, context = cfg.engine.lanes, cfg.engine.context
    pages = lanes * -(-(context + 8) // 64) + 1  # every lane's context and verify columns, and the null page
    assert items["kv cache"] == pages * 64 * KV_PER_POSITION + (lanes + 1) * -(-(context + 8) // 64) * 8  # + table
    # bf16: every parameter in two bytes (27.3 B with the MTP layer); int4: the projections in half a byte plus
    # 3 bytes of scale and zero point a group of 128 (4 as the loader repacks them for the mma kernel on a GPU), the
    # embedding, head, norms, gates and MTP layer in bf16.
    assert (17.0 if weights == "int4" else 50.5) * GIB < items["weights"] < (18.0 if weights == "int4" else 51.5) * GIB
    # 1.83 B parameters in bf16 and its context K/V, the 4-bit copy of its layers' projections where the plan fits
    # with it (0.79 GiB, spec.draft_weights = "auto"; not on the 16 GB card), and beside a bf16 target the 4-bit copy
    # of its head (0.63 GiB, spec.draft_head = "auto")
    low, high = {"int4": (3.3, 4.2), "bf16": (4.9, 5.4)}[weights]
    copy = 0.79 if weights == "int4" and fits else 0.0
    assert (low + copy) * GIB < items["drafter"] < (high + copy) * GIB
    assert plan.capacity == cfg.engine.memory_mib * 2**20
    assert plan.fits == fits
    assert round(plan.total / GIB, 1) == total
    assert (plan.headroom > 0) == fits


def test_the_h200_fp8_option_plans_the_27b_as_its_comment_states(q27b: dict[str, Path]) -> None:
    cfg = load_config(profile="h200", overrides={**DFLASH2, "model.weights": "fp8"})
    plan = memory_plan(cfg, q27b["bf16"])
    items = {i.name: i.nbytes for i in plan.items}
    # the projections in one byte a weight (plus four a row), the embedding, head, norms, gates and MTP in bf16
    assert 27.5 * GIB < items["weights"] < 29.0 * GIB and plan.weights.startswith("fp8")
    assert round(items["weights"] / GIB, 1) == 28.2 and round(plan.total / GIB, 1) == 52.7 and plan.fits


def test_an_fp8_drafter_is_planned_at_a_byte_a_projection_weight(q27b: dict[str, Path]) -> None:
    plans = {w: memory_plan(load_config(profile="h200", overrides={**DFLASH2, "spec.draft_weights": w}), q27b["bf16"])
             for w in ("model", "fp8")}
    bf16, fp8 = ({i.name: i for i in plans[w].items}["drafter"] for w in ("model", "fp8"))
    # fc (25,600 x 5,120) and 5 layers of q, k, v (6,144 rows), o (4,096 -> 5,120), gate, up and down (17,408): 1.46 B
    # weights a byte lighter, less an fp32 scale a row
    converted = 25600 * 5120 + 5 * (6144 * 5120 + 5120 * 4096 + 3 * 17408 * 5120)
    rows = 5120 + 5 * (6144 + 5120 + 2 * 17408 + 5120)
    assert bf16.nbytes - fp8.nbytes == converted - 4 * rows
    assert "fp8" in fp8.how and "fp8" not in bf16.how


def test_an_int4_drafter_is_planned_at_half_a_byte_a_projection_weight(q27b: dict[str, Path]) -> None:
    plans = {w: memory_plan(load_config(profile="h200", overrides={**DFLASH2, "spec.draft_weights": w}), q27b["bf16"])
             for w in ("model", "int4")}
    bf16, int4 = ({i.name: i for i in plans[w].items}["drafter"] for w in ("model", "int4"))
    # the fp8 test's projections, every one in groups of 128: half a byte a weight, and per row and group a bf16
    # scale and a uint8 zero (3 bytes), or 4 bytes once held in the mma kernel's order on CUDA
    weights = 25600 * 5120 + 5 * (6144 * 5120 + 5120 * 4096 + 3 * 17408 * 5120)
    held = 4 if uses_mma(torch.device("cuda"), torch.bfloat16) else 3
    assert bf16.nbytes - int4.nbytes == 2 * weights - (weights // 2 + weights // 128 * held)
    assert "projections in 4-bit" in int4.how and "projections in 4-bit" not in bf16.how


def test_the_greedy_copy_is_planned_where_auto_makes_one(q27b: dict[str, Path]) -> None:
    """spec.draft_weights = "int4-greedy" adds the 4-bit copy of the five layers' projections to the drafter's
    16-bit weights (fc and the context's K/V stay as they are); "auto" makes it on a GPU where the plan fits with it
    and its K/V pool keeps what it had, beside a 16-bit or a 4-bit target, and on no CPU."""
    def drafter(weights: str, path: Path, **more: object) -> tuple[int, str]:
        cfg = load_config(profile="h200", overrides={**DFLASH2, "spec.draft_weights": weights, **more})
        item = {i.name: i for i in memory_plan(cfg, path).items}["drafter"]
        return item.nbytes, item.how

    (model, how), (greedy, greedy_how), (auto, _) = (drafter(w, q27b["bf16"]) for w in ("model", "int4-greedy", "auto"))
    # q, k, v (6,144 rows), o (4,096 -> 5,120), gate, up and down (17,408) of five layers: half a byte a weight, and
    # a group of 128's scale and zero (4 bytes in the mma kernel's order on CUDA, else a bf16 scale and a byte)
    weights = 5 * (6144 * 5120 + 5120 * 4096 + 3 * 17408 * 5120)
    held = 4 if uses_mma(torch.device("cuda"), torch.bfloat16) else 3
    assert greedy - model == weights // 2 + weights // 128 * held
    assert "copy of its layers" in greedy_how and "copy of its layers" not in how
    assert auto == (greedy if held == 4 else model)  # "auto" asks for the mma kernel
    if held == 4:
        assert drafter("auto", q27b["int4"])[0] == drafter("int4-greedy", q27b["int4"])[0]
        # a card whose memory the K/V pool fills (the context fitted to 34 GiB): the copy would take the pool's, so none
        small = {"engine.memory_mib": 34 * 1024}
        assert drafter("auto", q27b["int4"], **small)[0] == drafter("model", q27b["int4"], **small)[0]

        def pool(weights: str) -> int:
            cfg = load_config(profile="h200", overrides={**DFLASH2, "spec.draft_weights": weights, **small})
            return {i.name: i.nbytes for i in memory_plan(cfg, q27b["int4"]).items}["kv cache"]

        assert pool("auto") == pool("model") > pool("int4-greedy")
    cpu = {"model.device": "cpu"}
    assert drafter("auto", q27b["bf16"], **cpu)[0] == drafter("model", q27b["bf16"], **cpu)[0]


def test_a_4bit_proposal_head_is_planned_as_a_copy_of_a_16bit_head_only(q27b: dict[str, Path]) -> None:
    """spec.draft_head = "int4": a bf16 target's head (248,320 x 5,120) held again in 4 bits, a group's scale and zero
    in 3 bytes (4 in the mma kernel's order); a target whose head is 4-bit already lends it, so nothing is added."""
    def drafter(path: Path, head: str) -> int:
        plan = memory_plan(load_config(profile="h200", overrides={**DFLASH2, "spec.draft_head": head}), path)
        return {i.name: i for i in plan.items}["drafter"].nbytes

    held = 4 if uses_mma(torch.device("cuda"), torch.bfloat16) else 3
    v, h = QWEN35_27B["vocab_size"], QWEN35_27B["hidden_size"]
    assert drafter(q27b["bf16"], "int4") - drafter(q27b["bf16"], "full") == v * h // 2 + v * (h // 128) * held
    headed = write_27b(q27b["bf16"].parent / "int4-head", True, head=True)
    assert drafter(headed, "int4") == drafter(headed, "full")


def test_the_plan_counts_mtps_4bit_copy_of_a_27b_head(q27b: dict[str, Path]) -> None:
    """The mtp backend with spec.draft_head = "int4" holds the same 4-bit copy of a bf16 head as a dflash2 drafter."""
    def drafter(head: str) -> int:
        cfg = load_config(profile="h200", overrides={"spec.backend": "mtp", "spec.draft_tokens": 3,
                                                     "spec.draft_head": head})
        return {i.name: i for i in memory_plan(cfg, q27b["bf16"]).items}["drafter"].nbytes

    held = 4 if uses_mma(torch.device("cuda"), torch.bfloat16) else 3
    v, h = QWEN35_27B["vocab_size"], QWEN35_27B["hidden_size"]
    assert drafter("full") == 0
    assert drafter("int4") == v * h // 2 + v * (h // 128) * held


def test_the_planned_weights_are_what_the_loader_holds(tmp_path: Path) -> None:
    """Counted from config.json alone, the weights item equals the bytes of the model loaded from the converted
    checkpoint (packed projections, kept embeddings, norms, gates and MTP layer; with --head, the head packed)."""
    src = tiny_checkpoint(tmp_path / "src", seed=3, mtp=True)
    convert(src, tmp_path / "q", group=64)
    convert(src, tmp_path / "qh", group=64, head=True)  # the output head packed too
    for path in (src, tmp_path / "q", tmp_path / "qh"):
        model = load_model(path, device="cpu", dtype=torch.float32, exact=True)
        held = sum(t.nbytes for t in model.state_dict().values())
        plan = memory_plan(load_config(profile="cpu"), path)
        assert {i.name: i.nbytes for i in plan.items}["weights"] == held


def test_an_auto_context_is_the_longest_that_fits(q27b: dict[str, Path]) -> None:
    """engine.context = 0 and spec.backend = "auto" (the defaults) are planned as the engine settles them: dflash2 at
    the drafter's width, and the longest context (a multiple of 256) one lane can hold in the K/V pool the memory
    left makes."""
    auto = {"engine.context": 0, "spec.backend": "auto", "spec.draft_tokens": 0}
    plan = memory_plan(load_config(profile="rtx5090", overrides=auto), q27b["int4"])
    kv = {i.name: i for i in plan.items}["kv cache"]
    context = (plan.lane_positions - 8) // 256 * 256  # one lane's pages hold its context and 7 drafts + 1 columns
    assert plan.lane_positions == -(-(context + 8) // 64) * 64 <= plan.kv_room < plan.lane_positions + 256
    assert context < 262144 and plan.fits and "engine.context = 0" in kv.how and "the memory left" in kv.how
    longer = memory_plan(load_config(profile="rtx5090", overrides={**DFLASH2, "engine.context": context + 256}),
                         q27b["int4"])
    assert not longer.fits
    # A 16 GB card cannot hold even the shortest fitted context: the plan says so rather than inventing room.
    assert not memory_plan(load_config(profile="rtx50-16gb", overrides=auto), q27b["int4"]).fits


def test_bf16_27b_does_not_fit_the_5090_but_int4_does(q27b: dict[str, Path]) -> None:
    cfg = load_config(profile="rtx5090")
    full, packed = memory_plan(cfg, q27b["bf16"]), memory_plan(cfg, q27b["int4"])
    assert not full.fits and packed.fits
    assert full.total - packed.total > 30 * GIB


def test_config_show_prints_the_plan(q27b: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", "--profile", "rtx5090", "--model", str(q27b["bf16"])]) == 0
    out = capsys.readouterr().out
    load_config(profile="rtx5090", overrides={"model.path": str(q27b["bf16"])})  # the TOML part still resolves
    for line in ("weights", "kv cache", "recurrent states", "drafter", "cuda graphs, scratch", "runtime", "headroom"):
        assert f"#   {line}" in out
    assert "DOES NOT FIT" in out
    assert "sized for int4 weights; the checkpoint holds bfloat16" in out


def test_serve_refuses_a_plan_that_cannot_fit_with_the_numbers(q27b: dict[str, Path],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--profile", "rtx5090", "--model", str(q27b["bf16"])]) == 2
    err = capsys.readouterr().err
    assert "need 61.58 GiB but 32607 MiB (engine.memory_mib) has 31.84 GiB" in err
    # the drafter with a 4-bit copy of the bf16 head (spec.draft_head = "auto" beside a 16-bit target)
    assert "weights 50.89, kv cache 4.02, recurrent states 0.84, drafter 4.23" in err and "headroom -29.73" in err
    # More lanes than the card holds whole contexts for: the K/V pool takes what is left and the lanes share it...
    plan = memory_plan(load_config(profile="rtx5090", overrides={"engine.lanes": 16}), q27b["int4"])
    kv = {i.name: i for i in plan.items}["kv cache"]
    assert plan.fits and "the memory left" in kv.how and plan.lane_positions <= plan.kv_room < 16 * plan.lane_positions
    # ... but a stated pool the card cannot hold is refused, with the numbers.
    stated = f"engine.kv_memory={20 * GIB}"
    assert main(["serve", "--profile", "rtx5090", "--model", str(q27b["int4"]), "--set", stated]) == 2
    assert "this model and config need" in capsys.readouterr().err


def test_the_repacked_weights_growth_is_what_the_mma_layout_holds(tmp_path: Path) -> None:
    """On a GPU the loader repacks 4-bit projections for the mma kernel; the plan adds what that layout holds beyond the
    format's: packed here on the CPU (the same function), the bytes differ by exactly the plan's growth."""
    from ignis.kernels import int4_mma
    from ignis.plan import _repack_growth
    from ignis.quant.linear import QuantLinear

    src = tiny_checkpoint(tmp_path / "src", seed=3, mtp=True)
    convert(src, tmp_path / "q", group=64)
    model = load_model(tmp_path / "q", device="cpu", dtype=torch.bfloat16, exact=True)
    grown = 0
    for m in model.modules():
        if isinstance(m, QuantLinear) and int4_mma.fits(m.out_features, m.in_features, 64):
            w = int4_mma.pack(m.qweight, m.scales, m.qzeros, torch.bfloat16)
            grown += w.codes.nbytes + w.zs.nbytes - (m.qweight.nbytes + m.scales.nbytes + m.qzeros.nbytes)
    assert grown > 0 and grown == _repack_growth(model, 64)
