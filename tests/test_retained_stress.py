"""Retained slots under churn: random prompt lengths, follow-ups that extend, diverge from or repeat earlier
sequences, aborts at random rounds and finishes, on few lanes and a small host bound. After every round no lane
serves two requests or a request and a retained slot, the host holds exactly the retained slots that are off their
lanes and never more bytes than the bound; every greedy request that ran to its end equals a full prefill."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engines import Churn, make_engine, run
from ignis.engine.core import Engine
from ignis.engine.retain import Moves
from ignis.params import SamplingParams
from tiny import tiny_checkpoint

VOCAB = 512


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), seed=23, mtp=True, vocab_size=VOCAB)


def check(e: Engine, bound: int) -> None:
    sched, kept, store = e.scheduler, e.scheduler.retained, e.store
    assert kept is not None
    for lane, r in enumerate(sched.lanes):
        assert r is None or r.lane == lane
    running = [r for r in sched.lanes if r is not None]
    assert len({id(r) for r in running}) == len(running)
    on_lanes = [s.lane for s in kept.slots.values() if s.lane >= 0]
    assert len(set(on_lanes)) == len(on_lanes), "two retained slots on one lane"
    assert all(sched.lanes[lane] is None for lane in on_lanes), "a retained slot on a lane a request holds"
    host = {s.key: s for s in kept.slots.values() if s.lane < 0}
    assert set(store.host) == set(host), "host copies and host slots differ (a leak, or a slot without its copy)"
    for key, saved in store.host.items():
        assert sum(t.nbytes for t in saved.values()) == host[key].nbytes == store.state_bytes(host[key].length)
    assert store.nbytes <= bound


def test_churn_never_shares_a_lane_or_leaks_host_memory_and_outputs_stay_exact(ckpt: Path) -> None:
    rng = random.Random(41)
    backend, k = "mtp", 2  # the target's state and a backend's own move together
    probe = make_engine(ckpt, backend, k, lanes=1)
    bound = probe.store.state_bytes(300)  # room for two or three states
    e = make_engine(ckpt, backend, k, lanes=2, max_rows=64, retained_host_memory=bound)
    moved = {"saves": 0, "drops": 0, "restores": 0}
    save = e.store.save

    def counting(moves: Moves) -> None:  # every plan's moves pass through save (restores come after the table writes)
        for name in moved:
            moved[name] += len(getattr(moves, name))
        save(moves)

    e.store.save = counting  # type: ignore[method-assign]
    churn = Churn(e, rng)

    def prompt() -> list[int]:
        # Mostly a recent sequence (likelier still retained), short enough to extend within the context.
        recent = [q for q in churn.sequences[-4:] if len(q) < 150]
        base = rng.choice(recent) if recent and rng.random() < 0.75 else []
        kind = rng.random()
        if kind < 0.15 and len(base) > 10:  # diverge inside the sequence
            at = rng.randrange(1, len(base) - 1)
            return base[:at] + [rng.randrange(3, VOCAB)] + base[at + 1 :]
        if kind < 0.25 and base:  # the same prompt again
            return list(base)
        return base + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 70))]

    churn.run(28, prompt, 7, 0.08, lambda: check(e, bound))
    prompts, outputs, finished = churn.prompts, churn.outputs, churn.finished
    s = e.stats()
    assert s.retained_hits >= 5 and s.retained_misses >= 5 and s.prompt_tokens_resumed_total > 0
    assert all(n > 0 for n in moved.values()), moved  # states went to the host, were dropped and came back
    done = sorted(rid for rid, reason in finished.items() if reason == "length")
    for rid in done:  # each on a fresh engine, with nothing retained to resume from
        alone = run(make_engine(ckpt, backend, k, lanes=1), [prompts[rid]],
                    SamplingParams(max_tokens=len(outputs[rid]), temperature=0.0, ignore_eos=True))["0"]
        assert alone.token_ids == outputs[rid], rid
