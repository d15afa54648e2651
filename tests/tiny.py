"""Tiny Qwen3.5 checkpoints for tests: random weights, the real layout, seconds to build and run on a CPU.

Owns: `TINY` (the default tiny architecture), `tiny_config`, `tiny_checkpoint`, the `single_thread` fixture.
Does not own: how a checkpoint is written (ignis.model.random) or loaded (ignis.model.loader).
"""

from __future__ import annotations

from pathlib import Path
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from ignis.model.random import save_random_checkpoint

# 8 layers in the 3:1 pattern (attention at 3 and 7), GQA in both mixers (2 query heads per KV head, 2 value heads
# per key head), rotary width 8 of head_dim 32.
TINY: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "eos_token_id": [1, 2],
}


def tiny_config(**overrides: Any) -> dict[str, Any]:
    """TINY with `overrides` applied (any config.json key, e.g. vocab_size=8192; layer_types follow
    num_hidden_layers in the 3:1 pattern unless given)."""
    return {**TINY, **overrides}


def tiny_checkpoint(tmp_path: Path, *, seed: int = 0, mtp: bool = True, **overrides: Any) -> Path:
    """Write a random tiny checkpoint (config.json + model.safetensors, with mtp.* when `mtp`) into `tmp_path`."""
    path = Path(tmp_path)
    save_random_checkpoint(path, tiny_config(**overrides), seed=seed, mtp=mtp)
    return path


def tiny_pair(tmp_path: Path, *, seed: int = 0, drafter_seed: int = 0, **overrides: Any) -> Path:
    """A tiny checkpoint with its MTP layer (`tiny_checkpoint`) and a random dflash2 drafter of blocks of 8 in
    <checkpoint>/drafter, where the engine looks for one."""
    from ignis.backends.dflash2.weights import save_random_drafter
    from ignis.model.config import ModelConfig

    path = tiny_checkpoint(tmp_path, seed=seed, mtp=True, **overrides)
    save_random_drafter(path / "drafter", ModelConfig.from_dir(path), block_size=8, seed=drafter_seed)
    return path


@pytest.fixture(scope="module")
def single_thread() -> Iterator[None]:
    """Run a module's tiny-model work on one intra-op thread: for matrices this small a second thread only adds
    synchronisation, which turns into long stalls when the cores are shared. Restores the thread count after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
