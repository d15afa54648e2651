"""The K/V pool under churn: random prompt lengths and max_tokens, follow-ups that extend earlier sequences (retained
slots), aborts at random rounds and finishes, on three lanes whose pool holds little more than one lane's whole
context, so requests wait for pages and are preempted all the time.

After every round: no page is held by two lanes, free + held pages are every page (no leak), the block table the
kernels read maps exactly the pages each lane holds (the scratch lane only the null page), every running request
holds the pages of every position it has run, a retained slot on a lane exactly those of its positions, and a lane
with neither holds none. Every request that was preempted and ran to its end (and every third other one) equals the
same greedy request alone on an engine whose pool holds every lane's context. The host round (exact mode: off, mtp) and the device round (dflash2,
exact off) both run, the device round also with chained rounds (engine.rounds_per_sync = 2) and with rounds queued
before the host reads the last one (engine.async_scheduling), where aborts, stops and
preemptions meet lanes that ran on.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from engines import Churn, make_engine, run
from ignis.engine.core import Engine
from ignis.params import SamplingParams
from tiny import tiny_pair

VOCAB = 512
CONTEXT = 256
# case: (backend, draft tokens, model.exact, engine.rounds_per_sync, engine.async_scheduling)
CASES = {"off": ("off", 0, "on", 1, False), "mtp": ("mtp", 2, "on", 1, False),
         "dflash2": ("dflash2", 3, "off", 1, False), "dflash2 chained": ("dflash2", 3, "off", 2, False),
         "dflash2 async": ("dflash2", 3, "off", 1, True)}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_pair(tmp_path_factory.mktemp("ckpt"), seed=31, drafter_seed=2, vocab_size=VOCAB)


def check(e: Engine) -> None:
    pages, pool, sched = e.pages, e.runner.cache.pool, e.scheduler
    held = [p for lane in pages.lanes for p in lane]
    assert len(held) == len(set(held)), "a page held by two lanes"
    assert sorted(held + pages.free) == list(range(1, pages.total + 1)), "a page leaked or was made up"
    table = pool.table.cpu().numpy().copy()
    assert (table == pool.host).all(), "the device table and its host mirror differ"
    for lane, index, page in pages.updates:  # writes the next plan makes: releases since the last round
        table[lane, index] = page
    for lane, mine in enumerate(pages.lanes):
        assert list(table[lane, : len(mine)]) == mine and not table[lane, len(mine) :].any(), f"lane {lane}'s row"
    assert not table[sched.lanes.__len__()].any(), "the scratch lane maps a page"
    kept = sched.retained
    on_lanes = {s.lane: s for s in kept.slots.values() if s.lane >= 0} if kept is not None else {}
    for lane, r in enumerate(sched.lanes):
        if r is not None:
            assert pages.held(lane) * pages.page >= r.computed, f"lane {lane} ran positions it holds no page for"
        elif lane in on_lanes:
            assert pages.held(lane) == pages.covering(on_lanes[lane].length), f"retained slot on lane {lane}"
        else:
            assert pages.held(lane) == 0, f"free lane {lane} holds pages"
    stats = e.stats()
    assert stats.kv_pages == pages.total and stats.kv_pages_used == len(held)
    assert stats.kv_pages_retained == sum(pages.held(lane) for lane in on_lanes)


@pytest.mark.parametrize("case", sorted(CASES))
def test_churn_on_a_small_pool_never_shares_or_leaks_a_page_and_preempted_outputs_stay_exact(
    ckpt: Path, case: str
) -> None:
    backend, k, exact, rounds, overlap = CASES[case]
    rng = random.Random(len(backend) + 100 * overlap)  # its own churn: a queued round's read takes a step of its own
    probe = make_engine(ckpt, backend, k, model={"exact": exact}, lanes=1, context=CONTEXT)
    lane_pages = probe.pages.width  # one lane's whole context and a round's columns
    page_bytes = probe.runner.cache.pool.page_bytes()
    e = make_engine(ckpt, backend, k, model={"exact": exact}, lanes=3, context=CONTEXT, max_rows=128,
                    kv_memory=(lane_pages + 1) * page_bytes, rounds_per_sync=rounds, async_scheduling=overlap)
    assert e.pages.total == lane_pages + 1
    chained: list[int] = []
    follows: list[int] = []
    dr = e.runner.device_round
    if rounds > 1:
        assert dr is not None
        start = dr.start
        dr.start = lambda decodes, n=1: (chained.append(n), start(decodes, n))[1]  # type: ignore[method-assign]
    if overlap:
        assert dr is not None
        follow = dr.follow
        dr.follow = lambda launched: (follows.append(1), follow(launched))[1]  # type: ignore[method-assign]
    churn = Churn(e, rng)

    def prompt() -> list[int]:
        recent = [q for q in churn.sequences[-4:] if len(q) < 120]
        base = rng.choice(recent) if recent and rng.random() < 0.4 else []
        return base + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 150 - len(base) // 2))]

    churn.run(36, prompt, 70, 0.03, lambda: check(e))
    prompts, outputs, finished, preempted = churn.prompts, churn.outputs, churn.finished, churn.preempted
    stats = e.stats()
    assert stats.preemptions >= 5 and len(preempted) >= 3, (stats.preemptions, preempted)
    assert stats.retained_hits >= 1
    assert stats.kv_pages_used == stats.kv_pages_retained  # nothing runs: only retained slots hold pages
    done = sorted(rid for rid, reason in finished.items() if reason == "length")
    assert preempted <= set(done) and len(done) >= 18, (sorted(preempted - set(done)), len(done))
    for rid in sorted(preempted) + [rid for rid in done if rid not in preempted][::3]:
        alone = run(make_engine(ckpt, backend, k, model={"exact": exact}, lanes=1, context=CONTEXT), [prompts[rid]],
                    SamplingParams(max_tokens=len(outputs[rid]), temperature=0.0, ignore_eos=True))["0"]
        assert alone.token_ids == outputs[rid], (rid, rid in preempted)
    assert np.array_equal(e.runner.cache.pool.host, e.runner.cache.pool.table.cpu().numpy())
    assert rounds == 1 or chained.count(rounds) >= 5, chained
    assert not overlap or len(follows) >= 10, len(follows)  # rounds queued before the host read the last one
