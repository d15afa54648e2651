"""Where the model lives and what it runs on: the artifact directory, device, dtype and exactness.

Owns: resolving `model.path` (empty = the built-in artifact shipped inside the package), `model.device`,
`model.dtype` and `model.exact` from the config. Does not own: reading weights (ignis.model.loader).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ignis.config import IgnisConfig
from ignis.errors import ArtifactError

if TYPE_CHECKING:
    import torch

# Front-ends resolve the model path too and never touch tensors: torch is imported only where a device is resolved.
BUILTIN = Path(__file__).resolve().parent / "builtin"


def resolve_model_path(cfg: IgnisConfig) -> Path:
    path = Path(cfg.model.path).expanduser() if cfg.model.path else BUILTIN
    if not (path / "config.json").is_file():
        where = "the built-in artifact" if not cfg.model.path else f"model.path {str(path)!r}"
        raise ArtifactError(f"{where} has no config.json; point model.path at a Qwen3.5 checkpoint directory")
    return path


def resolve_device(cfg: IgnisConfig) -> torch.device:
    import torch

    if cfg.model.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(cfg.model.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ArtifactError(f"model.device is {cfg.model.device!r} but no CUDA device is visible; use 'cpu' or 'auto'")
    return device


def resolve_dtype(cfg: IgnisConfig, device: torch.device) -> torch.dtype:
    import torch

    if cfg.model.dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    dtype: torch.dtype = getattr(torch, cfg.model.dtype)  # float32 | bfloat16 | float16, checked by the config
    return dtype


def resolve_exact(cfg: IgnisConfig, device: torch.device) -> bool:
    if cfg.model.exact == "auto":
        return device.type == "cpu"
    return cfg.model.exact == "on"


def model_name(cfg: IgnisConfig, path: Path) -> str:
    return cfg.model.name or ("ignis-builtin" if path == BUILTIN else path.name)
