"""Who gets K/V pages when there are too few, without a model: a waiting request waits until the pool can hold its
prompt, a retained slot gives its pages up before any request is preempted, and a decoding lane that needs a page
preempts the newest running request (requeued in front, to prefill its prompt and output again), never an older
one."""

from __future__ import annotations

from ignis.engine.pages import Pages
from ignis.engine.request import Request
from ignis.engine.retain import Retained
from ignis.engine.sampling import make_generator
from ignis.engine.scheduler import Scheduler
from ignis.params import SamplingParams

PAGE = 64


def request(n: int, first: int = 3) -> Request:
    return Request(id=str(n), prompt=list(range(first, first + n)),
                   params=SamplingParams(max_tokens=500, temperature=0.0), stop_ids=frozenset(),
                   generator=make_generator(0))


def scheduler(pages: int, lanes: int = 2, retained: Retained | None = None) -> Scheduler:
    return Scheduler(lanes=lanes, max_rows=512, prefill_chunk=64, max_waiting=8, draft_tokens=0, context=1000,
                     retained=retained, pages=Pages(pages=pages, page=PAGE, lanes=lanes, width=16))


def run(s: Scheduler) -> None:
    """Play the plan: prefills and decodes advance as the runner would (each decode emits one token)."""
    plan = s.plan()
    for p in plan.prefill:
        p.request.computed += p.length
        if not p.request.prefilling:
            p.request.tokens.append(7)
    for d in plan.decode:
        d.request.computed += 1
        d.request.tokens.append(7)


def test_a_waiting_request_waits_until_the_pool_holds_its_prompt() -> None:
    s = scheduler(pages=5)
    a, b = request(100), request(200)  # a: 2 pages with its first token; b: 4
    s.add(a)
    s.add(b)
    run(s)
    assert s.lanes[a.lane] is a and list(s.waiting) == [b] and b.lane == -1  # a lane is free, the pages are not
    s.release(a)
    run(s)
    assert s.lanes[b.lane] is b and not b.prefilling and s.pages is not None and s.pages.used == 4


def test_the_newest_request_is_preempted_for_an_older_ones_page_and_prefills_again() -> None:
    s = scheduler(pages=4)
    old, new = request(120), request(60, first=300)
    s.add(old)
    run(s)  # old: 2 pages for its prompt and first token
    s.add(new)
    run(s)  # new: 1 page, beside old
    while new.lane >= 0 and old.computed < 300:  # new takes the last free page at 64; old wants one at 128
        run(s)
    assert old.computed == 129 and s.pages is not None and s.pages.held(old.lane) == 3 and len(s.pages.free) == 1
    assert list(s.waiting) == [new] and s.preemptions == 1 and old.stats.preemptions == 0
    assert new.refill == len(new.tokens) == 60 + 8 and new.computed == 0 and new.stats.preemptions == 1
    assert new.fill == len(new.tokens) and new.prefilling  # its prompt and what it emitted, prefilled again
    run(s)
    assert new.lane == -1  # it waits: its 69 positions need 2 pages and 1 is free
    s.release(old)
    run(s)
    assert s.lanes[new.lane] is new and new.computed == new.refill == 68 and len(new.tokens) == 69  # one more token


def test_retained_slots_give_their_pages_up_before_anyone_is_preempted() -> None:
    kept = Retained(10**9, lambda n: n)
    s = scheduler(pages=4, retained=kept)
    done, running = request(100), request(100, first=300)
    for r in (done, running):
        s.add(r)
    run(s)  # both prefilled (2 pages each) and chose their first token
    s.release(done)  # it finished: its state, 100 positions and the token after them, is kept with its 2 pages
    assert len(kept.slots) == 1 and s.pages is not None and s.pages.held(0) == 2
    while running.computed < 130:  # running needs a third page: the retained slot's go (to the host)
        run(s)
    assert s.preemptions == 0 and s.pages.held(0) == 0 and s.pages.held(running.lane) == 3
    assert [slot.lane for slot in kept.slots.values()] == [-1]
