"""The target's tapped layer outputs over whole sequences, computed by the model ignis serves with.

Owns: `Tapper`, one prefill pass of the target over a batch of sequences (packed, no padding inside the forward)
that returns the outputs of the drafter's tapped layers, right-padded to [b, S, F]. Does not own: the layers
(ignis.model.model) or which layers are tapped (the drafter's config).

A tap is a decoder layer's own output, before the final norm: what the round hands the dflash2 backend at inference
(`HybridModel.forward(taps=...)`), so training and serving read the same features from the same code. The target runs
without gradients; its lane cache is kept between calls and grows only when a batch needs more lanes or positions.
"""

from __future__ import annotations

import torch

from ignis.model.batch import Batch, Segment
from ignis.model.cache import LaneCache
from ignis.model.model import HybridModel


class Tapper:
    def __init__(self, model: HybridModel, layers: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.layers = layers
        self.device = device
        self.dtype = dtype
        self.cache: LaneCache | None = None

    @property
    def width(self) -> int:
        return len(self.layers) * self.model.config.hidden_size

    @torch.no_grad()
    def __call__(
        self,
        tokens: torch.Tensor,  # [b, S] int64, any device: right-padded sequences
        lengths: list[int],  # [b]: real tokens of each row
    ) -> torch.Tensor:
        """[b, S, len(layers) * H] in the model dtype on the model's device; rows past a sequence's length are 0."""
        b, seq = tokens.shape
        cache = self._cache(b, seq)
        flat, segments, offset = [], [], 0
        for lane, n in enumerate(lengths):
            cache.reset(lane)
            flat.append(tokens[lane, :n])
            segments.append(Segment(lane=lane, offset=offset, start=0, length=n, prefill=True))
            offset += n
        batch = Batch(
            tokens=torch.cat(flat).to(self.device),
            positions=torch.cat([torch.arange(n) for n in lengths]).to(self.device),
            segments=tuple(segments),
            logit_rows=torch.zeros(0, dtype=torch.long, device=self.device),
        )
        taps = self.model(batch, cache, taps=self.layers).taps
        assert taps is not None
        out = torch.zeros((b, seq, taps.shape[-1]), dtype=taps.dtype, device=self.device)
        offset = 0
        for lane, n in enumerate(lengths):
            out[lane, :n] = taps[offset : offset + n]
            offset += n
        return out

    def _cache(self, lanes: int, positions: int) -> LaneCache:
        c = self.cache
        if c is None or c.lanes < lanes or c.context < positions:
            grow = (max(lanes, c.lanes if c else 0), max(positions, c.context if c else 0))
            c = self.cache = None  # free the old one before allocating the larger
            c = LaneCache(self.model.config, lanes=grow[0], context=grow[1], max_cols=1, device=self.device,
                          dtype=self.dtype)
            self.cache = c
        return c
