"""Attention through pages equals attention over a per-lane cache, bit for bit, on the CPU: the exact path, the SDPA
path and the static decode/verify path, for many lengths around page boundaries and pages of 1 to 64 positions
laid out in shuffled order (the pages a lane does not hold, and the null page, are filled with large garbage, so a
read of any of them shows).

The per-lane cache is the layout every lane had before the pool (ignis.model.pool.AttnState.contiguous: one page of
the whole context a lane); the kernels' own comparison against these references is in tests/test_kernels_fused.py
(numba's simulator) and tests/test_kernels_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_config

from ignis.model.attention import GatedAttention
from ignis.model.batch import Segment
from ignis.model.config import ModelConfig
from ignis.model.decode import DecodeStep
from ignis.model.ops import Rope, Step
from ignis.model.pool import AttnState
from ignis.model.random import _full_config

LANES, SLOTS = 3, 200
PAGES = [1, 3, 4, 16, 64]


def model() -> tuple[GatedAttention, Rope, ModelConfig]:
    config = ModelConfig.from_dict(_full_config(tiny_config(), mtp=False))
    torch.manual_seed(0)
    layer = GatedAttention(config)
    for p in layer.parameters():  # visible attention patterns: not the near-uniform softmax of a default init
        p.data.normal_(0.0, 0.3)
    return layer.eval(), Rope(config.rotary_dim, config.rope_theta), config


def caches(config: ModelConfig, page: int, seed: int) -> tuple[AttnState, AttnState]:
    """(a per-lane cache of SLOTS positions a lane, the same as shuffled pages of `page` positions); the scratch lane
    LANES reads and writes the null page."""
    g = torch.Generator().manual_seed(seed)
    shape = (config.num_key_value_heads, config.head_dim)
    k = torch.zeros(LANES + 1, SLOTS, *shape)
    lanes = AttnState.contiguous(k, torch.zeros_like(k))
    width = -(-SLOTS // page)
    table = torch.zeros(LANES + 1, width, dtype=torch.int64)
    table[:LANES] = (torch.randperm(LANES * width, generator=g) + 1).view(LANES, width)
    kp = torch.randn(1 + LANES * width, page, *shape, generator=g) * 100
    return lanes, AttnState(kp, torch.randn(kp.shape, generator=g) * 100, table)


def hosted(layer: GatedAttention, rope: Rope, cache: AttnState, segments: list[Segment], x: torch.Tensor,
           exact: bool) -> torch.Tensor:
    positions = torch.cat([torch.arange(s.start, s.start + s.length) for s in segments])
    with torch.no_grad():
        return layer(x, Step.build(tuple(segments), positions, rope, x.dtype, exact), cache)


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("page", PAGES)
def test_host_forward_through_pages_equals_the_per_lane_cache(page: int, exact: bool) -> None:
    """Prompts of lengths on both sides of page boundaries, then single rows and 4-row verifies that cross them,
    several lanes packed in each forward."""
    layer, rope, config = model()
    lanes, paged = caches(config, page, seed=page)
    g = torch.Generator().manual_seed(1)
    starts = [page - 1, page, 2 * page + 1]
    lengths = {lane: min(n, SLOTS - 40) for lane, n in enumerate(starts)}
    rounds = [[Segment(lane, 0, 0, n, prefill=True) for lane, n in lengths.items()]]
    at = dict(lengths)
    for rows in (1, 4, 1, 4, 4, 1) * 3:
        rounds.append([Segment(lane, 0, at[lane], rows, record=rows > 1) for lane in at])
        at = {lane: n + rows - (1 if rows > 1 else 0) for lane, n in at.items()}  # verifies keep all but one
    for segs in rounds:
        packed, offset = [], 0
        for s in segs:
            packed.append(Segment(s.lane, offset, s.start, s.length, s.record, s.prefill))
            offset += s.length
        x = torch.randn(offset, config.hidden_size, generator=g)
        want = hosted(layer, rope, lanes, packed, x, exact)
        got = hosted(layer, rope, paged, packed, x, exact)
        assert torch.equal(got, want), (page, [(s.lane, s.start, s.length) for s in packed])
    for lane, n in at.items():
        for a, b in zip(paged.read(lane, n), lanes.read(lane, n), strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("page", PAGES)
def test_static_decode_through_pages_equals_the_per_lane_cache(page: int) -> None:
    """B lanes x C columns at device positions (a bucket with a padding row on the scratch lane), key spans of the
    round's ladder, positions on and across page boundaries."""
    layer, rope, config = model()
    lanes, paged = caches(config, page, seed=page + 10)
    g = torch.Generator().manual_seed(2)
    filled = torch.randn(LANES, SLOTS - 16, config.num_key_value_heads, config.head_dim, generator=g)
    for lane in range(LANES):  # every position before a round's: the same keys in both caches
        for cache in (lanes, paged):
            cache.write(lane, 0, filled[lane], filled[lane] * 0.5)
    for cols, starts in ((1, [page - 1, page, 2 * page - 1]), (4, [page - 2, 0, 3 * page + 1]), (8, [5, page, 60])):
        order = torch.tensor([2, 0, 1, LANES])  # lanes out of order, and a padding row
        positions = torch.tensor([*[min(a, SLOTS - 16) for a in starts], 0])[:, None] + torch.arange(cols)
        span = 128 if int(positions.max()) < 128 else SLOTS
        step = DecodeStep.build(order, positions, rope, torch.float32, span=span, record=cols > 1)
        x = torch.randn(4 * cols, config.hidden_size, generator=g)
        with torch.no_grad():
            want, got = layer.decode(x, step, lanes), layer.decode(x, step, paged)
        rows = 3 * cols  # the padding row's output is nobody's
        assert torch.equal(got[:rows], want[:rows]), (page, cols)
        for lane in range(LANES):
            for a, b in zip(paged.read(lane, SLOTS - 16), lanes.read(lane, SLOTS - 16), strict=True):
                assert torch.equal(a, b)
