"""Helpers for tests of the GPU process, the clients and the server: a tiny artifact with a real tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from ignis.artifact import BUILTIN
from ignis.config import IgnisConfig, load_config
from tiny import tiny_checkpoint


def tiny_artifact(path: Path, seed: int = 2) -> Path:
    """A tiny random checkpoint with the built-in tokenizer beside it (vocabulary 8192, like the tokenizer's)."""
    tiny_checkpoint(path, seed=seed, mtp=True, vocab_size=8192)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUILTIN / name, path / name)
    return path


def config(model: Path, **overrides: Any) -> IgnisConfig:
    # Plain decoding unless a test asks for a backend: the default ("auto") would follow what the artifact carries.
    base: dict[str, Any] = {"model.path": str(model), "log.level": "warning", "engine.context": 512,
                            "spec.backend": "off"}
    base.update(overrides)
    return load_config(profile="cpu", overrides=base)
