"""The bookkeeping around retained slots and long prompts, without a model: what a slot's ids are, which slot a prompt
matches, where a resumed prefill is cut, that decoding lanes keep decoding while a long prompt prefills, and how the
resumed tokens reach outputs and the OpenAI usage."""

from __future__ import annotations

from ignis.client.llm import _add_metrics
from ignis.engine.request import Request
from ignis.engine.retain import Moves, Retained
from ignis.engine.sampling import make_generator
from ignis.engine.scheduler import Scheduler
from ignis.ipc.messages import RequestStats
from ignis.params import SamplingParams
from ignis.server.generation import usage


def request(prompt: list[int], max_tokens: int = 8, stop: frozenset[int] = frozenset()) -> Request:
    return Request(id=str(prompt[:3]), prompt=prompt, params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
                   stop_ids=stop, generator=make_generator(0))


def test_a_slot_holds_the_covered_tokens_and_the_one_after_even_past_a_stop_token() -> None:
    r = request([5, 6, 7], stop=frozenset({9}))
    r.computed = 3
    r.emit([8], context=100)  # prefill done: 8 is the anchor, not yet run
    assert r.state_ids() == [5, 6, 7, 8]
    r.computed += 4  # a round committed the anchor and three drafts; the model's own token is 11
    assert r.emit([1, 9, 10, 11], context=100) == [1, 9]  # the stop token ends the output
    assert r.tokens == [5, 6, 7, 8, 1, 9] and r.unemitted == [10, 11]
    assert r.state_ids() == [5, 6, 7, 8, 1, 9, 10, 11]  # positions 0..6 ran; 11 follows them
    aborted = request(list(range(20, 40)))
    aborted.computed = 16  # mid-prefill
    assert aborted.state_ids() == list(range(20, 37))
    forced = request([1, 2, 3])
    forced.forced, forced.computed = [4], 3
    assert forced.state_ids() is None and request([1, 2]).state_ids() is None


def test_a_prompt_matches_the_longest_slot_whose_ids_are_all_its_prefix() -> None:
    kept = Retained(10**9, lambda n: 100 * n)
    kept.keep(0, [1, 2, 3])
    kept.keep(1, [1, 2, 3, 4, 5])
    kept.keep(2, [1, 7, 3, 4, 5, 6])
    assert kept.match([1, 2, 3, 4, 5, 9])
    assert kept.match([1, 2, 3, 4, 5, 9]).lane == 1  # type: ignore[union-attr]
    assert kept.match([1, 2, 3, 4, 6]).lane == 0  # type: ignore[union-attr]  # diverges inside the longer one
    assert kept.match([1, 2, 3]).lane == 0  # type: ignore[union-attr]
    assert kept.match([1, 2]) is None and kept.match([2, 2, 3, 4]) is None
    assert kept.match([1, 7, 3, 4, 5, 7]) is None  # every covered position equal, the token after them not


def test_a_host_slot_being_restored_is_never_dropped_to_make_room() -> None:
    kept = Retained(250, lambda n: 50 * n)  # bytes of a state covering n positions
    for lane, ids in ((0, [1, 2, 3]), (1, [4, 5, 6])):  # 2 positions each: 100 bytes
        kept.keep(lane, ids)
        kept.vacate(lane, Moves())
    assert [s.lane for s in kept.slots.values()] == [-1, -1] and kept.host_used == 200
    slot = kept.match([1, 2, 3, 9])
    assert slot is not None
    moves = Moves()
    assert kept.claim(slot, moves, 0) == 2
    kept.keep(0, [7, 8, 9, 10, 11])  # pretend lane 0 held a 4-position state (200 bytes) as well
    kept.vacate(0, moves)  # 100 being restored + 200 > 250 whatever else goes: dropped, and nothing else is
    assert moves.saves == [] and moves.drops == [] and [r.key for r in moves.restores] == [slot.key]
    assert kept.host_used == 200
    kept.keep(0, [12, 13, 14])  # 100 bytes: fits once the other host slot is dropped
    kept.vacate(0, moves)
    assert len(moves.saves) == 1 and len(moves.drops) == 1 and kept.host_used == 200
    kept.settle()
    assert kept.host_used == 100


def test_a_resumed_prefill_first_runs_to_the_next_chunk_multiple_then_whole_chunks() -> None:
    s = Scheduler(lanes=1, max_rows=512, prefill_chunk=64, max_waiting=4, draft_tokens=0, context=1024,
                  retained=Retained(10**9, lambda n: n))
    s.retained.keep(0, list(range(3, 74)))  # type: ignore[union-attr]  # 70 positions covered
    r = request(list(range(3, 74)) + list(range(100, 300)))
    s.add(r)
    cuts = []
    while r.prefilling:
        (p,) = s.plan().prefill
        cuts.append((r.computed, p.length))
        r.computed += p.length
    assert cuts == [(70, 58), (128, 143)]  # to 128, then what is left (within the budget of 512 rows)
    assert r.resumed == 70 and r.stats.prompt_tokens_resumed == 70


def test_decoding_lanes_decode_every_round_while_a_long_prompt_prefills() -> None:
    s = Scheduler(lanes=2, max_rows=128, prefill_chunk=64, max_waiting=4, draft_tokens=3, context=4096)
    short, long = request([1, 2, 3], max_tokens=100), request(list(range(1000)))
    s.add(short)
    s.add(long)
    s.plan()
    short.computed, short.tokens = 3, [1, 2, 3, 4]  # prefilled in the first round (beside long's first chunk)
    long.computed = 64
    rounds = 0
    while long.prefilling:
        plan = s.plan()
        assert [d.request for d in plan.decode] == [short] and plan.decode[0].drafts == 3
        (p,) = plan.prefill
        assert p.length == min(64, 1000 - long.computed) and 4 + p.length <= 128
        long.computed += p.length
        rounds += 1
    assert rounds == 15  # 1000 - 64 positions, a chunk a round, each round also verifying short's drafts


def test_resumed_tokens_reach_output_metrics_and_openai_usage() -> None:
    a = RequestStats(prompt_tokens=100, prompt_tokens_resumed=0)
    b = RequestStats(prompt_tokens=100, prompt_tokens_resumed=90)
    metrics: dict = {}
    _add_metrics(metrics, a)
    _add_metrics(metrics, b)  # two samples of one prompt: the one that resumed
    assert metrics["prompt_tokens"] == 100 and metrics["prompt_tokens_resumed"] == 90
    u = usage([[0] * 100, [0] * 50], 7, [a, b, RequestStats(prompt_tokens_resumed=40), None])
    assert u["prompt_tokens"] == 150 and u["prompt_tokens_details"] == {"cached_tokens": 130}
    assert usage([[0] * 5], 1)["prompt_tokens_details"] == {"cached_tokens": 0}
