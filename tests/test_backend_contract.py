"""The backend contract through the registry: a perfect drafter gets everything accepted, garbage gets nothing,
and neither changes greedy output. Both are test-only backends registered the way a third-party package would be."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ignis.backends.registry as registry
import ignis.config as config
from engines import make_engine, prompts, run
from ignis.backends.base import BackendContext, Observation, Proposal, ProposeIn
from ignis.config import load_config
from ignis.engine.core import Engine
from ignis.params import SamplingParams
from tiny import tiny_checkpoint

VOCAB = 512
K = 4


class Scripted:
    """Proposes from a known continuation of each lane's sequence: the truth, or the truth shifted to be wrong."""

    tap_layers: tuple[int, ...] = ()
    draft_tokens = K

    def __init__(self, ctx: BackendContext, truth: dict[tuple[int, ...], list[int]], wrong: bool) -> None:
        self.truth, self.wrong, self.vocab = truth, wrong, ctx.model.config.vocab_size
        self.name = "garbage" if wrong else "oracle"
        self.seq: dict[int, list[int]] = {}

    def nbytes(self) -> int:
        return 0

    def reset(self, lane: int) -> None:
        self.seq[lane] = []

    def observe(self, obs: list[Observation]) -> None:
        for o in obs:
            self.seq[o.lane][o.start :] = o.tokens.tolist() + [o.following]

    def propose(self, inp: ProposeIn) -> Proposal:
        rows = []
        for lane in inp.lanes:
            seq = self.seq[lane]
            full = next(list(p) + c for p, c in self.truth.items() if (list(p) + c)[: len(seq)] == seq)
            nxt = list(full[len(seq) : len(seq) + inp.k])
            nxt += [0] * (inp.k - len(nxt))
            rows.append([(t + 1) % self.vocab if self.wrong else t for t in nxt])
        return Proposal(tokens=torch.tensor(rows, dtype=torch.long), q=None)


@pytest.fixture()
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    ckpt = tiny_checkpoint(tmp_path, seed=5, mtp=False, vocab_size=VOCAB)
    ps = prompts(6, VOCAB, seed=2, lo=5, hi=70)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    ref = {k: v.token_ids for k, v in run(make_engine(ckpt, "off", lanes=3), ps, params).items()}
    truth = {tuple(p): ref[str(i)] for i, p in enumerate(ps)}
    loaders = dict(registry.installed())
    loaders["oracle"] = lambda ctx: Scripted(ctx, truth, wrong=False)
    loaders["garbage"] = lambda ctx: Scripted(ctx, truth, wrong=True)
    monkeypatch.setattr(registry, "installed", lambda: loaders)
    monkeypatch.setattr(config, "installed_backends", lambda: tuple(sorted(loaders)))
    return ckpt, ps, params, ref


def test_a_perfect_drafter_gets_every_draft_accepted(setup) -> None:
    ckpt, ps, params, ref = setup
    out = run(make_engine(ckpt, "oracle", draft_tokens=K, lanes=3), ps, params)
    for rid, d in out.items():
        assert d.token_ids == ref[rid]
        # 1 token from prefill, then K+1 a round; the last round may be shorter (max_tokens cuts the drafts).
        assert d.stats.accepted == d.stats.drafted
        assert d.stats.rounds == -(-(params.max_tokens - 1) // (K + 1))


def test_garbage_drafts_give_one_token_a_round_and_the_same_output(setup) -> None:
    ckpt, ps, params, ref = setup
    out = run(make_engine(ckpt, "garbage", draft_tokens=K, lanes=3), ps, params)
    for rid, d in out.items():
        assert d.token_ids == ref[rid]
        assert d.stats.accepted == 0 and d.stats.rounds == params.max_tokens - 1


@pytest.mark.parametrize("draft_sampling", ["sampled", "greedy"])
def test_draft_sampling_decides_what_temperature_backends_draft_at(setup, monkeypatch: pytest.MonkeyPatch,
                                                                  draft_sampling: str) -> None:
    ckpt, ps, _, _ = setup
    seen: list[float] = []

    def spy(self: Scripted, inp: ProposeIn) -> Proposal:
        seen.extend(inp.temperatures)
        return Proposal(tokens=torch.zeros((len(inp.lanes), inp.k), dtype=torch.long), q=None)

    monkeypatch.setattr(Scripted, "propose", spy)
    engine = make_engine(ckpt, "oracle", draft_tokens=K, lanes=1) if draft_sampling == "sampled" else Engine(
        load_config(profile="cpu", overrides={"model.path": str(ckpt), "spec.backend": "oracle", "spec.draft_tokens": K,
                                              "spec.draft_sampling": "greedy", "log.level": "warning"}))
    sampled = SamplingParams(max_tokens=6, temperature=0.7, seed=1, ignore_eos=True)
    run(engine, ps[:1], sampled)
    assert seen and all(t == (0.7 if draft_sampling == "sampled" else 0.0) for t in seen)
