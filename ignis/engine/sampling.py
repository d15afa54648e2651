"""Turning target logits into the distribution a request samples from, and drawing from it reproducibly.

Owns: temperature / top-k / top-p / min-p shaping, greedy choice, and seeded draws. Does not own: which rows are
sampled (ignis.engine.round) or speculative acceptance (ignis.engine.accept). Every draw takes the request's own
generator, so a seeded request gives the same tokens alone or beside others.
"""

from __future__ import annotations

import torch

from ignis.params import SamplingParams


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution p the request samples from, for every row.

    logits: [n, V] float32. Returns [n, V] float32 that sums to 1 per row. Temperature scales first; top-k, then
    top-p (smallest set of largest tokens whose mass reaches top_p), then min-p (drop tokens below min_p times the
    largest probability) cut the support; what is left is renormalised.
    """
    x = logits.float() / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass of strictly larger tokens
        drop_sorted = before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0.0:
        floor = params.min_p * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from a [V] distribution by inverse CDF with one uniform from the request's generator.

    With u in [0, 1) and the first index whose CDF exceeds u * total, a zero-probability token is never chosen.
    """
    u = torch.rand((), generator=generator, dtype=torch.float64)
    cdf = torch.cumsum(probs.detach().double().cpu(), dim=0)
    idx = int(torch.searchsorted(cdf, (u * cdf[-1]).reshape(1), right=True).item())
    return min(idx, probs.shape[0] - 1)


def uniform(generator: torch.Generator) -> float:
    return float(torch.rand((), generator=generator, dtype=torch.float64).item())


def make_generator(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g
