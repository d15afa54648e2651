"""Drafter tensors on disk: reading them into a `DrafterModel`, writing them back, and a random drafter for tests.

Owns: which safetensors files make up a drafter, the name remapping (bare `candidate_selector.*_codebook` tensors,
also accepted with a `.weight` suffix), the refusal of missing, unexpected or misshapen tensors, `save_drafter`
and `save_random_drafter`. Does not own: config.json parsing (.config) or the shortlist head's file (.shortlist).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ignis.backends.dflash2.config import DFLASH2, DrafterConfig, drafter_config_json
from ignis.backends.dflash2.model import DrafterModel
from ignis.errors import ArtifactError
from ignis.model.config import ModelConfig

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
SHORTLIST = "shortlist.safetensors"
_CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def expected_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = DrafterModel(cfg)
    return {name: tuple(p.shape) for name, p in model.state_dict().items()}


def load_drafter(path: Path, cfg: DrafterConfig, *, device: torch.device, dtype: torch.dtype) -> DrafterModel:
    """The drafter in `path` with every tensor checked against `cfg`, in `dtype` on `device`, ready for inference."""
    want = expected_shapes(cfg)
    tensors: dict[str, torch.Tensor] = {}
    for file in _files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                bare = key.removesuffix(".weight")
                name = bare if bare in _CODEBOOKS else key
                tensors[name] = f.get_tensor(key).to(device=device, dtype=dtype)
    missing = sorted(set(want) - set(tensors))
    if missing:
        kind = "a DFlash2 drafter (convs and selector)" if cfg.is_v2 else "a DFlash drafter"
        raise ArtifactError(f"{path}: config.json describes {kind}, but these tensors are missing: {_names(missing)}")
    unexpected = sorted(set(tensors) - set(want))
    if unexpected:
        raise ArtifactError(f"{path}: tensors the drafter config does not describe: {_names(unexpected)} "
                            f"(architectures {cfg.variant})")
    wrong = [f"{n} {tuple(tensors[n].shape)} (expected {want[n]})" for n in sorted(want) if tuple(tensors[n].shape) != want[n]]
    if wrong:
        raise ArtifactError(f"{path}: tensors of the wrong shape: {_names(wrong)}")
    with torch.device("meta"):
        model = DrafterModel(cfg)
    model.load_state_dict(tensors, assign=True)
    return model.eval().requires_grad_(False)


def save_drafter(path: Path, config: dict, model: DrafterModel, dtype: torch.dtype = torch.bfloat16,
                 max_shard_bytes: int = 15 * 2**20) -> None:
    """Write config.json and the tensors in the published layout (codebooks as bare tensors): model.safetensors,
    or shards of at most `max_shard_bytes` plus model.safetensors.index.json."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in sorted(model.state_dict().items())}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    for old in [*path.glob("model*.safetensors"), path / INDEX]:
        old.unlink(missing_ok=True)
    if len(shards) == 1:
        save_file(shards[0], str(path / WEIGHTS), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    total = sum(t.nbytes for t in state.values())
    (path / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


def spread_layer_ids(target_layers: int, n: int) -> list[int]:
    """The reference's default taps: n ids spread over [1, L-3] (one tap: the middle layer)."""
    if n == 1:
        return [target_layers // 2]
    lo, hi = 1, max(target_layers - 3, 1)
    return sorted({min(round(lo + i * (hi - lo) / (n - 1)), target_layers - 1) for i in range(n)})


def save_random_drafter(
    path: Path,
    target: ModelConfig,
    *,
    variant: str = DFLASH2,
    seed: int = 0,
    num_layers: int = 2,
    taps: int = 2,
    block_size: int = 8,
    sliding_window: int | None = 16,
    layer_types: list[str] | None = None,
    is_causal: bool | None = False,
    intermediate_size: int | None = None,
    mask_token_id: int | None = None,
    selector_rank: int = 16,
    selector_top_k: int = 8,
    conv_group_size: int = 16,
    output_multiplier: float = 1.0,
    final_logit_softcapping: float | None = None,
    first_draft: str = "",
    dtype: torch.dtype = torch.float32,
) -> Path:
    """A drafter with random weights in the DFlash2 (or v1) tensor layout for `target`, saved to `path`.

    Random, but not degenerate: projections are scaled like an initialised network, convs and the selector are far
    from the identity, so every code path changes the drafts."""
    config = drafter_config_json(
        target,
        variant=variant,
        num_layers=num_layers,
        intermediate_size=intermediate_size or 2 * target.hidden_size,
        sliding_window=sliding_window,
        layer_types=layer_types,
        is_causal=is_causal,
        block_size=block_size,
        mask_token_id=target.vocab_size - 1 if mask_token_id is None else mask_token_id,
        target_layer_ids=spread_layer_ids(target.num_hidden_layers, taps),
        selector_rank=selector_rank,
        selector_top_k=selector_top_k,
        conv_group_size=conv_group_size,
        output_multiplier=output_multiplier,
        final_logit_softcapping=final_logit_softcapping,
        first_draft=first_draft,
    )
    model = random_drafter(DrafterConfig.from_dict(config, target), seed=seed, device=torch.device("cpu"),
                           dtype=torch.float32)
    save_drafter(path, config, model, dtype)
    return path


def random_drafter(cfg: DrafterConfig, *, seed: int, device: torch.device, dtype: torch.dtype) -> DrafterModel:
    """A drafter with random weights built on `device` (save_random_drafter's distributions), ready for inference."""
    with torch.device(device):
        model = DrafterModel(cfg)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g, device=device))
            elif name.endswith("base_kernel"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g, device=device))
                p[:, 0] += 1.0
            elif name.endswith("codebook"):
                p.copy_(torch.randn(p.shape, generator=g, device=device))
            else:
                p.copy_(torch.randn(p.shape, generator=g, device=device) / math.sqrt(p.shape[-1]))
    return model.to(dtype).eval().requires_grad_(False)


def _files(path: Path) -> list[Path]:
    index = path / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ArtifactError(f"{index}: not a safetensors index ({e})") from e
        files = [path / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(f for f in path.glob("*.safetensors") if f.name != SHORTLIST)
    if not files:
        raise ArtifactError(f"{path}: no drafter weights ({WEIGHTS} or an index of safetensors shards)")
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        raise ArtifactError(f"{path}: shards listed in {INDEX} are missing: {', '.join(absent)}")
    return files


def _names(names: list[str], limit: int = 8) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
