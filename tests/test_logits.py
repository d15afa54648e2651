"""Penalties, logit_bias and grammar masks: they change what the model says, identically with and without speculation.

The built-in pair is used because its drafter is trained: drafts are accepted often, so the per-column shaping (column
j sees the drafts before it) is exercised on real multi-token rounds.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import torch

from engines import make_engine, run
from ignis.artifact import BUILTIN
from ignis.engine.logits import LogitsShaper
from ignis.errors import InputError
from ignis.ipc.messages import EngineRequest
from ignis.params import SamplingParams, StructuredOutputs
from ignis.tokenizer import Tokenizer

TOK = Tokenizer.from_dir(BUILTIN)
LINES = (BUILTIN / "heldout_prompts.jsonl").read_text().splitlines()
PROMPTS = [TOK.encode(json.loads(line)["prompt"])[-64:] for line in LINES[8:11]]
PENALISED: list[dict[str, Any]] = [
    dict(presence_penalty=1.5),
    dict(frequency_penalty=2.0),
    dict(repetition_penalty=1.6),
]


def greedy(max_tokens: int = 32, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def plain() -> Any:
    return make_engine(BUILTIN, "off", lanes=4)


def test_each_penalty_changes_greedy_output_and_speculation_keeps_it(plain: Any) -> None:
    base = run(plain, PROMPTS, greedy())
    bias = {base["0"].token_ids[5]: -100.0, base["0"].token_ids[9]: -50.0, 202: 2.5}
    kinds = PENALISED + [dict(logit_bias=bias)]
    params = [greedy(**kw) for kw in kinds]
    ps = PROMPTS + PROMPTS[:1]
    want = run(plain, ps, params)
    for i, kw in enumerate(kinds):
        assert want[str(i)].token_ids != base[str(i % len(PROMPTS))].token_ids, kw
    engine = make_engine(BUILTIN, "dflash2", draft_tokens=7, lanes=4)
    got = run(engine, ps, params)
    assert all(got[r].token_ids == want[r].token_ids for r in want)
    assert engine.stats().accepted > engine.stats().rounds // 2
    engine = make_engine(BUILTIN, "mtp", draft_tokens=3, lanes=4)
    got = run(engine, ps[1:3], params[1:3])
    assert all(got[r].token_ids == want[str(int(r) + 1)].token_ids for r in got)


def test_a_banned_token_never_appears_on_either_round(plain: Any) -> None:
    """The exact host round, and an engine that decodes through the device round (model.exact off), which must hand
    lanes whose logits are shaped to the host round."""
    free = run(plain, PROMPTS[:1], greedy(32))["0"].token_ids
    banned = free[3]
    fast = make_engine(BUILTIN, "dflash2", draft_tokens=7, lanes=2, model={"exact": "off"})
    assert fast.runner.device_round is not None
    for engine in (plain, fast):
        got = run(engine, PROMPTS[:1], greedy(32, logit_bias={banned: -100.0}))["0"].token_ids
        assert banned not in got


def test_column_j_sees_the_drafts_before_it() -> None:
    """Shaping [anchor, d0, d1] at once equals shaping each position alone after committing the drafts."""
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = SamplingParams(temperature=0.0, presence_penalty=0.7, frequency_penalty=0.3, repetition_penalty=1.3)
    prompt, drafts = [5, 6, 7], [7, 9]
    together = LogitsShaper(params, len(prompt)).shape(logits, prompt + [8], drafts)
    for j in range(3):
        alone = LogitsShaper(params, len(prompt)).shape(logits[j : j + 1], prompt + [8] + drafts[:j], [])
        assert torch.equal(together[j], alone[0]), j


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "size": {"type": "integer"},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "size", "tags"],
    "additionalProperties": False,
}


def run_to_eos(engine: Any, ps: list[list[int]], params: list[SamplingParams]) -> dict[str, list[int]]:
    for i, (ids, p) in enumerate(zip(ps, params)):
        engine.add(EngineRequest(id=str(i), prompt_token_ids=ids, params=p, stop_token_ids=list(TOK.eos_token_ids)))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(ps))}
    done: dict[str, str | None] = {}
    while len(done) < len(ps):
        for d in engine.step():
            out[d.id] += d.token_ids
            if d.finished:
                done[d.id] = d.finish_reason
    assert all(reason == "stop" for reason in done.values()), done
    return out


def test_json_schema_output_validates_and_speculation_keeps_it(plain: Any) -> None:
    spec = StructuredOutputs(json=json.dumps(SCHEMA))
    greedy_params = SamplingParams(max_tokens=80, temperature=0.0, structured_outputs=spec)
    sampled = [SamplingParams(max_tokens=80, temperature=1.0, seed=1, structured_outputs=spec)]
    ps = PROMPTS[:2]
    want = run_to_eos(plain, ps, [greedy_params, *sampled])
    engine = make_engine(BUILTIN, "dflash2", draft_tokens=7, lanes=4)
    got = run_to_eos(engine, ps, [greedy_params, *sampled])
    assert got["0"] == want["0"]
    for out in (*want.values(), *got.values()):
        jsonschema.validate(json.loads(TOK.decode(out)), SCHEMA)
    assert engine.stats().accepted > 0


def test_regex_and_choice_force_the_text(plain: Any) -> None:
    ps = PROMPTS[:2]
    specs = [StructuredOutputs(regex=r"def [a-z]{3,8}\(\):"), StructuredOutputs(choice=("yes", "no thanks"))]
    got = run_to_eos(plain, ps, [SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=s) for s in specs])
    assert re.fullmatch(r"def [a-z]{3,8}\(\):", TOK.decode(got["0"]))
    assert TOK.decode(got["1"]) in ("yes", "no thanks")


def test_bad_grammar_and_bias_are_refused_before_any_work(plain: Any) -> None:
    bad = [
        ("structured_outputs", SamplingParams(structured_outputs=StructuredOutputs(json='{"type": "objectx"}'))),
        ("structured_outputs", SamplingParams(structured_outputs=StructuredOutputs(regex="(unclosed"))),
        ("logit_bias", SamplingParams(logit_bias={10**6: 1.0})),
    ]
    for field, params in bad:
        with pytest.raises(InputError) as e:
            plain.add(EngineRequest(id="bad", prompt_token_ids=[5, 6], params=params))
        assert e.value.field == field
    assert not plain.has_work()
    with pytest.raises(InputError, match="presence_penalty"):
        SamplingParams(presence_penalty=3.0)
    with pytest.raises(InputError, match="structured_outputs"):
        StructuredOutputs(json="{}", regex="x")
