"""The `off` backend: no drafts. Plain decoding runs through the same round with K = 0."""

from __future__ import annotations

import torch

from ignis.backends.base import BackendContext, Observation, Proposal, ProposeIn


class Off:
    name = "off"
    draft_tokens = 0
    tap_layers: tuple[int, ...] = ()

    def __init__(self, ctx: BackendContext) -> None:
        self.device = ctx.device

    def nbytes(self) -> int:
        return 0

    def reset(self, lane: int) -> None:
        pass

    def observe(self, obs: list[Observation]) -> None:
        pass

    def propose(self, inp: ProposeIn) -> Proposal:
        return Proposal(tokens=torch.empty((len(inp.lanes), 0), dtype=torch.long, device=self.device), q=None)


def load(ctx: BackendContext) -> Off:
    return Off(ctx)
