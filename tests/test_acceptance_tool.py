"""The acceptance tool: recorded turns replay token for token under teacher forcing, and its tallies add up."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines import make_engine, prompts
from ignis.ipc.messages import EngineRequest
from ignis.params import SamplingParams
from tiny import tiny_checkpoint
from tools.acceptance import measure, record, replay

VOCAB = 512
SAMPLED = SamplingParams(max_tokens=14, temperature=1.0, top_p=0.95, top_k=20, seed=3, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("acc"), seed=9, mtp=True, vocab_size=VOCAB)


def test_teacher_forcing_emits_the_record_whatever_the_drafts(ckpt: Path) -> None:
    ps = prompts(3, VOCAB, seed=4, lo=5, hi=40)
    turns = record(str(ckpt), "cpu", ps, SAMPLED, lanes=2)
    engine = make_engine(ckpt, "mtp", draft_tokens=3, lanes=2)
    for i, t in enumerate(turns):
        p = SamplingParams(max_tokens=len(t["response_token_ids"]), temperature=1.0, seed=5)
        engine.add(EngineRequest(id=str(i), prompt_token_ids=t["prompt_token_ids"], params=p),
                   forced=t["response_token_ids"])
    got: dict[str, list[int]] = {}
    done = 0
    while done < len(turns):
        for d in engine.step():
            got.setdefault(d.id, []).extend(d.token_ids)
            if d.finished:
                done += 1
                assert d.stats.accepted <= d.stats.drafted and d.stats.rounds >= 1
    assert [got[str(i)] for i in range(len(turns))] == [t["response_token_ids"] for t in turns]


def test_replay_and_free_running_tallies(ckpt: Path) -> None:
    ps = prompts(3, VOCAB, seed=6, lo=5, hi=40)
    turns = record(str(ckpt), "cpu", ps, SAMPLED, lanes=3)
    off = replay(str(ckpt), "cpu", "off", 0, turns, SAMPLED, lanes=3)
    assert off.rounds == sum(len(t["response_token_ids"]) - 1 for t in turns) and off.tokens_per_round == 1.0
    spec = replay(str(ckpt), "cpu", "mtp", 3, turns, SAMPLED, lanes=3)
    assert 1.0 <= spec.tokens_per_round <= 4.0 and len(spec.per_position()) <= 3
    greedy = measure(str(ckpt), "cpu", "mtp", 3, ps, SamplingParams(max_tokens=10, temperature=0.0), "greedy", 3)
    assert greedy.prompts == 3 and greedy.accepted <= greedy.drafted
