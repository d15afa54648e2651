"""The target's tapped layer outputs over whole sequences, computed by the model ignis serves with.

Owns: `Tapper`, one prefill pass of the target over a batch of sequences (packed, no padding inside the forward)
that returns the outputs of the drafter's tapped layers, right-padded to [b, S, F]; and `tap_features`, which keeps
every sequence's taps in memory when they fit, or runs the target on each batch, and also gives the last layer's
outputs when distillation needs them. Does not own: the layers (ignis.model.model) or which layers the drafter taps
(its config).

A tap is a decoder layer's own output, before the final norm: what the round hands the dflash2 backend at inference
(`HybridModel.forward(taps=...)`), so training and serving read the same features from the same code. The target runs
without gradients; its lane cache is kept between calls and grows only when a batch needs more lanes or positions.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ignis.model.batch import Batch, Segment
from ignis.model.cache import LaneCache
from ignis.model.model import HybridModel
from ignis.train.generate import Sequences
from ignis.train.loop import Features
from ignis.train.memory import tap_cache_fits

CHUNK_TOKENS = 16384  # tokens per target pass when precomputing every tap


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


def tap_features(model: HybridModel, layers: tuple[int, ...], data: Sequences, device: torch.device,
                 dtype: torch.dtype, cache: str, log: Callable[[str], None],
                 last: bool = False) -> tuple[Features, float]:
    """Tap features for training and the seconds spent precomputing them: with `cache` "on", or "auto" when they fit,
    every sequence's taps are computed once and kept on `device`; else the target runs on each batch.

    With `last`, the features also give the target's last decoder layer's outputs (the distillation teacher's input):
    the drafter's own columns when it taps that layer, else one more layer tapped (H more columns, in the cache too)
    and sliced off before the drafter sees them."""
    final, h = len(model.layers) - 1, model.config.hidden_size
    tapped = (*layers, final) if last and final not in layers else layers

    def split(taps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:  # [b, S, len(tapped) * H]
        if not last:
            return taps, None
        col = tapped.index(final) * h
        return taps[..., : len(layers) * h], taps[..., col : col + h]

    tapper = Tapper(model, tapped, device, dtype)
    nbytes = int(data.tokens.size) * tapper.width * torch.finfo(dtype).bits // 8
    keep = cache == "on" or (cache == "auto" and tap_cache_fits(nbytes, device))
    if not keep:
        why = "--tap-cache off" if cache == "off" else f"{nbytes / 2**30:.1f} GiB would not fit beside the target"
        log(f"taps: the target runs on each batch ({why})")
        return (lambda rows, tokens, lengths: split(tapper(tokens, lengths))), 0.0
    t0 = time.monotonic()
    flat = torch.empty((int(data.tokens.size), tapper.width), dtype=dtype, device=device)
    lengths = data.lengths()
    rows: list[int] = []
    held = 0  # tokens in `rows`: a pass takes up to CHUNK_TOKENS
    for i in range(len(data) + 1):
        if rows and (i == len(data) or held + int(lengths[i]) > CHUNK_TOKENS):
            tokens, _ = data.batch(rows)
            taps = tapper(tokens, [int(lengths[r]) for r in rows])
            for j, r in enumerate(rows):
                flat[int(data.starts[r]) : int(data.starts[r + 1])] = taps[j, : int(lengths[r])]
            rows, held = [], 0
        if i < len(data):
            rows.append(i)
            held += int(lengths[i])
    tapper.cache = None
    seconds = time.monotonic() - t0
    log(f"taps: {nbytes / 2**30:.2f} GiB kept in memory, computed in {seconds:.0f} s")

    def cached(picks: list[int], tokens: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = torch.zeros((len(picks), tokens.shape[1], flat.shape[1]), dtype=dtype, device=device)
        for j, (r, n) in enumerate(zip(picks, lengths)):
            out[j, :n] = flat[int(data.starts[r]) : int(data.starts[r]) + n]
        return split(out)

    return cached, seconds
