"""Rounds queued before the host reads the last one (engine.async_scheduling): a step queues a round of decoding
lanes and returns; the next step queues the lanes' next round from the first one's outputs on the device (where
`Scheduler.follow` lets it), then reads the first. The output must be the synchronous rounds' output token for token
(greedy, seeded sampling), a request that stops or is aborted while its next round runs must leave nothing wrong
behind (its lane ran on: its state is not retained), a request that arrives while rounds follow one another is
admitted, and a round follows only where every lane has room for it and nothing needs the host first.

On the CPU with `model.exact = off` the engine decodes through the device round, eagerly: the same code the GPU
captures as CUDA graphs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from device_work import FAST, VOCAB, ckpt, reference, work  # noqa: F401 (fixtures)
from engines import decoding, make_engine, prompts, run, until_finished
from ignis.engine.core import Engine
from ignis.engine.device_round import DeviceRound
from ignis.engine.pages import Pages
from ignis.engine.request import Request
from ignis.engine.scheduler import Decode, Scheduler
from ignis.ipc.messages import EngineRequest
from ignis.params import SamplingParams


def _count_follows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry for every round queued before the host read the one before it (DeviceRound.follow)."""
    seen: list[int] = []
    follow = DeviceRound.follow

    def spy(self: DeviceRound, launched):  # type: ignore[no-untyped-def]
        seen.append(len(launched.decodes))
        return follow(self, launched)

    monkeypatch.setattr(DeviceRound, "follow", spy)
    return seen


@pytest.mark.parametrize("backend,k", [("off", 0), ("mtp", 3), ("dflash2", 7)])
def test_async_rounds_give_the_exact_off_output_and_the_synchronous_rounds_stats(
        ckpt: Path, work, reference, backend: str, k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    ps, params = work
    follows = _count_follows(monkeypatch)
    engine = make_engine(ckpt, backend, draft_tokens=k, model=FAST, lanes=4)
    assert engine.config.engine.async_scheduling  # the default
    out = run(engine, ps, params)
    for rid, ref in reference.items():
        assert out[rid].token_ids == ref, f"request {rid} diverged from the exact off round"
    assert len(follows) >= 10 and 4 in follows, follows  # four lanes' rounds followed one another
    s = engine.stats()
    assert s.rounds == sum(o.stats.rounds for o in out.values())  # a round that ran on for nothing is not counted
    synchronous = make_engine(ckpt, backend, draft_tokens=k, model=FAST, lanes=4, async_scheduling=False)
    run(synchronous, ps, params)
    one = synchronous.stats()
    assert (s.rounds, s.drafted, s.accepted, s.position_accepted) == (one.rounds, one.drafted, one.accepted,
                                                                      one.position_accepted)


def test_a_seeded_sampled_request_draws_the_same_tokens_beside_greedy_lanes(ckpt: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The device's draws are keyed by the request's seed and each round's positions, which a followed round takes
    from the last one's outputs on the device: the same tokens as synchronous rounds."""
    ps = prompts(3, VOCAB, seed=13, lo=5, hi=30)
    sampled = SamplingParams(max_tokens=40, temperature=0.9, top_p=0.9, top_k=50, seed=77, ignore_eos=True)
    others = [SamplingParams(max_tokens=33, temperature=0.0, ignore_eos=True)] * 2
    synchronous = run(make_engine(ckpt, "dflash2", draft_tokens=7, model=FAST, lanes=3, async_scheduling=False), ps,
                      [sampled, *others])
    follows = _count_follows(monkeypatch)
    overlapped = run(make_engine(ckpt, "dflash2", draft_tokens=7, model=FAST, lanes=3), ps, [sampled, *others])
    assert follows
    assert {k: v.token_ids for k, v in overlapped.items()} == {k: v.token_ids for k, v in synchronous.items()}
    assert len(overlapped["0"].token_ids) == 40


def test_a_stop_while_the_next_round_runs_ends_the_output_there_and_keeps_no_state(
        ckpt: Path, reference, work, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop token met in a round whose lanes' next round was already queued ends the request there: the next
    round's tokens are not emitted, and its lane, which ran on, is not retained; a follow-up that extends the
    request's text prefills it and gives what a fresh engine gives. A stop in a round nothing followed leaves the lane
    as a synchronous round would: the follow-up resumes from it."""
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
    # a stop early on (a round followed it) and one near max_tokens (no room for a round to follow)
    for at in [*range(4, 20), *range(54, 44, -1)]:
        if ref[at] in ref[:at] or (at < 20 and True in resumed) or (at >= 44 and False in resumed):
            continue
        overruns.clear()
        engine = make_engine(ckpt, "mtp", draft_tokens=3, model=FAST, lanes=2)
        out = until_finished(engine, EngineRequest(id="s", prompt_token_ids=ps[5], stop_token_ids=[ref[at]],
                                                    params=SamplingParams(max_tokens=55, temperature=0.0)))
        assert out == ref[: at + 1]
        ran_on = engine.has_work()  # the round queued after the stop's is still to be read
        assert ran_on == (engine._pending is not None)
        follow = ps[5] + ref[: at + 1] + [7, 8, 9]
        got = until_finished(engine, EngineRequest(id="f", prompt_token_ids=follow, params=greedy))
        assert got == run(make_engine(ckpt, "off", lanes=1), [follow], greedy)["0"].token_ids
        assert overruns == (["s"] if ran_on else [])  # read, and dropped
        resumed[ran_on] = engine.stats().prompt_tokens_resumed_total
        if len(resumed) == 2:
            break
    assert resumed == {True: 0, False: resumed[False]} and resumed[False] > 0, resumed  # both cases met


def test_an_abort_while_rounds_follow_ends_that_request_alone(ckpt: Path, work, reference) -> None:
    """Aborted between steps, while its next round runs: it emits nothing more, its lane's state is not retained, and
    the others' outputs are the exact off output."""
    ps, params = work
    engine = make_engine(ckpt, "dflash2", draft_tokens=7, model=FAST, lanes=4)
    for i in range(4):
        engine.add(EngineRequest(id=str(i), prompt_token_ids=ps[i], params=params[i]))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(4)}
    finished: dict[str, str | None] = {}
    steps = 0
    while len(finished) < 4:
        steps += 1
        if steps == 6:
            assert engine._pending is not None  # a round of all four lanes is queued and unread
            [delta] = engine.abort(["2"])
            assert delta.finished and delta.finish_reason == "abort"
            finished["2"] = "abort"
        for d in engine.step():
            assert d.id != "2" or steps < 6, "an aborted request emitted tokens"
            tokens[d.id] += d.token_ids
            if d.finished:
                finished[d.id] = d.finish_reason
    for rid in ("0", "1", "3"):
        assert tokens[rid] == reference[rid] and finished[rid] == "length"
    assert tokens["2"] == reference["2"][: len(tokens["2"])] and len(tokens["2"]) < len(reference["2"])
    assert engine.stats().retained_slots == 3  # the three that ran to their ends, not the aborted one
    assert not engine.has_work()


def test_a_request_arriving_while_rounds_follow_is_admitted(ckpt: Path, work, reference) -> None:
    """A waiting request and a free lane stop the rounds from following: the pending one is read and the next plan
    admits it, in the step after it arrives."""
    ps, params = work
    engine = make_engine(ckpt, "dflash2", draft_tokens=7, model=FAST, lanes=2)
    engine.add(EngineRequest(id="5", prompt_token_ids=ps[5], params=params[5]))
    out: dict[str, list[int]] = {"5": [], "1": []}
    for _ in range(4):
        for d in engine.step():
            out[d.id] += d.token_ids
    assert engine._pending is not None
    engine.add(EngineRequest(id="1", prompt_token_ids=ps[1], params=params[1]))
    for d in engine.step():  # reads the pending round; nothing follows it
        out[d.id] += d.token_ids
    assert engine._pending is None
    for d in engine.step():  # the plan prefills "1" beside "5"'s next round
        out[d.id] += d.token_ids
    assert engine.scheduler.find("1").lane >= 0  # type: ignore[union-attr]
    while engine.has_work():
        for d in engine.step():
            out[d.id] += d.token_ids
    assert out["5"][: len(reference["5"])] == reference["5"] and out["1"] == reference["1"]


def test_a_round_follows_only_lanes_with_room_for_both_rounds_and_no_one_to_admit() -> None:
    def follow(*reqs: Request, drafts: int = 3, context: int = 256, pages: Pages | None = None,
               waiting: bool = False, lanes: int = 4):  # type: ignore[no-untyped-def]
        s = Scheduler(lanes=lanes, max_rows=512, prefill_chunk=64, max_waiting=4, draft_tokens=3, context=context,
                      pages=pages)
        for i, r in enumerate(reqs):
            r.lane = i
            s.lanes[i] = r
        if waiting:
            s.add(decoding("w", 5, 10))
        return s.follow([Decode(r, drafts) for r in reqs])

    assert follow(decoding("a", 10, 100), decoding("b", 20, 100)) == []
    assert follow(decoding("a", 10, 8)) is None  # 7 tokens left: fewer than two rounds of 4 columns
    assert follow(decoding("a", 10, 9)) == []  # 8 left: two rounds of 4 columns
    assert follow(decoding("a", 250, 100), context=256) is None  # 5 positions of context left
    assert follow(decoding("a", 10, 100, logprobs=2)) is None  # its verify logits are read every round
    assert follow(decoding("a", 10, 100), waiting=True) is None  # a plan admits the waiting request first
    assert follow(decoding("a", 10, 100), waiting=True, lanes=1) == []  # no lane for it: it waits either way
    done = decoding("a", 10, 100)
    done.finish_reason = "stop"
    assert follow(done) is None  # stopped in the round being read: the host ends it first
    # 60 positions computed: two rounds of 4 columns need a second 64-position page, which only a free one gives
    assert follow(decoding("a", 60, 100), pages=Pages(pages=1, page=64, lanes=4, width=8)) is None
    two = Pages(pages=2, page=64, lanes=4, width=8)
    assert two.grow(0, 60)
    two.take_updates()
    assert follow(decoding("a", 60, 100), pages=two) == [(0, 1, two.lanes[0][1])]  # its second page, mapped


def test_streams_through_the_engine_process_get_their_own_tokens_and_cancelled_ones_free_their_lanes(
        tmp_path: Path) -> None:
    """The engine process's loop steps the engine while rounds follow one another (it has work while a round is
    queued): 12 concurrent greedy streams get the tokens each gets alone, and cancelling 4 long ones mid-stream leaves
    every lane free."""
    import asyncio
    import random
    import time

    from ignis import AsyncLLM
    from ignis.engine.process import EngineProcess
    from ignis.ipc.addresses import private_ipc_address
    from serving import config, tiny_artifact

    model = tiny_artifact(tmp_path)
    overrides = {"log.level": "warning", "engine.context": 512, "engine.lanes": 8, "spec.backend": "off",
                 "model.exact": "off"}
    rng = random.Random(9)
    ps = [[rng.randrange(4, 8192) for _ in range(rng.randrange(3, 30))] for _ in range(6)]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    addr = private_ipc_address()
    proc = EngineProcess(config(model, **{k: v for k, v in overrides.items() if k != "log.level"}), addr.address)

    async def tokens(llm: AsyncLLM, p: list[int], params: SamplingParams) -> list[int]:
        out: list[int] = []
        async for o in llm.stream(p, params):
            out.extend(o.token_ids)
        return out

    async def main() -> tuple[list[list[int]], list[list[int]]]:
        async with AsyncLLM(str(model), profile="cpu", overrides=overrides, address=addr.address) as llm:
            alone = [await tokens(llm, p, greedy) for p in ps]
            started = asyncio.Event()

            async def doomed(p: list[int]) -> None:
                async for _ in llm.stream(p, long):
                    started.set()

            kept = [asyncio.create_task(tokens(llm, ps[i % 6], greedy)) for i in range(12)]
            cancelled = [asyncio.create_task(doomed(ps[i])) for i in range(4)]
            await started.wait()
            for t in cancelled:
                t.cancel()
            together = await asyncio.gather(*kept)
            deadline = time.monotonic() + 30
            while (s := await llm.client.stats()).running or s.waiting:
                assert time.monotonic() < deadline, f"lanes still held: {s.running} running, {s.waiting} waiting"
                await asyncio.sleep(0.05)
            return alone, together

    try:
        alone, together = asyncio.run(main())
    finally:
        proc.stop()
        addr.close()
    assert all(len(t) == 24 for t in alone)
    assert together == [alone[i % 6] for i in range(12)]


def test_a_round_whose_lane_lacks_the_page_of_its_last_position_is_refused(ckpt: Path) -> None:
    """Runner._check_pages (every plan and every followed round): the table's host mirror must map the page of the
    last position a lane's round writes; a row short of it is refused before anything is queued."""
    from ignis.engine.round import Runner

    engine = make_engine(ckpt, "dflash2", draft_tokens=7, model=FAST, lanes=2, context=256)
    engine.add(EngineRequest(id="a", prompt_token_ids=list(range(3, 60)), params=SamplingParams(max_tokens=30)))
    engine.step()  # the prompt, and its first token
    r = engine.scheduler.find("a")
    assert r is not None and r.lane >= 0 and not r.prefilling
    pool = engine.runner.cache.pool
    decode = Decode(r, 7)
    end = r.computed + 8
    plan = engine.scheduler.plan()  # the lane's pages for the round, mapped as the runner maps them
    pool.map(plan.pages)
    Runner._check_pages(engine.runner, plan)  # holds
    assert pool.maps_last([r.lane], [end]).all() and not pool.maps_last([r.lane], [pool.width * pool.page + 1]).any()
    pool.map([(r.lane, (end - 1) // pool.page, 0)])  # the page of its last column taken away
    with pytest.raises(AssertionError, match=f"lane {r.lane} writes positions up to {end - 1}"):
        Runner._check_pages(engine.runner, type(plan)([], [decode], []))
