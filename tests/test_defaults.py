"""Defaults that fit: the context follows the model's max_position_embeddings and the K/V pool, the pool holds every
lane's whole context or the memory left, speculation is on when the model carries a drafter (dflash2 at 7 on every
GPU profile), and each choice is logged with its reason."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
import torch

import ignis.engine.defaults as defaults
from ignis.artifact import BUILTIN
from ignis.config import PROFILES, load_config
from ignis.engine.core import Engine
from ignis.engine.defaults import CPU_AUTO, cache_bytes, fit_pool, settle
from ignis.errors import ArtifactError, ConfigError
from ignis.model.pool import PAGE
from ignis.model.config import ModelConfig
from q27b import write_27b
from serving import tiny_artifact

GPU_PROFILES = [p for p in PROFILES if p != "cpu"]
CUDA = torch.device("cuda")  # a device object only: nothing is allocated on it


@pytest.fixture(autouse=True)
def default_logging() -> Iterator[None]:
    """structlog's defaults (no level filter), so that capture_logs sees info events whatever ran before."""
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()


@pytest.fixture
def memory(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Pretend this much memory is free (bytes), on whichever device is asked."""
    free = {"bytes": 64 * 2**30}
    monkeypatch.setattr(defaults, "available_memory", lambda device: (free["bytes"], f"free on {device}"))
    return free


def builtin() -> ModelConfig:
    return ModelConfig.from_dir(BUILTIN)


def test_context_is_the_models_own_and_the_pool_every_lanes_when_memory_allows(memory: dict[str, int]) -> None:
    model = builtin()
    context, kv_memory, why, pool_why = fit_pool(model, 8, 0, 0, 7, CUDA, torch.bfloat16)
    assert context == model.max_position_embeddings == 4096 and "max_position_embeddings" in why
    _, per_position = cache_bytes(model, 7, torch.bfloat16)
    assert kv_memory == 8 * -(-(4096 + 8) // PAGE) * PAGE * per_position  # 8 lanes' pages of 4096 + 8 columns
    assert "every lane's whole context: 8 lanes x 4096 positions" in pool_why


def test_context_is_fitted_to_the_pool_left_and_says_so(memory: dict[str, int]) -> None:
    model = dataclasses.replace(builtin(), max_position_embeddings=262144)
    fixed, per_position = cache_bytes(model, 7, torch.bfloat16)
    page_bytes, lanes = per_position * PAGE, 8
    memory["bytes"] = int(((lanes + 1) * fixed + 160 * page_bytes) / defaults.GPU_MEMORY_FRACTION) + 1  # 160 pages
    context, kv_memory, why, pool_why = fit_pool(model, lanes, 0, 0, 7, CUDA, torch.bfloat16)
    assert context == 9984  # one lane's 10,240 positions less 8 columns, rounded down to a multiple of 256
    assert kv_memory == 160 * page_bytes and "the memory left: 160 pages" in pool_why
    assert "fitted to memory" in why and "the model allows 262144" in why
    # Less memory, shorter context; the drafter's weights still to come are taken off first.
    shorter, *_ = fit_pool(model, lanes, 0, 0, 7, CUDA, torch.bfloat16, reserved=memory["bytes"] // 20)
    assert 0 < shorter < context
    # The CPU keeps half of the available memory for everything else.
    memory["bytes"] *= 3
    on_gpu, *_ = fit_pool(model, lanes, 0, 0, 7, CUDA, torch.bfloat16)
    on_cpu, _, _, pool_why = fit_pool(model, lanes, 0, 0, 7, torch.device("cpu"), torch.bfloat16)
    assert context < on_cpu < on_gpu and "50% usable" in pool_why
    # A stated pool decides the context: one lane's whole context fits it.
    stated, kv_memory, *_ = fit_pool(model, lanes, 0, 64 * page_bytes, 7, CUDA, torch.bfloat16)
    assert (stated, kv_memory) == (3840, 64 * page_bytes)


def test_too_little_memory_is_a_clear_error(memory: dict[str, int]) -> None:
    memory["bytes"] = 2**20
    with pytest.raises(ArtifactError, match="not enough memory for 8 lanes.*lower engine.lanes or set engine.context"):
        fit_pool(builtin(), 8, 0, 0, 7, CUDA, torch.bfloat16)
    memory["bytes"] = 64 * 2**30
    with pytest.raises(ConfigError, match="engine.kv_memory.*fewer than one lane's context of 4096"):
        fit_pool(builtin(), 8, 4096, 2**20, 7, CUDA, torch.bfloat16)


def test_an_explicit_context_is_kept_and_the_pool_holds_every_lane(memory: dict[str, int]) -> None:
    cfg = load_config(profile="cpu", overrides={"engine.context": 512, "spec.backend": "off"})
    settled = settle(cfg, BUILTIN, torch.device("cpu"), torch.float32, builtin())
    _, per_position = cache_bytes(builtin(), 0, torch.float32)
    assert settled.engine.context == 512 and settled.engine.kv_memory == 4 * 9 * PAGE * per_position
    assert dataclasses.replace(settled, engine=cfg.engine) == cfg
    stated = load_config(profile="cpu", overrides={"engine.context": 512, "spec.backend": "off",
                                                   "engine.kv_memory": 10 * PAGE * per_position})
    assert settle(stated, BUILTIN, torch.device("cpu"), torch.float32, builtin()) == stated


@pytest.mark.parametrize("profile", GPU_PROFILES)
def test_the_builtin_model_speculates_with_dflash2_at_7_on_every_gpu_profile(
    profile: str, memory: dict[str, int]
) -> None:
    cfg = settle(load_config(profile=profile), BUILTIN, CUDA, torch.bfloat16, builtin())
    assert (cfg.spec.backend, cfg.spec.draft_tokens) == ("dflash2", 7)
    assert cfg.engine.context > 0


def test_on_the_cpu_the_builtin_model_takes_the_measured_choice_and_a_model_without_drafter_runs_plainly(
    tmp_path: Path, memory: dict[str, int]
) -> None:
    cpu = torch.device("cpu")
    with structlog.testing.capture_logs() as logs:
        cfg = settle(load_config(profile="cpu"), BUILTIN, cpu, torch.float32, builtin())
    assert (cfg.spec.backend, cfg.spec.draft_tokens) == CPU_AUTO
    chosen = [e for e in logs if e["event"] == "ignis.engine.spec_default"]
    assert len(chosen) == 1 and "drafter" in chosen[0]["reason"]
    assert [e["context"] for e in logs if e["event"] == "ignis.engine.context_default"] == [4096]
    plain = tiny_artifact(tmp_path / "plain")  # MTP weights, but no drafter directory
    cfg = settle(load_config(profile="cpu"), plain, cpu, torch.float32, ModelConfig.from_dir(plain))
    assert (cfg.spec.backend, cfg.spec.draft_tokens) == ("off", 0)
    # spec.drafter points elsewhere: that drafter counts.
    pointed = load_config(profile="cpu", overrides={"spec.drafter": str(BUILTIN / "drafter")})
    assert settle(pointed, plain, CUDA, torch.bfloat16, ModelConfig.from_dir(plain)).spec.backend == "dflash2"


def test_drafts_are_kept_within_the_row_budget(memory: dict[str, int]) -> None:
    cfg = load_config(overrides={"engine.lanes": 128, "engine.max_rows": 512})
    assert settle(cfg, BUILTIN, CUDA, torch.bfloat16, builtin()).spec.draft_tokens == 3  # 128 x (3 + 1) = 512
    cfg = load_config(overrides={"engine.lanes": 512, "engine.max_rows": 512})
    assert settle(cfg, BUILTIN, CUDA, torch.bfloat16, builtin()).spec.backend == "off"


def test_the_engine_settles_its_defaults_and_reports_them(tmp_path: Path) -> None:
    phases: list[tuple[str, int, int]] = []
    engine = Engine(load_config(profile="cpu", overrides={"engine.lanes": 1, "log.level": "warning"}),
                    progress=lambda phase, done, total, **kw: phases.append((phase, done, total)))
    assert (engine.info.backend, engine.info.draft_tokens) == CPU_AUTO
    assert engine.info.context == engine.config.engine.context == 4096
    assert engine.config.spec.backend == CPU_AUTO[0]
    # Every phase ends with done == total, weights tensor by tensor.
    ends = [(p, d) for p, d, t in phases if d == t]
    assert [p for p, _ in ends] == ["weights", "drafter", "caches", "warmup"]
    weights = [d for p, d, _ in phases if p == "weights"]
    assert weights == list(range(1, len(weights) + 1)) and len(weights) > 10


@pytest.mark.parametrize("head", ["full", "int4", "shortlist"])
def test_the_drafter_reserved_before_the_pool_counts_its_proposal_heads_own_copy(head: str) -> None:
    """The drafter's weights, and what spec.draft_head holds beside the target's head (a 4-bit copy, the shortlist's
    rows), come out of the memory the K/V pool is fitted to: the same bytes `ignis config show` plans."""
    from ignis.backends.dflash2.weights import SHORTLIST
    from ignis.engine.defaults import _drafter_bytes
    from ignis.plan import proposal_head_bytes

    cfg = load_config(profile="cpu", overrides={"spec.backend": "dflash2", "spec.draft_tokens": 7,
                                                "spec.draft_head": head})
    files = sum(f.stat().st_size for f in (BUILTIN / "drafter").glob("*.safetensors") if f.name != SHORTLIST)
    reserved = _drafter_bytes(cfg, BUILTIN, builtin(), torch.device("cpu"), torch.float32)
    own = proposal_head_bytes(cfg, BUILTIN, builtin(), torch.float32, False)
    assert reserved == files + own
    assert (own > 0) == (head != "full")
    if head == "shortlist":
        assert own == (BUILTIN / "drafter" / SHORTLIST).stat().st_size
    off = load_config(profile="cpu", overrides={"spec.backend": "off"})
    assert _drafter_bytes(off, BUILTIN, builtin(), torch.device("cpu"), torch.float32) == 0


@pytest.mark.parametrize("head", ["full", "int4"])
def test_mtps_4bit_head_is_reserved_before_the_pool(head: str) -> None:
    """The mtp backend holds no weights of its own, but its 4-bit copy of the head (spec.draft_head = "int4") comes
    out of the memory the K/V pool is fitted to, as the dflash2 drafter's does."""
    from ignis.backends.dflash2.packed_head import held_bytes
    from ignis.engine.defaults import _drafter_bytes

    cfg = load_config(profile="cpu", overrides={"spec.backend": "mtp", "spec.draft_tokens": 3,
                                                "spec.draft_head": head})
    reserved = _drafter_bytes(cfg, BUILTIN, builtin(), torch.device("cpu"), torch.float32)
    model = builtin()
    assert reserved == (held_bytes(model.vocab_size, model.hidden_size, False, 4) if head == "int4" else 0)


def test_auto_draft_weights_hold_the_greedy_copy_only_where_the_pool_loses_nothing(memory: dict[str, int],
                                                                                 tmp_path: Path) -> None:
    """dflash2's spec.draft_weights = "auto" at the 27B shape on a GPU: the 4-bit copy of the drafter's layers where
    every lane's whole context still fits beside it (a stated context), none where the pool is fitted to the memory
    (the model's 262,144 positions do not fit) or on the CPU; each choice logged with its reason."""
    from ignis.quant.linear import uses_mma

    path = write_27b(tmp_path / "27b", int4=False)
    model = ModelConfig.from_dir(path)

    def settled(device: torch.device, **engine: int) -> tuple[str, list[dict[str, object]]]:
        overrides = {"spec.backend": "dflash2", "spec.draft_tokens": 7, "engine.lanes": 8,
                     **{f"engine.{k}": v for k, v in engine.items()}}
        with structlog.testing.capture_logs() as logs:
            cfg = settle(load_config(overrides=overrides), path, device, torch.bfloat16, model)
        return cfg.spec.draft_weights, [e for e in logs if e["event"] == "ignis.engine.draft_weights_default"]

    memory["bytes"] = 64 * 2**30
    weights, logs = settled(CUDA, context=8192)
    mma = uses_mma(CUDA, torch.bfloat16)
    assert weights == ("int4-greedy" if mma else "model") and len(logs) == 1
    assert ("fits beside the K/V pool" if mma else "mma kernel") in str(logs[0]["reason"])
    weights, logs = settled(CUDA)  # context 0: fitted to the memory left
    assert weights == "model" and ("memory the K/V pool needs" if mma else "mma kernel") in str(logs[0]["reason"])
    assert settled(torch.device("cpu"), context=8192)[0] == "model"


def test_auto_draft_weights_leave_a_stated_pool_its_memory(memory: dict[str, int], tmp_path: Path) -> None:
    """With engine.kv_memory stated, the greedy copy is held only where the memory left after it still holds that
    pool: a free memory that holds the pool beside the drafter alone gives "model"."""
    from ignis.plan import greedy_copy_bytes, with_draft_weights
    from ignis.quant.linear import uses_mma

    if not uses_mma(CUDA, torch.bfloat16):
        pytest.skip("the greedy copy's rule asks for the 4-bit mma kernel")
    path = write_27b(tmp_path / "27b", int4=False)
    model = ModelConfig.from_dir(path)
    pool = 4 * 2**30
    cfg = load_config(overrides={"spec.backend": "dflash2", "spec.draft_tokens": 7, "engine.lanes": 8,
                                 "engine.context": 8192, "engine.kv_memory": pool})
    plain = defaults._drafter_bytes(with_draft_weights(cfg, "model"), path, model, CUDA, torch.bfloat16)
    copy = greedy_copy_bytes(cfg, path, model, torch.bfloat16, True)
    fixed, _ = cache_bytes(model, 7, torch.bfloat16)
    needed = pool + plain + 9 * fixed  # the pool beside the drafter and 8 lanes' states (and the scratch lane's)
    memory["bytes"] = int((needed + copy // 2) / defaults.GPU_MEMORY_FRACTION)  # room for half the copy
    assert settle(cfg, path, CUDA, torch.bfloat16, model).spec.draft_weights == "model"
    memory["bytes"] = int((needed + 2 * copy) / defaults.GPU_MEMORY_FRACTION)
    assert settle(cfg, path, CUDA, torch.bfloat16, model).spec.draft_weights == "int4-greedy"
