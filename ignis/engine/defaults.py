"""The defaults the engine settles at start-up, once it knows the model, the device and the memory left.

Owns: `spec.backend = "auto"` (which backend, at how many drafts) and `engine.context = 0` (the model's
max_position_embeddings, fitted to the memory left), each chosen once and logged once with the reason, and the
memory figures behind them. Does not own: the config rules (ignis.config) or allocating anything
(ignis.model.cache, the backends).

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
from ignis.errors import ArtifactError
from ignis.logging import get_logger
from ignis.model.cache import LaneCache
from ignis.model.config import ModelConfig

log = get_logger("ignis.engine.defaults")

CPU_AUTO: tuple[str, int] = ("dflash2", 7)  # measured on the built-in model: see the module docstring
GPU_MEMORY_FRACTION = 0.9  # of the device memory free after the weights; the rest is activations and workspace
CPU_MEMORY_FRACTION = 0.5  # of the available system memory: the host runs more than ignis
CONTEXT_STEP = 256  # a fitted context is rounded down to a multiple of this
MIN_FITTED_CONTEXT = 256  # fewer positions than this per lane is not worth serving


def settle(
    config: IgnisConfig, path: Path, device: torch.device, dtype: torch.dtype, model: ModelConfig
) -> IgnisConfig:
    """The config with `spec.backend = "auto"` and `engine.context = 0` replaced by what they resolve to here.

    Called after the target's weights are loaded (so the memory left is what the caches can have) and before the
    backend and the caches are made. Raises ArtifactError when not even MIN_FITTED_CONTEXT positions fit."""
    spec = config.spec
    if spec.backend == AUTO:
        backend, k, why = choose_backend(config, path, device)
        spec = dataclasses.replace(spec, backend=backend, draft_tokens=k)
        log.info("ignis.engine.spec_default", backend=backend, draft_tokens=k, reason=why)
    engine = config.engine
    if engine.context == 0:
        context, why = fit_context(model, engine.lanes, spec.draft_tokens, device, dtype,
                                   _drafter_bytes(config, path, spec.backend))
        engine = dataclasses.replace(engine, context=context)
        log.info("ignis.engine.context_default", context=context, reason=why)
    return dataclasses.replace(config, spec=spec, engine=engine)


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


def fit_context(model: ModelConfig, lanes: int, draft_tokens: int, device: torch.device, dtype: torch.dtype,
                reserved: int = 0) -> tuple[int, str]:
    """(positions per lane, why): the model's max_position_embeddings, or fewer so that every lane's caches fit in
    the memory left (minus `reserved` bytes still to come, such as the drafter's weights)."""
    wanted = model.max_position_embeddings
    fixed, per_position = cache_bytes(model, draft_tokens, dtype)
    free, where = available_memory(device)
    fraction = CPU_MEMORY_FRACTION if device.type == "cpu" else GPU_MEMORY_FRACTION
    budget = int(free * fraction) - reserved - lanes * fixed
    fits = budget // (lanes * per_position) if budget > 0 else 0
    memory = f"{_gib(free)} {where} ({fraction:.0%} usable)"
    if fits >= wanted:
        used = lanes * (fixed + wanted * per_position)
        return wanted, (f"the model's max_position_embeddings; {lanes} lanes x {wanted} positions take "
                        f"{_gib(used)} of {memory}")
    context = fits // CONTEXT_STEP * CONTEXT_STEP
    if context < MIN_FITTED_CONTEXT:
        raise ArtifactError(
            f"not enough memory for {lanes} lanes: {memory} holds fewer than {MIN_FITTED_CONTEXT} positions per lane "
            f"({_gib(per_position * 1024)} per 1024 positions); lower engine.lanes or set engine.context")
    return context, (f"fitted to memory: {lanes} lanes x {context} positions fill {memory}; the model allows "
                     f"{wanted} (set engine.context or lower engine.lanes for more)")


def cache_bytes(model: ModelConfig, draft_tokens: int, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes per lane whatever its length, bytes per lane per position) of the target's caches.

    Measured on the meta device from LaneCache itself, so the figures follow its layout without copying it: the
    recurrent states and verify records are per lane, the attention layers' pages per position (a lane holds its
    verify columns' positions past its context too)."""
    cache = LaneCache(model, lanes=1, context=1, max_cols=draft_tokens + 1, device="meta", dtype=dtype)
    per_position = cache.pool.page_bytes() // cache.pool.page
    fixed = cache.nbytes() - sum(s.k.nbytes + s.v.nbytes for s in cache.pool.layers)
    return fixed + (draft_tokens + 1) * per_position, per_position


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


def _drafter_bytes(config: IgnisConfig, path: Path, backend: str) -> int:
    """The drafter's weights on disk: memory the backend will take after the context is fitted."""
    if backend != "dflash2":
        return 0
    return sum(f.stat().st_size for f in config.spec.drafter_dir(path).glob("*.safetensors"))


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"
