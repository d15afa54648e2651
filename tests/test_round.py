"""The round's guarantees: speculation never changes greedy output, and a rejected draft leaves no trace."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engines import make_engine, prompts, run
from ignis.params import SamplingParams
from tiny import tiny_checkpoint

VOCAB = 512


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), seed=3, mtp=True, vocab_size=VOCAB)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def work() -> tuple[list[list[int]], list[SamplingParams]]:
    ps = prompts(20, VOCAB, seed=1, lo=2, hi=100)
    return ps, [_greedy(6 + (7 * i) % 23) for i in range(len(ps))]


@pytest.fixture(scope="module")
def reference(ckpt: Path, work) -> dict[str, list[int]]:
    ps, params = work
    out = run(make_engine(ckpt, "off", lanes=4), ps, params)
    return {k: v.token_ids for k, v in out.items()}


@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("lanes", [1, 4])
def test_mtp_greedy_equals_off_token_for_token(ckpt: Path, work, reference, k: int, lanes: int) -> None:
    ps, params = work
    engine = make_engine(ckpt, "mtp", draft_tokens=k, lanes=lanes)
    out = run(engine, ps, params)
    for rid, ref in reference.items():
        assert out[rid].token_ids == ref, f"request {rid} diverged from off"
    s = engine.stats()
    assert s.rounds > 0 and s.drafted > 0
    assert all(a <= d for a, d in zip(s.position_accepted, s.position_drafted))
    assert all(a >= b for a, b in zip(s.position_accepted, s.position_accepted[1:]))
    assert s.accepted == sum(s.position_accepted) and s.drafted == sum(s.position_drafted)


def _lane_state(engine, lane: int, upto: int) -> dict[str, torch.Tensor]:
    return engine.runner.cache.lane_state(lane, upto)


def test_rejected_drafts_leave_no_trace_in_any_layer(ckpt: Path) -> None:
    """After speculative rounds, every layer's state equals plain decoding's for the same committed tokens."""
    ps = prompts(3, VOCAB, seed=7, lo=20, hi=100)
    params = _greedy(40)
    off = make_engine(ckpt, "off", lanes=1)
    spec = make_engine(ckpt, "mtp", draft_tokens=7, lanes=1)
    for i, p in enumerate(ps):
        a = run(off, [p], params)["0"]
        b = run(spec, [p], params)["0"]
        assert a.token_ids == b.token_ids
        assert b.stats.drafted > b.stats.accepted  # some drafts were rejected, or this would prove nothing
        upto = len(p) + len(a.token_ids) - 1  # every token but the last anchor has been run through the model
        sa, sb = _lane_state(off, 0, upto), _lane_state(spec, 0, upto)
        assert sa.keys() == sb.keys() and sa
        for name in sa:
            assert torch.equal(sa[name], sb[name]), f"prompt {i}: {name} differs after speculation"


def test_the_builtin_artifact_keeps_greedy_output_under_mtp() -> None:
    """The speculation guarantee on the shipped model: mtp at every width gives plain decoding's tokens."""
    import json

    from ignis.artifact import BUILTIN
    from ignis.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(BUILTIN)
    lines = (BUILTIN / "heldout_prompts.jsonl").read_text().splitlines()[4:8]
    ps = [tok.encode(json.loads(line)["prompt"])[-80:] for line in lines]
    params = [_greedy(12 + 5 * i) for i in range(len(ps))]
    want = run(make_engine(BUILTIN, "off", lanes=4), ps, params)
    for k, lanes in ((1, 4), (3, 4), (7, 4), (7, 1)):
        engine = make_engine(BUILTIN, "mtp", draft_tokens=k, lanes=lanes)
        got = run(engine, ps, params)
        assert all(got[r].token_ids == want[r].token_ids for r in want), (k, lanes)
        assert engine.stats().accepted > 0
