"""Fixtures shared by the tests of the MTP layer's drafts (the `mtp` backend's, and slot 1 of a dflash2 drafter
trained behind the layer): a tiny target with its MTP layer (`ckpt`), a random drafter in the first-draft form beside
it (`drafter`), greedy prompts (`work`) and their exact `off` output (`reference`), and `engine` to build either
backend over them. A test module imports the ones it uses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engines import prompts, run
from ignis.backends.dflash2.weights import save_random_drafter
from ignis.config import load_config
from ignis.engine.core import Engine
from ignis.model.config import ModelConfig
from ignis.params import SamplingParams
from tiny import tiny_checkpoint

VOCAB = 512


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), seed=3, mtp=True, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def drafter(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_drafter(tmp_path_factory.mktemp("drafter"), ModelConfig.from_dir(ckpt), seed=7, num_layers=2,
                               taps=3, first_draft="mtp")


@pytest.fixture(scope="module")
def work() -> tuple[list[list[int]], list[SamplingParams]]:
    ps = prompts(12, VOCAB, seed=2, lo=2, hi=32)
    return ps, [SamplingParams(max_tokens=4 + (3 * i) % 12, temperature=0.0, ignore_eos=True) for i in range(len(ps))]


def spec_engine(ckpt: Path, backend: str, lanes: int, **extra: Any) -> Engine:
    """An engine over `ckpt` on the CPU profile; `extra`: config keys ("spec.drafter", "model.exact", ...)."""
    overrides = {"model.path": str(ckpt), "spec.backend": backend, "engine.lanes": lanes, "log.level": "warning",
                 **extra}
    return Engine(load_config(profile="cpu", overrides=overrides))


@pytest.fixture(scope="module")
def reference(ckpt: Path, work: tuple[list[list[int]], list[SamplingParams]]) -> dict[str, list[int]]:
    ps, params = work
    return {k: v.token_ids for k, v in run(spec_engine(ckpt, "off", 4), ps, params).items()}
