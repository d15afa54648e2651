"""A step's prefill segments through one packed call of the chunk kernel (fla's cu_seqlens form on CUDA) give what one
call a segment gives: outputs, recurrent states and conv windows (ignis.model.gdn `GatedDeltaNet._fla`).

fla runs on CUDA only, so here a torch stand-in with fla's signature and its packed semantics (each sequence of
cu_seqlens from its own initial state, q and k l2-normalised inside, the scale applied to q) takes its place in both
forms; tests/test_engine_gpu.py compares the two forms with fla itself, and ignis.model.delta_rule.fla_chunk checks the
packed call against the torch chunked form before it is used."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from ignis.model import delta_rule, gdn
from ignis.model.batch import Batch, Segment
from ignis.model.cache import GDNState, LaneCache
from ignis.model.model import HybridModel
from ignis.model.ops import l2norm
from ignis.model.random import random_model
from tests.tiny import tiny_config


def stand_in(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, g: torch.Tensor, beta: torch.Tensor, scale: float,
             initial_state: torch.Tensor, output_final_state: bool, use_qk_l2norm_in_kernel: bool,
             cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's chunk_gated_delta_rule in torch: q, k [1, T, Hk, dk], v [1, T, Hv, dv], g, beta [1, T, Hv]."""
    assert output_final_state and use_qk_l2norm_in_kernel
    r = v.shape[2] // q.shape[2]
    qn = l2norm(q[0].float()).repeat_interleave(r, dim=1) * scale
    kn = l2norm(k[0].float()).repeat_interleave(r, dim=1)
    ends = [0, q.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
    outs, states = [], []
    for i, (a, b) in enumerate(itertools.pairwise(ends)):
        s, o = delta_rule.chunked(initial_state[i].float(), qn[a:b], kn[a:b], v[0, a:b].float(), g[0, a:b],
                                  beta[0, a:b].float())
        outs.append(o)
        states.append(s)
    return torch.cat(outs)[None], torch.stack(states)


def with_stand_in(packed: bool, lanes: int,
                  monkeypatch: pytest.MonkeyPatch) -> tuple[HybridModel, LaneCache, list[Any]]:
    """A tiny model and cache whose prefill runs `stand_in` as fla's kernel (packing when `packed`), and the list
    that collects each call's cu_seqlens."""
    calls: list[Any] = []

    def counted(*args: Any, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(kw.get("cu_seqlens"))
        return stand_in(*args, **kw)

    monkeypatch.setattr(gdn, "prefill_kernels", lambda layer, exact, x: (counted, packed))
    model = random_model(tiny_config(), seed=3, mtp=False, device="cpu", dtype=torch.float32)
    cache = LaneCache(model.config, lanes=lanes, context=512, max_cols=1, device="cpu", dtype=torch.float32)
    return model, cache, calls


def prefill(packed: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, LaneCache, list[Any]]:
    model, cache, calls = with_stand_in(packed, 3, monkeypatch)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    hidden = None
    # Two steps: the second starts from the states and windows the first left, on lanes in another order.
    for plan in ([(0, 0, 20), (1, 0, 9), (2, 0, 33)], [(2, 33, 130), (0, 20, 70), (1, 9, 5)]):
        segs, tokens, positions, offset = [], [], [], 0
        for lane, start, n in plan:
            segs.append(Segment(lane=lane, offset=offset, start=start, length=n, prefill=True))
            tokens.append(torch.randint(0, vocab, (n,), generator=gen))
            positions.append(torch.arange(start, start + n))
            offset += n
        batch = Batch(torch.cat(tokens), torch.cat(positions), tuple(segs), torch.arange(offset))
        hidden = model(batch, cache, taps=()).hidden
    assert hidden is not None
    return hidden, cache, calls


def test_packed_prefill_equals_one_call_a_segment(monkeypatch: pytest.MonkeyPatch) -> None:
    one, one_cache, one_calls = prefill(False, monkeypatch)
    packed, packed_cache, packed_calls = prefill(True, monkeypatch)
    layers = sum(isinstance(s, GDNState) for s in one_cache.layers)
    assert len(one_calls) == 2 * 3 * layers and all(c is None for c in one_calls)
    assert len(packed_calls) == 2 * layers and all(c.tolist() in ([0, 20, 29, 62], [0, 130, 200, 205])
                                                   for c in packed_calls)
    assert torch.equal(one, packed)
    for a, b in zip(one_cache.layers, packed_cache.layers):
        if isinstance(a, GDNState):
            assert isinstance(b, GDNState)
            assert torch.equal(a.state, b.state) and torch.equal(a.conv, b.conv)


def test_one_lane_or_a_lane_twice_keeps_one_call_a_segment(monkeypatch: pytest.MonkeyPatch) -> None:
    model, cache, calls = with_stand_in(True, 2, monkeypatch)
    seg = Segment(lane=1, offset=0, start=0, length=12, prefill=True)
    model(Batch(torch.zeros(12, dtype=torch.long), torch.arange(12), (seg,), torch.arange(12)), cache, taps=())
    assert calls and all(c is None for c in calls)


def test_a_cuda_prefill_without_fla_says_once_that_it_runs_the_slow_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without fla a CUDA prefill falls back to the torch chunked form, many times slower on long prompts: the engine
    says so once a process, with the fix; on the CPU, where fla never runs, it says nothing."""
    import sys

    import structlog

    structlog.reset_defaults()
    monkeypatch.setitem(sys.modules, "fla", None)  # `import fla...` raises ImportError
    monkeypatch.setitem(sys.modules, "fla.ops", None)
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", None)
    delta_rule.fla_chunk.cache_clear()
    delta_rule._no_fla.cache_clear()
    try:
        with structlog.testing.capture_logs() as logs:
            assert delta_rule.fla_chunk(1, 2, 8, 8, torch.float32, torch.device("cpu")) is None
            assert delta_rule.fla_chunk(1, 2, 8, 8, torch.bfloat16, torch.device("cuda")) is None
            assert delta_rule.fla_chunk(2, 4, 8, 8, torch.bfloat16, torch.device("cuda")) is None
    finally:
        delta_rule.fla_chunk.cache_clear()
        delta_rule._no_fla.cache_clear()
        structlog.reset_defaults()
    missing = [e for e in logs if e["event"] == "ignis.model.fla_missing"]
    assert len(missing) == 1 and missing[0]["log_level"] == "warning"
    assert "ignis[gpu]" in missing[0]["fix"] and "fla.ops.gated_delta_rule" in missing[0]["why"]
