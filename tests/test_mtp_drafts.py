"""The MTP layer's drafts through the 4-bit head (spec.draft_head = "int4"): the `mtp` backend's every draft, and slot
1 of a dflash2 drafter trained behind the MTP layer. Greedy output equals `off` token for token; a draft is the best
of the head's candidates, valued by the 16-bit rows; a seeded request's sampled tokens do not depend on the lanes
beside it; the backend reports what "auto" settled on and counts the head it holds; the config refuses mtp with the
dflash2 drafter's shortlist head (tests/test_plan.py: the plan counts mtp's 4-bit copy of a 27B's head). In the
device round the layer's pass over the verify rows reads the verify's own RoPE tables."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engines import prompts, run
from first_draft_work import VOCAB, ckpt, drafter, reference, spec_engine, work  # noqa: F401 (fixtures)
from ignis.backends.base import Choice, Committed
from ignis.backends.dflash2.backend import DFlash2
from ignis.backends.mtp import Mtp
from ignis.config import load_config
from ignis.errors import ConfigError
from ignis.params import SamplingParams


@pytest.mark.parametrize("model", [{}, {"model.exact": "off"}], ids=["exact", "fused"])
@pytest.mark.parametrize("lanes", [1, 4])
def test_mtp_drafting_through_the_4bit_head_keeps_greedy_output(ckpt: Path, work, reference, lanes: int,
                                                                 model: dict[str, str]) -> None:
    ps, params = work
    engine = spec_engine(ckpt, "mtp", lanes, **{"spec.draft_tokens": 3, "spec.draft_head": "int4", **model})
    backend = engine.backend
    assert isinstance(backend, Mtp) and backend.head is not None and backend.head.module is not None
    assert engine.config.spec.draft_head == "int4"
    out = run(engine, ps, params)
    for rid, ref in reference.items():
        assert out[rid].token_ids == ref, f"request {rid} diverged from off"
    assert engine.stats().drafted > 0  # a random MTP layer's drafts are seldom kept: the output is what counts


@pytest.mark.parametrize("model", [{}, {"model.exact": "off"}], ids=["exact", "fused"])
@pytest.mark.parametrize("lanes", [1, 4])
def test_slot_one_through_the_4bit_head_keeps_greedy_output(ckpt: Path, drafter: Path, work, reference, lanes: int,
                                                             model: dict[str, str]) -> None:
    ps, params = work
    engine = spec_engine(ckpt, "dflash2", lanes, **{"spec.drafter": str(drafter), "spec.draft_tokens": 7,
                                                    "spec.draft_head": "int4", **model})
    backend = engine.backend
    assert isinstance(backend, DFlash2) and backend.first is not None and backend.packed_head is not None
    assert backend.first.head is backend.packed_head  # one 4-bit head, counted once
    held = backend.packed_head.nbytes()
    assert held > 0 and backend.first.nbytes() < held
    out = run(engine, ps, params)
    for rid, ref in reference.items():
        assert out[rid].token_ids == ref, f"request {rid} diverged from off"
    assert engine.stats().position_drafted[0] > 0


def test_a_draft_is_the_best_of_the_heads_candidates(ckpt: Path) -> None:
    """Greedy: the 16-bit rows' best among the 4-bit logits' candidates (the full head's argmax wherever those keep it:
    here, for nearly every row); sampled: drawn among the head's candidates only, q their softmax."""
    engine = spec_engine(ckpt, "mtp", 2, **{"spec.draft_tokens": 1, "spec.draft_head": "int4"})
    full = spec_engine(ckpt, "mtp", 2, **{"spec.draft_tokens": 1})
    mtp, plain = engine.backend, full.backend
    assert isinstance(mtp, Mtp) and isinstance(plain, Mtp) and mtp.head is not None and plain.head is None
    hidden = torch.randn(64, engine.model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    greedy = Choice.build([0.0] * 64, [None] * 64, 1, hidden.device)
    got: list[torch.Tensor] = []
    mtp._choose(hidden, greedy, 0, got, [])
    rows = hidden[:, None]
    values, ids = mtp.head.candidates(rows, mtp.head.logits(rows), 16)
    assert torch.equal(got[0], ids[:, 0, 0])
    want: list[torch.Tensor] = []
    plain._choose(hidden, greedy, 0, want, [])
    assert (got[0] == want[0]).float().mean() >= 0.9
    gens = [torch.Generator().manual_seed(i) for i in range(64)]
    sampled = Choice.build([1.0] * 64, gens, 1, hidden.device)
    drafts: list[torch.Tensor] = []
    qs: list[torch.Tensor] = []
    mtp._choose(hidden, sampled, 0, drafts, qs)
    values, ids = mtp.head.candidates(rows, mtp.head.logits(rows), 32)
    q = qs[0]
    assert q.shape == (64, VOCAB) and torch.allclose(q.sum(-1), torch.ones(64))
    assert (q.gather(1, ids[:, 0]) > 0).all() and int((q > 0).sum(-1).max()) <= 32
    torch.testing.assert_close(q.gather(1, ids[:, 0]), torch.softmax(values[:, 0], -1))
    assert (q.gather(1, drafts[0][:, None]) > 0).all()


def test_seeded_sampled_tokens_do_not_depend_on_the_lanes_beside_them(ckpt: Path) -> None:
    ps = prompts(5, VOCAB, seed=8, lo=2, hi=16)
    params = [SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, top_k=20, seed=i, ignore_eos=True)
              for i in range(len(ps))]
    outs = []
    for lanes in (1, 3):
        engine = spec_engine(ckpt, "mtp", lanes, **{"spec.draft_tokens": 3, "spec.draft_head": "int4"})
        outs.append({k: v.token_ids for k, v in run(engine, ps, params).items()})
        assert engine.stats().drafted > 0
    assert outs[0] == outs[1]


def test_mtp_settles_auto_counts_its_head_and_refuses_the_shortlist(ckpt: Path) -> None:
    auto = spec_engine(ckpt, "mtp", 2, **{"spec.draft_tokens": 2})
    assert isinstance(auto.backend, Mtp) and auto.backend.head is None
    assert auto.config.spec.draft_head == "full" and auto.info.draft_head == "full"  # on the CPU: the target's own
    packed = spec_engine(ckpt, "mtp", 2, **{"spec.draft_tokens": 2, "spec.draft_head": "int4"})
    assert isinstance(packed.backend, Mtp) and packed.backend.head is not None
    assert packed.backend.nbytes() == auto.backend.nbytes() + packed.backend.head.nbytes()
    with pytest.raises(ConfigError, match="spec.draft_head"):
        load_config(overrides={"spec.backend": "mtp", "spec.draft_head": "shortlist"})


@pytest.mark.parametrize("backend", ["mtp", "dflash2"])
def test_the_layers_pass_over_the_verify_rows_reuses_the_verify_step(ckpt: Path, drafter: Path, work, reference,
                                                                     backend: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A device round builds one DecodeStep (the verify's) when the MTP layer drafts one token: its observe reads the
    step the round hands it in `Committed`, and greedy output stays equal to off."""
    ps, params = work
    extra = {"spec.drafter": str(drafter), "spec.draft_tokens": 7} if backend == "dflash2" else {"spec.draft_tokens": 1}
    engine = spec_engine(ckpt, backend, 2, **{"model.exact": "off", **extra})
    assert engine.runner.device_round is not None
    layer = engine.backend.first if isinstance(engine.backend, DFlash2) else engine.backend
    assert isinstance(layer, Mtp)
    built, handed = [], []
    decode_step, observe = engine.model.decode_step, layer.observe_lanes
    monkeypatch.setattr(engine.model, "decode_step", lambda *a, **kw: built.append(1) or decode_step(*a, **kw))

    def spy(rows: Committed, span: int) -> None:
        handed.append(rows.step is not None)
        observe(rows, span)

    monkeypatch.setattr(layer, "observe_lanes", spy)
    out = run(engine, ps, params)
    for rid, ref in reference.items():
        assert out[rid].token_ids == ref, f"request {rid} diverged from off"
    assert handed and all(handed)
    assert len(built) == len(handed)  # one step a forward: the verify's (or the prefill piece's), not a second

