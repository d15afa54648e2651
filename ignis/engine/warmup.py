"""Start-up work that keeps first-use costs off every request's path.

Owns: `warm_prefill`, which runs the prefill path on the cache's scratch lane at a ladder of lengths, so library
kernels are loaded (CUDA loads a module's kernels on first use), fla's per-shape check has run and its kernels are
compiled and tuned before the engine says it is ready. Does not own: the decode rounds' warm-up and capture
(ignis.engine.device_round.DeviceRound.capture).
"""

from __future__ import annotations

import torch

from ignis.backends.base import Observation, SpecBackend
from ignis.model.batch import Batch, Segment
from ignis.model.cache import LaneCache
from ignis.model.model import HybridModel


@torch.inference_mode()
def warm_prefill(model: HybridModel, cache: LaneCache, backend: SpecBackend, *, rows: list[int]) -> None:
    """Prefill each length in `rows` on the scratch lane, feeding the backend as a prompt would; leaves the scratch
    lane reset. A backend that is not graph-safe may have no scratch lane, so it is left out."""
    device = model.embed_tokens.weight.device
    lane = cache.scratch
    feed = getattr(backend, "graph_safe", False)
    for n in rows:
        tokens = torch.zeros(n, dtype=torch.long, device=device)
        seg = Segment(lane=lane, offset=0, start=0, length=n, prefill=True)
        out = model(Batch(tokens, torch.arange(n, device=device), (seg,), torch.tensor([n - 1], device=device)),
                    cache, taps=backend.tap_layers if feed else ())
        if feed:
            backend.observe([Observation(lane, 0, tokens, 0, out.hidden, out.taps)])
            backend.reset(lane)
        cache.reset(lane)
