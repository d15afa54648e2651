"""The `off` backend: no drafts. Plain decoding runs through the same round with K = 0."""

from __future__ import annotations

import torch

from ignis.backends.base import BackendContext, Choice, Committed, Observation, Proposal, ProposeIn


class Off:
    name = "off"
    draft_tokens = 0
    tap_layers: tuple[int, ...] = ()
    graph_safe = True

    def __init__(self, ctx: BackendContext) -> None:
        self.device = ctx.device

    def nbytes(self) -> int:
        return 0

    def reset(self, lane: int) -> None:
        pass

    def lane_views(self, lane: int, length: int) -> dict[str, torch.Tensor] | None:
        return {}  # no per-lane state

    def observe(self, obs: list[Observation]) -> None:
        pass

    def propose(self, inp: ProposeIn) -> Proposal:
        return Proposal(tokens=torch.empty((len(inp.lanes), 0), dtype=torch.long, device=self.device), q=None)

    def propose_lanes(self, lanes: torch.Tensor, anchors: torch.Tensor, positions: torch.Tensor, k: int,
                      choice: Choice, span: int) -> Proposal:
        return Proposal(tokens=torch.empty((lanes.shape[0], 0), dtype=torch.long, device=self.device), q=None)

    def observe_lanes(self, rows: Committed, span: int) -> None:
        pass


def load(ctx: BackendContext) -> Off:
    return Off(ctx)
