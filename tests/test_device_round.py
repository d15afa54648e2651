"""The device round (static shapes, device acceptance, one read-back) against the host round it replaces.

On the CPU with `model.exact = off` the engine decodes through ignis.engine.device_round, eagerly; the same
function is what the GPU captures as CUDA graphs. Greedy output must equal the exact host round's `off` output for
every backend, at one lane and at several (random weights in fp32 leave no near-ties at these sizes), and a seeded
sampled request must give the same tokens alone or beside others.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch

import ignis.backends.registry as registry
import ignis.config as config
from device_work import FAST, VOCAB, ckpt, reference  # noqa: F401 (fixtures; this module's own work)
from engines import make_engine, prompts, run
from ignis.backends.base import BackendContext, Choice, Committed, Observation, Proposal, ProposeIn
from ignis.engine.device_prefill import DevicePrefill, pieces
from ignis.engine.device_round import DeviceRound, buckets, collected, spans
from ignis.params import SamplingParams


@pytest.fixture(scope="module")
def work() -> tuple[list[list[int]], list[SamplingParams]]:
    ps = prompts(10, VOCAB, seed=3, lo=2, hi=80)
    return ps, [SamplingParams(max_tokens=5 + (5 * i) % 19, temperature=0.0, ignore_eos=True) for i in range(len(ps))]


class Partial:
    """A graph-safe drafter that knows each request's greedy continuation and spoils one slot of each round, chosen
    by the anchor's position, so every acceptance count 0..K occurs: the device round's commit must keep exactly the
    accepted columns' state for the output to stay right."""

    name = "partial"
    tap_layers: tuple[int, ...] = ()
    graph_safe = True
    draft_tokens = 5

    def __init__(self, ctx: BackendContext, truth: dict[tuple[int, ...], list[int]]) -> None:
        self.truth, self.vocab = truth, ctx.model.config.vocab_size
        self.rows = torch.zeros((ctx.lanes + 1, ctx.context + 16), dtype=torch.long)  # [lanes + 1, positions]

    def nbytes(self) -> int:
        return self.rows.nbytes

    def reset(self, lane: int) -> None:
        self.rows[lane] = 0

    def observe(self, obs: list[Observation]) -> None:
        for o in obs:
            if o.start == 0:  # a prompt: find its continuation
                prompt = tuple(o.tokens.tolist())
                full = [*prompt, *self.truth.get(prompt, [])]
                self.rows[o.lane, : len(full)] = torch.tensor(full)

    def propose(self, inp: ProposeIn) -> Proposal:
        raise AssertionError("a graph-safe backend's host propose is not used by the device round")

    def propose_lanes(self, lanes: torch.Tensor, anchors: torch.Tensor, positions: torch.Tensor, k: int,
                      choice: Choice, span: int) -> Proposal:
        slots = torch.arange(k)
        drafts = self.rows[lanes[:, None], positions[:, None] + 1 + slots]
        spoiled = slots[None, :] == (positions % (k + 1))[:, None]
        return Proposal(torch.where(spoiled, (drafts + 1) % self.vocab, drafts), None)

    def observe_lanes(self, rows: Committed, span: int) -> None:
        # The device prefill hands prompts over in pieces: keep every kept row's token, and once a lane's rows spell
        # a known prompt, its continuation.
        for i, lane in enumerate(rows.lanes.tolist()):
            n = int(rows.accepted[i]) + 1
            pos = rows.positions[i, :n]
            self.rows[lane, pos] = rows.tokens[i, :n]
            end = int(pos[-1]) + 1
            cont = self.truth.get(tuple(self.rows[lane, :end].tolist()))
            if cont is not None:
                self.rows[lane, end : end + len(cont)] = torch.tensor(cont)


def install_partial(monkeypatch: pytest.MonkeyPatch, ps: list[list[int]], reference: dict[str, list[int]]) -> None:
    """`Partial` installed as the backend "partial", knowing each prompt's reference continuation."""
    truth = {tuple(p): reference[str(i)] for i, p in enumerate(ps)}
    loaders = dict(registry.installed())
    loaders["partial"] = lambda ctx: Partial(ctx, truth)
    monkeypatch.setattr(registry, "installed", lambda: loaders)
    monkeypatch.setattr(config, "installed_backends", lambda: tuple(sorted(loaders)))


def test_every_acceptance_count_commits_exactly_the_kept_columns(ckpt: Path, work, reference,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    ps, params = work
    install_partial(monkeypatch, ps, reference)
    engine = make_engine(ckpt, "partial", draft_tokens=5, model=FAST, lanes=3)
    out = run(engine, ps, params)
    for rid, ref in reference.items():
        assert out[rid].token_ids == ref, f"request {rid} diverged"
    s = engine.stats()
    assert all(n > 0 for n in s.position_accepted), s.position_accepted  # every count up to K was accepted
    assert s.accepted < s.drafted


def test_the_settling_kernel_keeps_every_output_of_the_round(ckpt: Path, work, reference,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The round's acceptance settled by ignis.kernels.settle_triton (in Triton's interpreter here; CUDA rounds take
    it): greedy output equal to off's at every acceptance count, and a mix of greedy and seeded sampled lanes the
    same tokens as with the torch ops."""
    from ignis.engine import device_round
    from ignis.kernels import settle_triton

    ps, params = work
    sampled = prompts(4, VOCAB, seed=11, lo=5, hi=40)
    mixed = [SamplingParams(max_tokens=20, temperature=0.0 if i % 2 else 0.9, top_k=0 if i < 2 else 50, seed=i,
                            ignore_eos=True) for i in range(4)]
    with_torch = run(make_engine(ckpt, "mtp", draft_tokens=3, model=FAST, lanes=4), sampled, mixed)
    install_partial(monkeypatch, ps, reference)
    calls = []

    def kernel(*args: Any) -> Any:
        calls.append(args[0].shape)
        return settle_triton.settle(*args)

    monkeypatch.setattr(device_round, "settle", kernel)
    out = run(make_engine(ckpt, "partial", draft_tokens=5, model=FAST, lanes=3), ps, params)
    assert all(out[rid].token_ids == ref for rid, ref in reference.items())
    with_kernel = run(make_engine(ckpt, "mtp", draft_tokens=3, model=FAST, lanes=4), sampled, mixed)
    assert {rid: d.token_ids for rid, d in with_kernel.items()} == {rid: d.token_ids for rid, d in with_torch.items()}
    assert calls and {k for _, k in calls} == {5, 3}


def test_the_device_round_runs_where_exact_mode_is_off(ckpt: Path) -> None:
    assert make_engine(ckpt, "off").runner.device_round is None
    engine = make_engine(ckpt, "mtp", draft_tokens=3, model=FAST, lanes=3)
    assert isinstance(engine.runner.device_round, DeviceRound)
    assert engine.runner.device_round.buckets == [1, 2, 3]


@pytest.mark.parametrize("backend,k", [("off", 0), ("mtp", 3), ("dflash2", 7)])
@pytest.mark.parametrize("lanes", [1, 4])
def test_device_round_greedy_equals_the_exact_host_round(ckpt: Path, work, reference, backend: str, k: int,
                                                          lanes: int) -> None:
    ps, params = work
    engine = make_engine(ckpt, backend, draft_tokens=k, model=FAST, lanes=lanes)
    out = run(engine, ps, params)
    for rid, ref in reference.items():
        assert out[rid].token_ids == ref, f"request {rid} diverged from the exact off round"
    s = engine.stats()
    if k:
        assert s.drafted > 0 and s.accepted == sum(s.position_accepted)


@pytest.mark.parametrize("backend", ["mtp", "dflash2"])
def test_seeded_sampling_is_the_same_alone_and_beside_others(ckpt: Path, backend: str) -> None:
    """Alone, the request's rounds hold p on its 50 largest logits (top-k 50: Sampling.CANDIDATES); beside requests
    without a top-k, over the whole vocabulary (Sampling.VOCAB): the same tokens either way."""
    ps = prompts(4, VOCAB, seed=11, lo=5, hi=40)
    sampled = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    others = [SamplingParams(max_tokens=30, temperature=1.0, seed=i, ignore_eos=True) for i in range(3)]
    alone = run(make_engine(ckpt, backend, draft_tokens=3, model=FAST, lanes=4), ps[:1], sampled)["0"].token_ids
    crowd = run(make_engine(ckpt, backend, draft_tokens=3, model=FAST, lanes=4), ps, [sampled] + others)["0"].token_ids
    assert alone == crowd and len(alone) == 24


@pytest.mark.parametrize("backend", ["mtp", "dflash2"])
@pytest.mark.parametrize("model", [{}, FAST], ids=["host round", "device round"])
def test_a_seeded_request_near_its_end_samples_alike_alone_and_beside_longer_ones(ckpt: Path, backend: str,
                                                                                 model: dict[str, str]) -> None:
    """Near its max_tokens a lane drafts fewer than the round's others: it must still draw the same randomness as
    alone, in the host round (each lane's generator gives its own drafts' uniforms, not the round's widest) and the
    device round (counter-based uniforms). Several seeds, so that one draw left out or added shows."""
    ps = prompts(4, VOCAB, seed=21, lo=5, hi=30)
    others = [SamplingParams(max_tokens=40, temperature=1.0, seed=50 + i, ignore_eos=True) for i in range(3)]
    for seed in range(6):
        short = SamplingParams(max_tokens=7, temperature=1.0, seed=seed, ignore_eos=True)
        alone = run(make_engine(ckpt, backend, draft_tokens=3, model=model, lanes=4), ps[:1], short)["0"].token_ids
        crowd = run(make_engine(ckpt, backend, draft_tokens=3, model=model, lanes=4), ps, [short] + others)
        assert crowd["0"].token_ids == alone and len(alone) == 7, f"seed {seed}"


@pytest.mark.parametrize("model", [{}, FAST], ids=["host round", "device round"])
def test_a_sampling_lanes_drafts_are_cut_like_its_requests_p(ckpt: Path, model: dict[str, str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The drafter draws a sampling lane's drafts within the request's own top-k, top-p and min-p, in both rounds; a
    greedy lane beside it drafts deterministically."""
    from ignis.backends.dflash2.backend import DFlash2

    seen: list[Choice] = []
    draft = DFlash2._draft

    def spy(self: DFlash2, lane_ix: torch.Tensor, anchors: torch.Tensor, positions: torch.Tensor, k: int,
            choice: Choice, span: int) -> Proposal:
        seen.append(choice)
        return draft(self, lane_ix, anchors, positions, k, choice, span)

    monkeypatch.setattr(DFlash2, "_draft", spy)
    ps = prompts(2, VOCAB, seed=12, lo=5, hi=20)
    params = [SamplingParams(max_tokens=6, temperature=0.8, top_k=7, top_p=0.85, min_p=0.05, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)]
    run(make_engine(ckpt, "dflash2", draft_tokens=7, model=model, lanes=2), ps, params)
    sampled = [c for c in seen if c.uniforms is not None]
    assert sampled
    for c in sampled:
        assert c.top_k is not None and c.top_p is not None and c.min_p is not None
        lane = int(torch.nonzero(c.temperatures > 0)[0])
        assert (int(c.top_k[lane]), float(c.top_p[lane]), float(c.min_p[lane])) == pytest.approx((7, 0.85, 0.05))
        assert float(c.temperatures[lane]) == pytest.approx(0.8)


@pytest.mark.parametrize("model", [{}, FAST], ids=["host round", "device round"])
def test_mtp_draws_a_sampling_lanes_drafts_from_its_shaped_softmax(ckpt: Path, model: dict[str, str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """mtp hands a sampling lane's drafts over with the distribution they were drawn from (each the inverse CDF, over
    the layer's best tokens in rank order, of its q at the lane's uniform), cut like the request's p (at most its top-k
    tokens), and a greedy lane beside it its argmax with a one-hot q, in both rounds."""
    from ignis.backends.mtp import CANDIDATES, Mtp
    from ignis.kernels.topk import topk

    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    choose = Mtp._choose

    def spy(self: Mtp, hidden: torch.Tensor, choice: Choice, slot: int, drafts: list[torch.Tensor],
            qs: list[torch.Tensor]) -> None:
        choose(self, hidden, choice, slot, drafts, qs)
        if choice.uniforms is not None:
            # [n, CANDIDATES]: the layer's best tokens, best first
            ranked = topk(self.model.logits(hidden), CANDIDATES)[1]
            seen.append((choice.temperatures > 0, drafts[-1], qs[-1], choice.uniforms[:, slot], ranked))

    monkeypatch.setattr(Mtp, "_choose", spy)
    ps = prompts(2, VOCAB, seed=12, lo=5, hi=20)
    params = [SamplingParams(max_tokens=8, temperature=0.8, top_k=7, top_p=0.9, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)]
    run(make_engine(ckpt, "mtp", draft_tokens=3, model=model, lanes=2), ps, params)
    assert seen
    for sampling, drafts, q, u, ranked in seen:
        cdf = torch.cumsum(q.gather(1, ranked).double(), dim=-1)
        assert torch.allclose(cdf[:, -1], torch.ones_like(u))  # q lies on the ranked tokens
        drawn = ranked.gather(1, torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True))[:, 0]
        assert torch.equal(drafts[sampling], drawn[sampling])
        picked = q.gather(1, drafts[:, None])[:, 0]
        assert torch.all(picked > 0) and torch.allclose(q.sum(dim=-1), torch.ones(q.shape[0]), atol=1e-5)
        assert torch.all((q[sampling] > 0).sum(dim=-1) <= 7)  # within the request's top-k
        assert torch.all(picked[~sampling] == 1.0) and torch.all((q[~sampling] > 0).sum(dim=-1) == 1)  # one-hot
    assert any(bool((q[s] > 0).sum(dim=-1).gt(1).any()) for s, _, q, _, _ in seen)  # a spread, not an argmax


def test_each_round_runs_under_the_blas_choice_for_its_rows(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A round's products run inside ops.products_for with its bucket's rows (lanes x columns), so a captured graph
    keeps the library chosen for them."""
    import contextlib

    import ignis.engine.device_round as device_round

    seen: list[int] = []

    @contextlib.contextmanager
    def spy(rows: int, device: torch.device):  # type: ignore[no-untyped-def]
        seen.append(rows)
        yield

    monkeypatch.setattr(device_round, "products_for", spy)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    run(make_engine(ckpt, "mtp", draft_tokens=3, model=FAST, lanes=2), prompts(2, VOCAB, seed=5, lo=4, hi=9), params)
    assert seen and set(seen) <= {1 * 4, 2 * 4}, seen


@pytest.mark.parametrize("four_bit", [False, True])
def test_a_4bit_targets_rounds_of_few_rows_take_dependent_launches(ckpt: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   four_bit: bool) -> None:
    """A round runs inside launch.dependent_launches, asking for PDL where its bucket's rows are at most
    PACKED_PDL_ROWS and the target is repacked 4-bit (stood in for here: the CPU does not repack), never else."""
    import contextlib

    from ignis.engine import device_round

    seen: list[bool] = []

    @contextlib.contextmanager
    def spy(on: bool):  # type: ignore[no-untyped-def]
        seen.append(on)
        yield

    monkeypatch.setattr(device_round, "dependent_launches", spy)
    monkeypatch.setattr(device_round, "repacked", lambda model: four_bit)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    for n in (1, 4):  # bucket 1: 4 rows; bucket 4: 16 rows
        run(make_engine(ckpt, "mtp", draft_tokens=3, model=FAST, lanes=4), prompts(n, VOCAB, seed=5, lo=4, hi=9), params)
        assert seen and set(seen) == {four_bit and n == 1}, (n, seen)
        seen.clear()


def test_rejected_drafts_leave_no_trace_in_the_device_round(ckpt: Path) -> None:
    """Every layer's state after speculative device rounds equals plain device decoding's for the same tokens."""
    ps = prompts(2, VOCAB, seed=9, lo=20, hi=60)
    params = SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True)
    states = []
    for backend, k in (("off", 0), ("dflash2", 7)):
        engine = make_engine(ckpt, backend, draft_tokens=k, model=FAST, lanes=2)
        out = run(engine, ps, params)
        lengths = [len(p) + len(out[str(i)].token_ids) - 1 for i, p in enumerate(ps)]
        states.append([engine.runner.cache.lane_state(lane, n) for lane, n in enumerate(lengths)])
    for ref, got in zip(*states):
        for name, t in ref.items():
            torch.testing.assert_close(got[name], t, rtol=1e-5, atol=1e-5, msg=name)


def test_buckets_and_spans_cover_every_shape() -> None:
    assert buckets(1) == [1] and buckets(8) == [1, 2, 4, 8] and buckets(6) == [1, 2, 4, 6]
    assert spans(100) == [100] and spans(4104) == [256, 512, 1024, 2048, 4096, 4104]


def test_prefill_pieces_are_aligned_powers_of_two_covering_the_segment() -> None:
    assert pieces(0, 300) == [(0, 256), (256, 32), (288, 8), (296, 4)]
    assert pieces(5, 20) == [(5, 1), (6, 2), (8, 8), (16, 4)]
    assert pieces(0, 1000, largest=64)[:2] == [(0, 64), (64, 64)] and pieces(7, 8) == [(7, 1)]
    assert pieces(0, 512) == pieces(0, 256) + pieces(256, 512)  # split at a multiple of the largest piece: the same


@pytest.mark.parametrize("backend,k,largest", [("mtp", 3, 256), ("dflash2", 7, 8)])
def test_prompts_prefill_on_the_device_and_leave_the_state_a_host_prefill_leaves(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, backend: str, k: int, largest: int
) -> None:
    """A 300-token prompt runs as device pieces (no host round at all): 256, 32, 8 and 4 rows, or pieces of at most
    8 for the test drafter, whose sliding layers keep a ring of 15 rows; every layer's state after it, the
    backend's own, and the first token are those of the host round's prefill."""
    prompt = prompts(1, VOCAB, seed=21, lo=300, hi=301)
    once = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    states, firsts = [], []
    for device in (True, False):
        engine = make_engine(ckpt, backend, draft_tokens=k, model=FAST, lanes=2, max_rows=512, prefill_chunk=512)
        runner = engine.runner
        assert isinstance(runner.device_prefill, DevicePrefill) and runner.device_prefill.largest == largest
        if device:
            monkeypatch.setattr(runner, "host_round", lambda plan: pytest.fail("a plain prompt reached the host round"))
        else:
            runner.device_prefill = None
        firsts.append(run(engine, prompt, once)["0"].token_ids)
        views = engine.backend.lane_views(0, 300)  # the drafter's context of the prompt, too
        assert views is not None
        states.append({**runner.cache.lane_state(0, 300), **{f"drafter.{k}": v.clone() for k, v in views.items()}})
    assert firsts[0] == firsts[1]
    for name, t in states[1].items():
        torch.testing.assert_close(states[0][name], t, rtol=1e-4, atol=1e-4, msg=name)


class _Held:
    """An object in a reference cycle, which only the garbage collector frees; it says when it is freed."""

    def __init__(self, freed: list[str], name: str) -> None:
        self.freed, self.name, self.cycle = freed, name, self

    def __del__(self) -> None:
        self.freed.append(self.name)


def test_graphs_are_captured_with_dead_cycles_freed_first_and_no_collection_during() -> None:
    """capture_graphs runs under `collected`: an earlier engine left in a cycle (its graphs and memory pool) is freed
    before the first capture, and the automatic collector cannot free one in the middle of a capture."""
    freed: list[str] = []
    _Held(freed, "before")
    assert gc.isenabled()
    with collected():
        assert freed == ["before"] and not gc.isenabled()
        _Held(freed, "during")
        kept = [[] for _ in range(5 * gc.get_threshold()[0])]  # allocations that would trigger a collection
        assert freed == ["before"] and kept
    assert gc.isenabled()
    gc.collect()
    assert freed == ["before", "during"]
    gc.disable()
    try:
        with collected():
            pass
        assert not gc.isenabled()  # a caller's own choice is left as it was
    finally:
        gc.enable()
