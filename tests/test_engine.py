"""The plain engine: batch invariance, reproducible seeds, stop rules, aborts, and refusals before any work."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines import make_engine, prompts, run
from ignis.errors import InputError, QueueFullError
from ignis.ipc.messages import EngineRequest
from ignis.params import SamplingParams
from tiny import tiny_checkpoint

VOCAB = 512


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), seed=11, mtp=True, vocab_size=VOCAB)


def test_greedy_output_is_the_same_alone_and_beside_three_others(ckpt: Path) -> None:
    # Long enough to prefill in several chunks; 65 and 129 leave one-row remainders that a tight row budget splits
    # off into a round of their own, while a lone request prefills them in one go.
    ps = [p[:n] for p, n in zip(prompts(4, VOCAB, seed=3, lo=150, hi=151), (65, 129, 40, 150))]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    together = run(make_engine(ckpt, lanes=4, max_rows=96), ps, params)
    for i, p in enumerate(ps):
        alone = run(make_engine(ckpt, lanes=1, max_rows=512), [p], params)["0"]
        assert alone.token_ids == together[str(i)].token_ids


def test_a_seeded_sample_is_reproducible_alone_and_beside_others(ckpt: Path) -> None:
    ps = prompts(4, VOCAB, seed=4, lo=5, hi=60)
    seeded = [SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=100 + i, ignore_eos=True) for i in range(4)]
    together = run(make_engine(ckpt, lanes=4), ps, seeded)
    alone = run(make_engine(ckpt, lanes=1), [ps[2]], [seeded[2]])["0"]
    assert alone.token_ids == together["2"].token_ids
    other_seed = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=999, ignore_eos=True)
    assert run(make_engine(ckpt, lanes=1), [ps[2]], [other_seed])["0"].token_ids != alone.token_ids


def test_stop_token_and_max_tokens_end_a_request(ckpt: Path) -> None:
    p = prompts(1, VOCAB, seed=5)[0]
    free = run(make_engine(ckpt), [p], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))["0"]
    assert len(free.token_ids) == 12 and free.finish_reason == "length"
    stop = free.token_ids[4]
    engine = make_engine(ckpt)
    engine.add(EngineRequest(id="s", prompt_token_ids=p, params=SamplingParams(max_tokens=12, temperature=0.0),
                             stop_token_ids=[stop]))
    got: list[int] = []
    while True:
        d = [d for d in engine.step() if d.id == "s"]
        if d:
            got += d[0].token_ids
            if d[0].finished:
                break
    first = free.token_ids.index(stop)
    assert got == free.token_ids[: first + 1] and d[0].finish_reason == "stop" and d[0].stop_token_id == stop


def test_context_limit_ends_with_length(ckpt: Path) -> None:
    p = prompts(1, VOCAB, seed=6, lo=50, hi=51)[0]
    out = run(make_engine(ckpt, context=64), [p], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))["0"]
    assert out.finish_reason == "length" and len(p) + len(out.token_ids) == 64


def test_abort_frees_the_lane_and_others_finish(ckpt: Path) -> None:
    engine = make_engine(ckpt, lanes=1)
    ps = prompts(2, VOCAB, seed=7)
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    engine.add(EngineRequest(id="a", prompt_token_ids=ps[0], params=params))
    engine.add(EngineRequest(id="b", prompt_token_ids=ps[1], params=params))
    engine.step()
    engine.step()
    (d,) = engine.abort(["a"])
    assert d.finished and d.finish_reason == "abort"
    assert engine.scheduler.lanes == [None]
    done = {}
    while "b" not in done:
        done.update({x.id: x for x in engine.step() if x.finished})
    assert engine.abort(["a", "nope"]) == []


@pytest.mark.parametrize(
    ("ids", "field"),
    [([], "prompt"), ([1] * 4096, "prompt"), ([1, VOCAB + 3], "prompt_token_ids")],
)
def test_bad_prompts_are_refused_and_the_engine_keeps_serving(ckpt: Path, ids: list[int], field: str) -> None:
    engine = make_engine(ckpt)
    with pytest.raises(InputError) as e:
        engine.add(EngineRequest(id="bad", prompt_token_ids=ids, params=SamplingParams()))
    assert e.value.field == field
    out = run(engine, [[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out["0"].token_ids) == 3


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"max_tokens": 0}, "max_tokens"), ({"temperature": -0.5}, "temperature"), ({"top_p": 0.0}, "top_p"),
     ({"top_p": 1.5}, "top_p"), ({"min_p": 2.0}, "min_p"), ({"top_k": -3}, "top_k"), ({"n": 0}, "n")],
)
def test_bad_sampling_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InputError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field and field in str(e.value)


def test_a_full_queue_refuses_without_queueing(ckpt: Path) -> None:
    engine = make_engine(ckpt, lanes=1, max_waiting=1)
    params = SamplingParams(max_tokens=2)
    engine.add(EngineRequest(id="0", prompt_token_ids=[1], params=params))
    engine.add(EngineRequest(id="1", prompt_token_ids=[1], params=params))
    with pytest.raises(QueueFullError):
        engine.add(EngineRequest(id="2", prompt_token_ids=[1], params=params))
    assert engine.scheduler.find("2") is None


def test_speculation_allocates_nothing_when_off(ckpt: Path) -> None:
    from ignis.model.cache import GDNState

    off, mtp = make_engine(ckpt, "off"), make_engine(ckpt, "mtp", draft_tokens=3)
    assert off.backend.nbytes() == 0
    assert all(s.rec_states is None and s.rec_inputs is None for s in off.runner.cache.layers if isinstance(s, GDNState))
    assert mtp.backend.nbytes() > 0 and mtp.runner.cache.nbytes() > off.runner.cache.nbytes()
