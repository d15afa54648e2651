"""A dflash2 drafter whose slot 1 the target's MTP layer drafts (dflash_config.first_draft = "mtp"): the MTP layer
proposes slot 1, the drafter's block takes it as given and proposes slots 2..k. Greedy output equals `off` token for
token in the host round (exact) and the device round (fused, on the CPU), at every width and lane count; sampled
output is reproducible; the pool holds the MTP layer's keys; train-drafter writes such a drafter and
its block loss skips the given slot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from engines import prompts, run
from first_draft_work import VOCAB, ckpt, drafter, reference, spec_engine, work  # noqa: F401 (fixtures)
from ignis.backends.dflash2.backend import DFlash2
from ignis.backends.dflash2.config import DrafterConfig
from ignis.backends.dflash2.weights import save_random_drafter
from ignis.config import load_config
from ignis.engine.defaults import pooled_layers
from ignis.errors import ArtifactError
from ignis.model.config import ModelConfig
from ignis.params import SamplingParams
from tiny import tiny_checkpoint


@pytest.mark.parametrize("model", [{}, {"model.exact": "off"}], ids=["exact", "fused"])
@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("lanes", [1, 4])
def test_greedy_output_equals_off_with_the_mtp_layer_drafting_slot_one(ckpt: Path, drafter: Path, work, reference,
                                                                       lanes: int, k: int,
                                                                       model: dict[str, str]) -> None:
    ps, params = work
    engine = spec_engine(ckpt, "dflash2", lanes, **{"spec.drafter": str(drafter), "spec.draft_tokens": k, **model})
    assert isinstance(engine.backend, DFlash2) and engine.backend.first is not None
    out = run(engine, ps, params)
    for rid, ref in reference.items():
        assert out[rid].token_ids == ref, f"request {rid} diverged from off"
    s = engine.stats()
    assert s.rounds > 0 and s.drafted > 0 and s.position_drafted[0] > 0


def test_slot_one_is_the_mtp_layers_draft_and_the_block_sees_it(ckpt: Path, drafter: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    engine = spec_engine(ckpt, "dflash2", 2, **{"spec.drafter": str(drafter), "spec.draft_tokens": 7})
    backend = engine.backend
    assert isinstance(backend, DFlash2) and backend.first is not None
    seen: list[torch.Tensor | None] = []
    hidden = backend.hidden

    def spy(*args: Any, **kw: Any) -> torch.Tensor:
        seen.append(kw.get("given", args[6] if len(args) > 6 else None))
        return hidden(*args, **kw)

    monkeypatch.setattr(backend, "hidden", spy)
    first: list[torch.Tensor] = []
    propose = backend.first.propose_lanes
    monkeypatch.setattr(backend.first, "propose_lanes",
                        lambda *a, **kw: first.append(p := propose(*a, **kw)) or p)  # type: ignore[func-returns-value]
    run(engine, [[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert first and len(seen) == len(first)
    for given, proposal in zip(seen, first):
        assert given is not None and torch.equal(given, proposal.tokens[:, 0])


def test_sampled_output_is_reproducible_and_keeps_drafts(ckpt: Path, drafter: Path) -> None:
    ps = prompts(6, VOCAB, seed=4, lo=2, hi=16)
    params = [SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, top_k=20, seed=i, ignore_eos=True)
              for i in range(len(ps))]
    outs = []
    for lanes in (1, 3):
        engine = spec_engine(ckpt, "dflash2", lanes, **{"spec.drafter": str(drafter), "spec.draft_tokens": 7})
        outs.append({k: v.token_ids for k, v in run(engine, ps, params).items()})
        assert engine.stats().drafted > 0
    assert outs[0] == outs[1]  # a seeded request's tokens do not depend on the lanes beside it


def test_the_pool_and_the_plan_count_the_mtp_layers_keys(ckpt: Path, drafter: Path, tmp_path: Path) -> None:
    def spec(**over: Any) -> Any:
        return load_config(overrides={"spec.draft_tokens": 7, **{f"spec.{k}": v for k, v in over.items()}})

    assert pooled_layers(spec(backend="dflash2", drafter=str(drafter)), ckpt) == 1
    plain = save_random_drafter(tmp_path / "plain", ModelConfig.from_dir(ckpt), seed=7, num_layers=2, taps=3)
    assert pooled_layers(spec(backend="dflash2", drafter=str(plain)), ckpt) == 0
    assert pooled_layers(spec(backend="mtp"), ckpt) == 1
    engine = spec_engine(ckpt, "dflash2", 2, **{"spec.drafter": str(drafter), "spec.draft_tokens": 7})
    assert isinstance(engine.backend, DFlash2) and engine.backend.first is not None and engine.backend.first.pooled


def test_a_first_draft_drafter_needs_a_target_with_an_mtp_layer(ckpt: Path, drafter: Path, tmp_path: Path) -> None:
    bare = ModelConfig.from_dir(tiny_checkpoint(tmp_path, seed=3, mtp=False, vocab_size=VOCAB))
    with pytest.raises(ArtifactError, match="first_draft 'mtp'"):
        DrafterConfig.from_dict(json.loads((drafter / "config.json").read_text()), bare)
    other = json.loads((drafter / "config.json").read_text())
    other["dflash_config"]["first_draft"] = "eagle"
    with pytest.raises(ArtifactError, match="first_draft 'eagle'"):
        DrafterConfig.from_dict(other, ModelConfig.from_dir(ckpt))
