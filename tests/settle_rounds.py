"""Rounds to settle (ignis.kernels.settle_triton), shared by its interpreter tests and its GPU test: drafts that agree
with the argmax up to a random point, caps, and sampled lanes' own results."""

from __future__ import annotations

import torch


def round_of(b: int, k: int, seed: int, sampled: bool) -> tuple[torch.Tensor, ...]:
    """drafts, argmax and allowed of a round of b lanes and k drafts in which each lane's drafts agree with the argmax
    up to a random point, and, when `sampled`, sampled results and a greedy flag a lane."""
    g = torch.Generator().manual_seed(seed)
    argmax = torch.randint(0, 50, (b, k + 1), generator=g)
    drafts = torch.randint(0, 50, (b, k), generator=g)
    agree = torch.randint(0, k + 1, (b,), generator=g)
    for lane in range(b):
        drafts[lane, : agree[lane]] = argmax[lane, : agree[lane]]
    allowed = torch.randint(0, k + 1, (b,), generator=g)
    allowed[0] = k  # a lane that may keep all of them
    if not sampled:
        return drafts, argmax, allowed
    a_s = torch.stack([torch.randint(0, int(a) + 1, (1,), generator=g)[0] for a in allowed])
    t_s = torch.randint(100, 150, (b,), generator=g)
    greedy = torch.randint(0, 2, (b,), generator=g)
    return drafts, argmax, allowed, a_s, t_s, greedy
