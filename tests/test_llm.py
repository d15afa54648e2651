"""The Python API a user writes: LLM.generate / LLM.chat over a model directory with a real tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ignis import LLM, SamplingParams
from ignis.artifact import BUILTIN
from ignis.errors import InputError
from tiny import tiny_checkpoint


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory):
    path = tiny_checkpoint(tmp_path_factory.mktemp("llm"), seed=2, mtp=True, vocab_size=8192)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUILTIN / name, Path(path) / name)
    with LLM(str(path), profile="cpu", overrides={"log.level": "warning", "spec.backend": "off"}) as llm:
        yield llm


def test_generate_returns_text_tokens_reason_and_metrics(llm: LLM) -> None:
    outs = llm.generate(["def fib(n):", "import os\n"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [o.prompt for o in outs] == ["def fib(n):", "import os\n"]
    for o in outs:
        c = o.outputs[0]
        assert len(c.token_ids) == 8 and c.finish_reason == "length"
        assert c.text == llm.tokenizer.decode(c.token_ids)
        m = o.metrics
        assert m["prompt_tokens"] == len(o.prompt_token_ids) and m["decode_tokens"] == 8
        for key in ("prompt_ms", "decode_ms", "tokens_per_s", "rounds", "drafted", "accepted"):
            assert key in m


def test_token_id_prompts_and_chat(llm: LLM) -> None:
    (o,) = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, ignore_eos=True))
    assert o.prompt_token_ids == [5, 6, 7] and len(o.outputs[0].token_ids) == 4
    (c,) = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3, ignore_eos=True))
    assert c.prompt.startswith("<|im_start|>user\nhi<|im_end|>") and c.prompt.endswith("<|im_start|>assistant\n")


def test_a_follow_up_that_extends_a_finished_request_reports_the_tokens_it_resumed(llm: LLM) -> None:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = list(range(300, 340))
    (a,) = llm.generate([{"prompt_token_ids": first}], params)
    assert a.metrics["prompt_tokens_resumed"] == 0
    follow = first + a.outputs[0].token_ids + [11, 12]
    (b,) = llm.generate([{"prompt_token_ids": follow}], params)
    # Everything the first request ran through the model: its prompt and its output but the last token.
    assert b.metrics["prompt_tokens_resumed"] == len(first) + 3 and b.metrics["prompt_tokens"] == len(follow)


def test_stop_string_cuts_the_text(llm: LLM) -> None:
    free = llm.generate(["x = "], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0].outputs[0]
    stop = free.text[5:7]
    assert stop and stop in free.text
    cut = llm.generate(["x = "], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop]))
    c = cut[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop and c.text == free.text[: free.text.index(stop)]


def test_n_samples_with_a_seed_are_reproducible(llm: LLM) -> None:
    p = SamplingParams(max_tokens=10, temperature=1.0, seed=7, n=3, ignore_eos=True)
    a, b = llm.generate("def", p)[0], llm.generate("def", p)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs] and len(a.outputs) == 3


def test_bad_prompt_is_refused_before_any_request_runs(llm: LLM) -> None:
    with pytest.raises(InputError) as e:
        llm.generate(["fine", ""], SamplingParams(max_tokens=2))
    assert e.value.field == "prompts[1].prompt"
    with pytest.raises(InputError):
        llm.generate([{"prompt_token_ids": [5] * 5000}], SamplingParams(max_tokens=2))
    assert llm.client.stats().running == 0 and llm.client.stats().waiting == 0


def test_a_batch_larger_than_lanes_and_queue_runs_whole(tmp_path: Path) -> None:
    path = tiny_checkpoint(tmp_path, seed=4, mtp=False, vocab_size=8192)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUILTIN / name, path / name)
    overrides = {"log.level": "warning", "engine.lanes": 1, "engine.max_waiting": 1, "spec.backend": "off"}
    with LLM(str(path), profile="cpu", overrides=overrides) as small:
        outs = small.generate([f"x{i} = " for i in range(5)], SamplingParams(max_tokens=3, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [3] * 5
