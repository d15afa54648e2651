"""The defaults the engine settles at start-up, once it knows the model, the device and the memory left.

Owns: `spec.backend = "auto"` (which backend, at how many drafts), dflash2's `spec.draft_weights = "auto"` (a 4-bit
copy of the drafter's layers where it takes nothing from the K/V pool), `engine.context = 0` (the model's
max_position_embeddings, or fewer so that one lane's whole context fits the K/V pool) and `engine.kv_memory = 0` (the
pool: every lane's whole context, or the memory left if that is less), each chosen once and logged once with the
reason, and the memory figures behind them. Does not own: the config rules (ignis.config) or allocating anything
(ignis.model.cache, ignis.model.pool, the backends).

Speculation is the point of ignis, so a model that carries a DFlash drafter (`<model>/drafter` or `spec.drafter`)
decodes with it: dflash2 at its trained width (at most 7) on a GPU. On the CPU the choice is `CPU_AUTO`, measured on
the built-in model with tools/bench_engine (the figures are in the commits that set and rechecked it): dflash2 at 7
decodes one lane about twice as fast as mtp at 3, and four busy lanes within the noise of it.
A model without a drafter decodes plainly.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from ignis.config import MAX_DRAFT_TOKENS, IgnisConfig
from ignis.config.schema import AUTO
from ignis.errors import ArtifactError, ConfigError
from ignis.logging import get_logger
from ignis.model.cache import LaneCache
from ignis.model.config import ModelConfig, read_config_json
from ignis.model.pool import PAGE

log = get_logger("ignis.engine.defaults")

CPU_AUTO: tuple[str, int] = ("dflash2", 7)  # measured on the built-in model: see the module docstring
GPU_MEMORY_FRACTION = 0.9  # of the device memory free after the weights; the rest is activations, workspace, graphs
CPU_MEMORY_FRACTION = 0.5  # of the available system memory: the host runs more than ignis
CONTEXT_STEP = 256  # a fitted context is rounded down to a multiple of this
MIN_FITTED_CONTEXT = 256  # fewer positions than this per lane is not worth serving


def settle(
    config: IgnisConfig, path: Path, device: torch.device, dtype: torch.dtype, model: ModelConfig
) -> IgnisConfig:
    """The config with `spec.backend = "auto"`, `engine.context = 0` and `engine.kv_memory = 0` replaced by what they
    resolve to here.

    Called after the target's weights are loaded (so the memory left is what the caches can have) and before the
    backend and the caches are made. Raises ArtifactError when not even MIN_FITTED_CONTEXT positions fit, ConfigError
    when a stated engine.kv_memory cannot hold one lane's whole context."""
    spec = config.spec
    if spec.backend == AUTO:
        backend, k, why = choose_backend(config, path, device)
        spec = dataclasses.replace(spec, backend=backend, draft_tokens=k)
        log.info("ignis.engine.spec_default", backend=backend, draft_tokens=k, reason=why)
    engine = config.engine
    if spec.backend == "dflash2" and spec.draft_weights == AUTO:
        weights, why = settle_draft_weights(dataclasses.replace(config, spec=spec), path, model, device, dtype)
        spec = dataclasses.replace(spec, draft_weights=weights)
        log.info("ignis.engine.draft_weights_default", draft_weights=weights, reason=why)
    drafter = _drafter_bytes(dataclasses.replace(config, spec=spec), path, model, device, dtype)
    context, kv_memory, why, pool_why = fit_pool(model, engine.lanes, engine.context, engine.kv_memory,
                                                 spec.draft_tokens, device, dtype, drafter,
                                                 pooled_layers(dataclasses.replace(config, spec=spec), path))
    if engine.context == 0:
        log.info("ignis.engine.context_default", context=context, reason=why)
    if engine.kv_memory == 0:
        log.info("ignis.engine.kv_memory_default", kv_memory=kv_memory, reason=pool_why)
    engine = dataclasses.replace(engine, context=context, kv_memory=kv_memory)
    return dataclasses.replace(config, spec=spec, engine=engine)


def settle_draft_weights(config: IgnisConfig, path: Path, model: ModelConfig, device: torch.device,
                         dtype: torch.dtype) -> tuple[str, str]:
    """(spec.draft_weights, why) for dflash2's "auto": "int4-greedy" where the greedy copy's rule makes one
    (backends.dflash2.greedy_copy.auto_copy) and the K/V pool loses nothing to it (the same context and pool, and
    the memory left still holds that pool), else "model"."""
    from ignis.plan import greedy_copy_bytes, with_draft_weights

    copy = greedy_copy_bytes(config, path, model, dtype, device.type == "cuda")
    if not copy:
        return "model", ("no 4-bit copy of the drafter's layers: it pays for a drafter of 1 GiB or more of 16-bit layer "
                         "projections on a GPU that runs the 4-bit mma kernel, outside exact mode")
    plain = _drafter_bytes(with_draft_weights(config, "model"), path, model, device, dtype)
    ec, k, layers = config.engine, config.spec.draft_tokens, pooled_layers(config, path)
    try:
        without = fit_pool(model, ec.lanes, ec.context, ec.kv_memory, k, device, dtype, plain, layers)[:2]
        with_copy = fit_pool(model, ec.lanes, ec.context, ec.kv_memory, k, device, dtype, plain + copy, layers)[:2]
    except (ArtifactError, ConfigError):
        return "model", "the memory left does not hold the K/V pool beside a 4-bit copy of the drafter's layers"
    held = memory_left(model, ec.lanes, k, device, dtype, plain + copy, layers) >= with_copy[1]
    if with_copy == without and held:
        return "int4-greedy", (f"a 4-bit copy of the drafter's layers ({_gib(copy)}) for greedy rounds of one or two "
                               f"lanes fits beside the K/V pool")
    return "model", (f"a 4-bit copy of the drafter's layers ({_gib(copy)}) would take memory the K/V pool needs "
                     f"(set spec.draft_weights = \"int4-greedy\" to hold it anyway)")


def choose_backend(config: IgnisConfig, path: Path, device: torch.device) -> tuple[str, int, str]:
    """(backend, draft tokens, why) for `spec.backend = "auto"`."""
    drafter = config.spec.drafter_dir(path)
    width = _drafter_width(drafter)
    if width is None:
        return "off", 0, f"the model carries no drafter ({drafter} has no config.json); --spec mtp uses its MTP layer"
    if device.type == "cpu":
        backend, k = CPU_AUTO
        why = f"the model carries a drafter; on the CPU {backend} decoded the built-in model fastest"
    else:
        backend, k = "dflash2", MAX_DRAFT_TOKENS
        why = f"the model carries a drafter in {drafter}"
    if backend == "dflash2":
        k = min(k, width)
    # One round verifies every lane's anchor and drafts: keep within engine.max_rows.
    k = min(k, config.engine.max_rows // config.engine.lanes - 1)
    if k < 1:
        return "off", 0, (f"{config.engine.lanes} lanes leave no room for drafts in engine.max_rows = "
                          f"{config.engine.max_rows}")
    return backend, (k if backend != "off" else 0), why


def pooled_layers(config: IgnisConfig, path: Path) -> int:
    """Attention layers a backend keeps in the target's K/V pool: mtp's layer attends at the target's positions, and
    so does it under a dflash2 drafter whose slot 1 it drafts (dflash_config.first_draft "mtp")."""
    spec = config.spec
    if spec.backend == "mtp":
        return 1
    if spec.backend != "dflash2":
        return 0
    try:
        draft = read_config_json(spec.drafter_dir(path) / "config.json", "").get("dflash_config") or {}
    except ArtifactError:  # the backend's own load says what is wrong with it
        return 0
    return 1 if isinstance(draft, dict) and draft.get("first_draft") == "mtp" else 0


def fit_pool(model: ModelConfig, lanes: int, context: int, kv_memory: int, draft_tokens: int, device: torch.device,
             dtype: torch.dtype, reserved: int = 0, extra_layers: int = 0) -> tuple[int, int, str, str]:
    """(context, kv_memory, why the context, why the pool): `context` and `kv_memory` with their 0s (auto) settled.

    The memory left is the free device memory (GPU_MEMORY_FRACTION of it; CPU_MEMORY_FRACTION of the available
    system memory on the CPU), less `reserved` bytes still to come (the drafter's weights) and every lane's recurrent
    state. The pool (engine.kv_memory) defaults to every lane's whole context, so no request ever waits for pages, or
    to the memory left when that is less. An automatic context is the model's max_position_embeddings, or fewer so that
    one lane's whole context (and a round's verify columns past it) fits the pool. Raises when the pool cannot hold one
    lane's whole context: a request alone must always be able to run to the end of its context. extra_layers: a
    backend's attention layers in the pool (`pooled_layers`)."""
    wanted = context or model.max_position_embeddings
    _, per_position = cache_bytes(model, draft_tokens, dtype, extra_layers)
    page_bytes = per_position * PAGE
    cols = draft_tokens + 1
    free, where = available_memory(device)
    fraction = CPU_MEMORY_FRACTION if device.type == "cpu" else GPU_MEMORY_FRACTION
    left = memory_left(model, lanes, draft_tokens, device, dtype, reserved, extra_layers)
    memory = f"{_gib(free)} {where} ({fraction:.0%} usable)"
    pool = kv_memory or left
    why = f"engine.context = {context}"
    if context == 0:
        fits = pool // page_bytes * PAGE - cols  # positions one lane's pages can hold, less a round's columns
        if fits >= wanted:
            context, why = wanted, "the model's max_position_embeddings"
        else:
            context = fits // CONTEXT_STEP * CONTEXT_STEP
            if context < MIN_FITTED_CONTEXT:
                raise ArtifactError(
                    f"not enough memory for {lanes} lanes: {memory} holds fewer than {MIN_FITTED_CONTEXT} positions "
                    f"per lane ({_gib(per_position * 1024)} per 1024 positions); lower engine.lanes or set "
                    f"engine.context")
            why = (f"fitted to memory: one lane's {context} positions fill the K/V pool of {_gib(pool)}; the model "
                   f"allows {wanted} (set engine.context or engine.kv_memory, or lower engine.lanes, for more)")
    lane_pages = -(-(context + cols) // PAGE)
    if kv_memory == 0:
        pages = min(lanes * lane_pages, left // page_bytes)
        kv_memory = pages * page_bytes
        pool_why = (f"every lane's whole context: {lanes} lanes x {context} positions take {_gib(kv_memory)} of "
                    f"{memory}" if pages == lanes * lane_pages else
                    f"the memory left: {pages} pages of {PAGE} positions ({pages // lane_pages} lanes' whole "
                    f"contexts of {context}) in {memory}")
    else:
        pool_why = f"engine.kv_memory = {kv_memory}"
    if kv_memory // page_bytes < lane_pages:
        held = kv_memory // page_bytes * PAGE
        if pool_why.startswith("engine.kv_memory"):
            raise ConfigError("engine.kv_memory", f"got {kv_memory} bytes, {held} positions of K/V, fewer than one "
                              f"lane's context of {context} and a round's {cols} columns "
                              f"({_gib(lane_pages * page_bytes)}); raise engine.kv_memory or lower engine.context")
        raise ArtifactError(f"not enough memory for one lane's context of {context}: {memory} holds {held} positions "
                            f"of K/V after {lanes} lanes' recurrent state; lower engine.context or engine.lanes")
    return context, kv_memory, why, pool_why


def memory_left(model: ModelConfig, lanes: int, draft_tokens: int, device: torch.device, dtype: torch.dtype,
                reserved: int = 0, extra_layers: int = 0) -> int:
    """Bytes the K/V pool may take: the usable share of the memory free now (GPU_MEMORY_FRACTION of the device's,
    CPU_MEMORY_FRACTION of the system's available), less `reserved` bytes still to come and every lane's recurrent
    state (the scratch lane's too)."""
    fixed, _ = cache_bytes(model, draft_tokens, dtype, extra_layers)
    free, _ = available_memory(device)
    fraction = CPU_MEMORY_FRACTION if device.type == "cpu" else GPU_MEMORY_FRACTION
    return max(0, int(free * fraction) - reserved - (lanes + 1) * fixed)


def cache_bytes(model: ModelConfig, draft_tokens: int, dtype: torch.dtype, extra_layers: int = 0) -> tuple[int, int]:
    """(bytes per lane whatever its length, bytes per position held) of the target's caches: the recurrent state
    and verify record of a lane, and the pooled attention layers' K/V of one position (the target's, and
    `extra_layers` of a backend's).

    Measured on the meta device from LaneCache itself, so the figures follow its layout without copying it."""
    cache = LaneCache(model, lanes=1, context=1, max_cols=draft_tokens + 1, device="meta", dtype=dtype)
    for _ in range(extra_layers):
        cache.pool.layer()
    per_position = cache.pool.page_bytes() // cache.pool.page
    return cache.nbytes() - cache.pool.nbytes(), per_position


def available_memory(device: torch.device) -> tuple[int, str]:
    """(bytes free for ignis's tensors, where): device memory free on a GPU, available system memory on the CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"free on {device}"
    return system_available(), "of available system memory"


def system_available() -> int:
    """MemAvailable from /proc/meminfo (what can be had without swapping), else free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _drafter_width(drafter: Path) -> int | None:
    """Drafts a round the drafter was trained for (block_size - 1), or None when there is no drafter."""
    file = drafter / "config.json"
    if not file.is_file():
        return None
    try:
        block = int(json.loads(file.read_text()).get("block_size", MAX_DRAFT_TOKENS + 1))
    except (OSError, ValueError, TypeError, AttributeError):
        return None  # an unreadable drafter is reported by the backend that loads it, not guessed at here
    return max(block - 1, 0)


def _drafter_bytes(config: IgnisConfig, path: Path, model: ModelConfig, device: torch.device,
                   dtype: torch.dtype) -> int:
    """Memory the dflash2 backend will take after the context is fitted: the drafter's weights on disk (no fewer than
    it holds once loaded, whatever spec.draft_weights converts them to), its proposal head's own copy, where
    spec.draft_head makes one, and its layers' 4-bit copy, where spec.draft_weights makes one
    (ignis.plan.proposal_head_bytes: at the 27B shape a 4-bit copy of the head is 0.6 GiB, of the layers 0.8). The
    mtp backend's: its 4-bit copy of the head, where spec.draft_head makes one."""
    from ignis.backends.dflash2.weights import SHORTLIST
    from ignis.plan import proposal_head_bytes

    if config.spec.backend == "mtp":
        return proposal_head_bytes(config, path, model, dtype, device.type == "cuda")
    if config.spec.backend != "dflash2":
        return 0
    weights = config.spec.drafter_dir(path).glob("*.safetensors")
    files = sum(f.stat().st_size for f in weights if f.name != SHORTLIST)  # the shortlist is a head: counted there
    return files + proposal_head_bytes(config, path, model, dtype, device.type == "cuda")


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"
