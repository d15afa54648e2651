"""Acceptance rules: greedy prefix matching, and rejection sampling that keeps the target distribution exactly."""

from __future__ import annotations

import torch

from ignis.engine.accept import Verdict, accept_greedy, accept_sampled
from ignis.engine.sampling import make_generator, target_probs
from ignis.params import SamplingParams


def test_greedy_keeps_longest_matching_run_then_the_models_token() -> None:
    assert accept_greedy([5, 6, 7], [5, 6, 9, 1]) == Verdict(2, 9)
    assert accept_greedy([5, 6, 7], [5, 6, 7, 1]) == Verdict(3, 1)
    assert accept_greedy([5, 6, 7], [4, 6, 7, 1]) == Verdict(0, 4)
    assert accept_greedy([], [3]) == Verdict(0, 3)


def _emitted_marginals(
    p: torch.Tensor, q: torch.Tensor | None, trials: int, seed: int, accept=accept_sampled
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Empirical distribution of the first and second emitted token when drafts are drawn from q (or argmax-free
    one-hot drafts drawn from a fixed proposal when q is None)."""
    vocab = p.shape[-1]
    g = make_generator(seed)
    first = torch.zeros(vocab, dtype=torch.float64)
    second = torch.zeros(vocab, dtype=torch.float64)
    n_second = 0
    fixed = p[:-1].argmax(dim=-1).tolist()  # a deterministic drafter's guesses (one-hot q): the likeliest tokens
    for _ in range(trials):
        if q is None:
            drafts = fixed
        else:
            drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(q.shape[0])]
        v = accept(drafts, p, q, g)
        emitted = drafts[: v.accepted] + [v.token]
        first[emitted[0]] += 1
        if len(emitted) > 1:
            second[emitted[1]] += 1
            n_second += 1
    return first / trials, second / max(n_second, 1), n_second


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b.double()).abs().sum())


def test_rejection_sampling_keeps_the_target_distribution_for_one_hot_and_real_q() -> None:
    torch.manual_seed(0)
    vocab, k, trials = 6, 2, 20000
    p = torch.softmax(torch.randn(k + 1, vocab) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(k, vocab) * 1.5, dim=-1)
    # With p fixed per column, every emitted token at column i is distributed as p[i]. 20000 draws over 6 tokens
    # put the total-variation noise near 0.01; 0.03 is far inside what a wrong residual produces (checked below).
    for qq in (None, q):
        first, second, n2 = _emitted_marginals(p, qq, trials, seed=1)
        assert _tv(first, p[0]) < 0.03
        assert n2 > 1500 and _tv(second, p[1]) < 0.04


def _accept_with_residual_from_p(drafts, p, q, generator):
    """The classic bug: after a rejection, sample the correction from p instead of norm(max(0, p - q))."""
    from ignis.engine.accept import Verdict
    from ignis.engine.sampling import draw, uniform

    for i, d in enumerate(drafts):
        q_d = 1.0 if q is None else float(q[i, d])
        if uniform(generator) * q_d < float(p[i, d]):
            continue
        return Verdict(i, draw(p[i], generator))
    return Verdict(len(drafts), draw(p[len(drafts)], generator))


def test_the_bound_catches_a_broken_residual() -> None:
    torch.manual_seed(0)
    vocab, k, trials = 6, 2, 20000
    p = torch.softmax(torch.randn(k + 1, vocab) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(k, vocab) * 1.5, dim=-1)
    first, _, _ = _emitted_marginals(p, q, trials, seed=1, accept=_accept_with_residual_from_p)
    assert _tv(first, p[0]) > 0.03


def test_target_probs_applies_top_k_top_p_min_p() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[0, 2:] == 0).all() and abs(float(p.sum()) - 1) < 1e-6
    full = torch.softmax(logits, -1)[0]
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=float(full[0] + 1e-3)))
    assert (p[0] > 0).tolist() == [True, True, False, False, False]
    p = target_probs(logits, SamplingParams(temperature=1.0, min_p=0.3))
    assert (p[0] > 0).tolist() == [True, True, False, False, False]
    cold = target_probs(logits, SamplingParams(temperature=0.25))
    assert float(cold[0, 0]) > float(full[0])
