"""Exact mode (CPU fp32): a lane's logits and state are bitwise the same however its tokens are batched.

What speculative decoding and batching promise users rests on this: a verify segment + commit leaves exactly what
token-by-token decoding leaves, and a prompt gives the same bits alone, beside other lanes, or split in two."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from tiny import single_thread, tiny_checkpoint  # noqa: F401 - single_thread is a fixture

from ignis.model.batch import Batch, Segment
from ignis.model.cache import AttnState, LaneCache
from ignis.model.loader import load_model
from ignis.model.model import HybridModel

pytestmark = pytest.mark.usefixtures("single_thread")
DRAFT = 7


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> HybridModel:
    path: Path = tiny_checkpoint(tmp_path_factory.mktemp("exact"), seed=9, mtp=False)
    return load_model(path, device="cpu", dtype=torch.float32, exact=True)


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed))


def run(model: HybridModel, cache: LaneCache, parts: list[tuple[Segment, torch.Tensor]]) -> list[torch.Tensor]:
    """One forward over (segment, its tokens) packed in the order given; the logits of every row, per segment."""
    segs, offset = [], 0
    for seg, _ in parts:
        segs.append(Segment(seg.lane, offset, seg.start, seg.length, seg.record, seg.prefill))
        offset += seg.length
    batch = Batch(
        tokens=torch.cat([t for _, t in parts]),
        positions=torch.cat([torch.arange(s.start, s.start + s.length) for s in segs]),
        segments=tuple(segs),
        logit_rows=torch.arange(offset),
    )
    logits = model(batch, cache).logits
    return [logits[s.offset : s.offset + s.length] for s in segs]


def lane_state(cache: LaneCache, lane: int, length: int) -> list[torch.Tensor]:
    """All of `lane` that later tokens read: K/V of its first `length` positions, conv window, recurrent state."""
    out = []
    for s in cache.layers:
        if isinstance(s, AttnState):
            out += list(s.read(lane, length))
        else:
            out += [s.conv[lane].clone(), s.state[lane].clone()]
    return out


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(x, y), f"state tensor {i} differs"


def prefilled(model: HybridModel, prompts: dict[int, torch.Tensor]) -> LaneCache:
    cache = LaneCache(model.config, lanes=4, context=256, max_cols=DRAFT + 1, device="cpu", dtype=torch.float32)
    if prompts:
        run(model, cache, [(Segment(lane, 0, 0, len(p), prefill=True), p) for lane, p in prompts.items()])
    return cache


def test_verify_then_commit_equals_token_by_token_decode(model: HybridModel) -> None:
    prompts = {1: tokens(20, 1), 0: tokens(33, 2), 2: tokens(5, 3)}
    n = len(prompts[1])
    cols = tokens(DRAFT + 1, 4)  # [anchor, d1..dK]
    other = tokens(DRAFT + 1, 5)

    plain = prefilled(model, prompts)
    decoded, states = [], []
    for j in range(DRAFT + 1):
        # Lane 1 decodes beside lane 0, and lane 0 comes first in the batch.
        parts = [(Segment(0, 0, 33 + j, 1), other[j : j + 1]), (Segment(1, 0, n + j, 1), cols[j : j + 1])]
        rows = run(model, plain, parts)
        decoded.append(rows[1][0])
        states.append(lane_state(plain, 1, n + j + 1))

    spec = prefilled(model, prompts)
    before = lane_state(spec, 1, n)
    parts = [
        (Segment(2, 0, 5, 3, prefill=True), other[:3]),
        (Segment(1, 0, n, DRAFT + 1, record=True), cols),
        (Segment(0, 0, 33, 1), other[:1]),
    ]
    verify = run(model, spec, parts)[1]
    for j in range(DRAFT + 1):
        assert torch.equal(verify[j], decoded[j]), f"verify column {j} differs from decode step {j}"
    # The verify itself leaves the recurrent state alone (attention K/V beyond the lane's length do not count).
    assert_same(lane_state(spec, 1, n), before)
    for keep in range(1, DRAFT + 2):
        committed = copy.deepcopy(spec)
        committed.commit(1, keep)
        assert_same(lane_state(committed, 1, n + keep), states[keep - 1])


def test_prefill_alone_packed_or_split_gives_the_same_bits(model: HybridModel) -> None:
    prompt = tokens(100, 6)
    alone = prefilled(model, {})
    want = run(model, alone, [(Segment(2, 0, 0, 100, prefill=True), prompt)])[0]
    want_state = lane_state(alone, 2, 100)

    packed = prefilled(model, {})
    got = run(
        model,
        packed,
        [
            (Segment(0, 0, 0, 37, prefill=True), tokens(37, 7)),
            (Segment(2, 0, 0, 100, prefill=True), prompt),
            (Segment(1, 0, 0, 64, prefill=True), tokens(64, 8)),
            (Segment(3, 0, 0, 1), tokens(1, 9)),
        ],
    )[1]
    assert torch.equal(got, want)
    assert_same(lane_state(packed, 2, 100), want_state)

    split = prefilled(model, {0: tokens(10, 10)})
    first = run(model, split, [(Segment(2, 0, 0, 64, prefill=True), prompt[:64])])[0]
    second = run(model, split, [(Segment(0, 0, 10, 1), tokens(1, 11)), (Segment(2, 0, 64, 36, prefill=True), prompt[64:])])[1]
    assert torch.equal(torch.cat([first, second]), want)
    assert_same(lane_state(split, 2, 100), want_state)

    # And the next decode step agrees too.
    step = tokens(1, 12)
    nxt = [run(model, c, [(Segment(2, 0, 100, 1), step)])[0] for c in (alone, packed, split)]
    assert torch.equal(nxt[0], nxt[1]) and torch.equal(nxt[0], nxt[2])


def test_cache_refuses_what_it_cannot_hold(model: HybridModel) -> None:
    cache = LaneCache(model.config, lanes=2, context=16, max_cols=3, device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="record=True segment"):
        cache.commit(0, 1)
    with pytest.raises(ValueError, match="max_cols"):
        run(model, cache, [(Segment(0, 0, 0, 4, record=True), tokens(4, 13))])
    with pytest.raises(ValueError, match="context"):
        run(model, cache, [(Segment(1, 0, 10, 8, prefill=True), tokens(8, 14))])
    run(model, cache, [(Segment(1, 0, 0, 3, record=True), tokens(3, 15))])
    with pytest.raises(ValueError, match="had 3 columns"):
        cache.commit(1, 4)
    cache.reset(1)
    assert all(not s.state[1].any() for s in cache.layers if not isinstance(s, AttnState))
    assert cache.nbytes() > 0


def test_fast_mode_agrees_with_exact_mode(model: HybridModel, tmp_path: Path) -> None:
    """exact=False (SDPA, lanes batched through one recurrence) computes the same function, up to rounding."""
    path = tiny_checkpoint(tmp_path, seed=9, mtp=False)
    fast = load_model(path, device="cpu", dtype=torch.float32, exact=False)
    prompts = {0: tokens(70, 16), 1: tokens(9, 17), 2: tokens(40, 18), 3: tokens(1, 19)}
    caches = [prefilled(m, prompts) for m in (model, fast)]
    steps = [
        # A prefill continuing at 40 beside decodes (SDPA with a prefix mask; a recurrent group of three lanes).
        [
            (Segment(0, 0, 70, 1), tokens(1, 20)),
            (Segment(2, 0, 40, 30, prefill=True), tokens(30, 21)),
            (Segment(1, 0, 9, 1), tokens(1, 22)),
            (Segment(3, 0, 1, 1), tokens(1, 23)),
        ],
        # Verify on two lanes at once (one recorded group), plain decode on another.
        [
            (Segment(0, 0, 71, 4, record=True), tokens(4, 24)),
            (Segment(1, 0, 10, 4, record=True), tokens(4, 25)),
            (Segment(3, 0, 2, 1), tokens(1, 26)),
        ],
    ]
    for parts in steps:
        want, got = (run(m, c, parts) for m, c in zip((model, fast), caches, strict=True))
        for w, g in zip(want, got, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    for c in caches:
        c.commit(0, 2)
        c.commit(1, 4)
    for lane, length in ((0, 73), (1, 14), (2, 70), (3, 3)):
        for w, g in zip(lane_state(caches[0], lane, length), lane_state(caches[1], lane, length), strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_bfloat16_runs_close_to_float32(model: HybridModel, tmp_path: Path) -> None:
    path = tiny_checkpoint(tmp_path, seed=9, mtp=False)
    half = load_model(path, device="cpu", dtype=torch.bfloat16, exact=False)
    assert half.embed_tokens.weight.dtype == torch.bfloat16
    prompt = {1: tokens(80, 27)}
    want = run(model, prefilled(model, {}), [(Segment(1, 0, 0, 80, prefill=True), prompt[1])])[0]
    cache = LaneCache(half.config, lanes=4, context=256, max_cols=1, device="cpu", dtype=torch.bfloat16)
    got = run(half, cache, [(Segment(1, 0, 0, 80, prefill=True), prompt[1])])[0]
    assert got.dtype == torch.float32 and cache.layers[0].state.dtype == torch.float32  # type: ignore[union-attr]
    assert ((got - want).abs().max() / want.abs().max()).item() < 5e-2
