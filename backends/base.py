"""The contract between the round and a speculation backend: one struct in, one struct out.

Owns: `BackendContext` (what a backend gets at load), `Observation` (what was committed), `ProposeIn` / `Proposal`
(drafts for the lanes decoding this round) and the `SpecBackend` protocol. Does not own: the round itself
(ignis.engine.round), acceptance (ignis.engine.accept) or discovery (ignis.backends.registry).

The round calls, per lane and in this order: `reset` when a request takes the lane; `observe` after every forward with
the rows that lane committed (prefill chunks, or anchor plus accepted drafts) together with the token that follows
them; `propose` before the next verify. A backend never sees rejected drafts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from ignis.config import IgnisConfig
    from ignis.model.model import HybridModel


@dataclass(frozen=True)
class BackendContext:
    model: HybridModel  # the target: backends share its embedding and output head
    config: IgnisConfig
    model_path: Path  # the artifact directory (a drafter lives in <model_path>/drafter unless spec.drafter says)
    lanes: int
    context: int
    device: torch.device
    dtype: torch.dtype


@dataclass
class Observation:
    """Rows one lane committed in the last forward: tokens at positions start..start+n-1, and the token after them."""

    lane: int
    start: int
    tokens: torch.Tensor  # [n] int64, device
    following: int  # token at position start+n (the next anchor, or the next prompt token)
    hidden: torch.Tensor  # [n, H] model dtype, device: final-normed hidden states of those rows
    taps: torch.Tensor | None  # [n, len(tap_layers) * H] model dtype, device: tapped layer outputs, if asked


@dataclass
class ProposeIn:
    lanes: list[int]
    anchors: torch.Tensor  # [n] int64, device: each lane's last committed token, not yet run through the model
    positions: torch.Tensor  # [n] int64, device: the anchors' positions
    k: int  # drafts wanted per lane
    temperatures: list[float]  # per lane; 0 = the request is greedy (draft deterministically, q may be None)
    generators: list[torch.Generator]  # per lane, for backends that sample their drafts


@dataclass
class Proposal:
    tokens: torch.Tensor  # [n, k] int64, device
    q: torch.Tensor | None  # [n, k, V] float32: draft distribution per slot; None = one-hot at `tokens`


class SpecBackend(Protocol):
    name: str
    draft_tokens: int  # K per round (0 for off)
    tap_layers: tuple[int, ...]  # target decoder layers whose outputs `observe` needs (empty: none)

    def nbytes(self) -> int:
        """Device memory the backend holds (weights of its own plus per-lane caches)."""
        ...

    def reset(self, lane: int) -> None: ...

    def observe(self, obs: list[Observation]) -> None: ...

    def propose(self, inp: ProposeIn) -> Proposal: ...
