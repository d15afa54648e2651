"""Choosing the shortlist proposal head's tokens: the N the drafter will most often have to propose.

Owns: picking the N most frequent ids from token counts and writing `<drafter>/shortlist.safetensors` from the
target's output head. Does not own: the file format or the quantization (ignis.backends.dflash2.shortlist), or where
the counts come from (the training completions, or tools/artifact/build_shortlist.py's text and id files).

Counts should come from text like what the drafter will propose (the target's own completions): a token outside the
shortlist can never be drafted.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ignis.backends.dflash2.shortlist import save_shortlist


def choose(counts: torch.Tensor, size: int, exclude: tuple[int, ...] = ()) -> torch.Tensor:
    """The `size` most frequent ids (ties to the smaller id), never those in `exclude` (e.g. the mask token)."""
    score = counts.to(torch.float64).clone()
    if exclude:
        score[list(exclude)] = -1.0
    order = torch.sort(score, descending=True, stable=True).indices
    keep = order[: min(size, int((score >= 0).sum()))]
    return keep.to(torch.int64)


def build(head: torch.Tensor, out: Path, counts: torch.Tensor, size: int, *, group: int = 32,
          exclude: tuple[int, ...] = ()) -> torch.Tensor:
    """Write the shortlist of `head` ([V, H], the target's output head) to `out`; returns the chosen ids [N] int64."""
    ids = choose(counts, size, exclude)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_shortlist(out, head.detach().float().cpu()[ids], ids, group)
    return ids
