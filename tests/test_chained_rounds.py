"""Chained rounds (engine.rounds_per_sync): a plan of decoding lanes only queues several rounds on the device, each
taking its inputs from the last one's outputs, before the host reads them. The output must be the single rounds'
output token for token (greedy, seeded sampling, a stop token met in the middle of a chain), a request that stops
early in a chain must leave nothing wrong behind (its lane's state ran on: it is not retained), and a plan chains only
where every lane has room for every round and nothing needs the host between them.

On the CPU with `model.exact = off` the engine decodes through the device round, eagerly: the same code the GPU
captures as CUDA graphs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from device_work import FAST, VOCAB, ckpt, reference, work  # noqa: F401 (fixtures)
from engines import decoding, make_engine, prompts, run, until_finished
from ignis.engine.device_round import DeviceRound
from ignis.engine.pages import Pages
from ignis.engine.request import Request
from ignis.engine.scheduler import Scheduler
from ignis.ipc.messages import EngineRequest
from ignis.params import SamplingParams


def _count_chains(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rounds of every device round started (DeviceRound.start's second argument)."""
    seen: list[int] = []
    start = DeviceRound.start

    def spy(self: DeviceRound, decodes, rounds: int = 1):  # type: ignore[no-untyped-def]
        seen.append(rounds)
        return start(self, decodes, rounds)

    monkeypatch.setattr(DeviceRound, "start", spy)
    return seen


@pytest.mark.parametrize("backend,k,rounds", [("off", 0, 3), ("mtp", 3, 2), ("mtp", 3, 3), ("dflash2", 7, 2)])
def test_chained_rounds_give_the_exact_off_output(ckpt: Path, work, reference, backend: str, k: int, rounds: int,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    ps, params = work
    seen = _count_chains(monkeypatch)
    engine = make_engine(ckpt, backend, draft_tokens=k, model=FAST, lanes=4, rounds_per_sync=rounds)
    out = run(engine, ps, params)
    for rid, ref in reference.items():
        assert out[rid].token_ids == ref, f"request {rid} diverged from the exact off round"
    assert rounds in seen and 1 in seen, seen  # chained while every lane had room, single rounds near the ends
    s = engine.stats()
    assert s.rounds == sum(o.stats.rounds for o in out.values())  # every chained round counted once
    if k:  # the drafter saw each chained round as a single one: the same drafts, kept as often
        single = make_engine(ckpt, backend, draft_tokens=k, model=FAST, lanes=4)
        run(single, ps, params)
        one = single.stats()
        assert s.drafted > 0 and (s.rounds, s.drafted, s.position_accepted) == (one.rounds, one.drafted,
                                                                              one.position_accepted)


def test_a_seeded_sampled_request_draws_the_same_tokens_chained(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The device's draws are keyed by the request's seed and each round's positions, which a chained round takes
    from the last one's outputs on the device: the same tokens as single rounds, alone or beside greedy lanes."""
    ps = prompts(3, VOCAB, seed=13, lo=5, hi=30)
    sampled = SamplingParams(max_tokens=40, temperature=0.9, top_p=0.9, top_k=50, seed=77, ignore_eos=True)
    others = [SamplingParams(max_tokens=33, temperature=0.0, ignore_eos=True)] * 2
    single = run(make_engine(ckpt, "dflash2", draft_tokens=7, model=FAST, lanes=3), ps, [sampled, *others])
    seen = _count_chains(monkeypatch)
    chained = run(make_engine(ckpt, "dflash2", draft_tokens=7, model=FAST, lanes=3, rounds_per_sync=2), ps,
                  [sampled, *others])
    assert 2 in seen
    assert {k: v.token_ids for k, v in chained.items()} == {k: v.token_ids for k, v in single.items()}
    assert len(chained["0"].token_ids) == 40


def test_a_stop_inside_a_chain_ends_the_output_there_and_keeps_no_state(ckpt: Path, reference, work,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop token met before a chain's last round ends the request there: the later rounds' tokens are not
    emitted, and its lane, which ran on, is not retained; a follow-up that extends the request's text prefills it
    and gives what a fresh engine gives. A stop in a chain's last round leaves the lane as a single round would: the
    follow-up resumes from it."""
    from ignis.engine.core import Engine

    ps, _ = work
    ref = reference["5"]  # 55 greedy tokens, ignoring EOS
    overruns: list[str] = []
    finish = Engine._finish

    def spy(self: Engine, e):  # type: ignore[no-untyped-def]
        delta = finish(self, e)
        if delta is None:
            overruns.append(e.request.id)
        return delta

    monkeypatch.setattr(Engine, "_finish", spy)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    resumed = {}
    for at in range(12, 30):
        if ref[at] in ref[:at]:
            continue
        overruns.clear()
        engine = make_engine(ckpt, "mtp", draft_tokens=3, model=FAST, lanes=2, rounds_per_sync=3)
        out = until_finished(engine, EngineRequest(id="s", prompt_token_ids=ps[5], stop_token_ids=[ref[at]],
                                                    params=SamplingParams(max_tokens=55, temperature=0.0)))
        assert out == ref[: at + 1]
        follow = ps[5] + ref[: at + 1] + [7, 8, 9]
        got = until_finished(engine, EngineRequest(id="f", prompt_token_ids=follow, params=greedy))
        assert got == run(make_engine(ckpt, "off", lanes=1), [follow], greedy)["0"].token_ids
        resumed[bool(overruns)] = engine.stats().prompt_tokens_resumed_total
        if len(resumed) == 2:
            break
    assert resumed == {True: 0, False: resumed[False]} and resumed[False] > 0, resumed  # both cases met


def test_a_plan_chains_only_decoding_lanes_with_room_for_every_round() -> None:
    def plan(*reqs: Request, rounds: int = 2, context: int = 256, pages: Pages | None = None):  # type: ignore[no-untyped-def]
        s = Scheduler(lanes=4, max_rows=512, prefill_chunk=64, max_waiting=4, draft_tokens=3, context=context,
                      rounds_per_sync=rounds, pages=pages)
        for i, r in enumerate(reqs):
            r.lane = i
            s.lanes[i] = r
        return s.plan()

    assert plan(decoding("a", 10, 100), decoding("b", 20, 100)).rounds == 2
    assert plan(decoding("a", 10, 100), rounds=1).rounds == 1
    assert plan(decoding("a", 10, 100), rounds=4).rounds == 4
    assert plan(decoding("a", 10, 8), decoding("b", 20, 100)).rounds == 1  # 7 tokens left: fewer than 2 x 4
    assert plan(decoding("a", 10, 9)).rounds == 2  # 8 left: two rounds of 4 columns
    assert plan(decoding("a", 250, 100), context=256).rounds == 1  # 5 positions of context left
    assert plan(decoding("a", 10, 100, logprobs=2)).rounds == 1  # its verify logits are read every round
    prefilling = decoding("p", 10, 100)
    prefilling.computed = 3
    assert plan(decoding("a", 10, 100), prefilling).rounds == 1  # a prompt prefills in this plan
    # 60 positions computed: one round of 4 columns fits the first 64-position page, two need a second page, which
    # only a free page gives (chaining never preempts or evicts)
    assert plan(decoding("a", 60, 100), pages=Pages(pages=1, page=64, lanes=4, width=8)).rounds == 1
    assert plan(decoding("a", 60, 100), pages=Pages(pages=2, page=64, lanes=4, width=8)).rounds == 2
