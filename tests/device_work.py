"""Fixtures shared by the tests of the device round and of the rounds it chains or queues ahead: the tiny target and
drafter (`ckpt`), a corpus of greedy prompts (`work`; a module may define its own), and its exact `off` output
(`reference`, the output every way of running the device round must give token for token). A test module imports
the ones it uses."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines import make_engine, prompts, run
from ignis.params import SamplingParams
from tiny import tiny_pair

VOCAB = 512
FAST = {"exact": "off"}  # the device round, on the CPU eagerly


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_pair(tmp_path_factory.mktemp("ckpt"), seed=5, drafter_seed=1, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def work() -> tuple[list[list[int]], list[SamplingParams]]:
    ps = prompts(6, VOCAB, seed=21, lo=2, hi=60)
    return ps, [SamplingParams(max_tokens=20 + 7 * i, temperature=0.0, ignore_eos=True) for i in range(len(ps))]


@pytest.fixture(scope="module")
def reference(ckpt: Path, work: tuple[list[list[int]], list[SamplingParams]]) -> dict[str, list[int]]:
    ps, params = work
    return {k: v.token_ids for k, v in run(make_engine(ckpt, "off", lanes=4), ps, params).items()}
