"""Acceptance rules: greedy prefix matching, and rejection sampling that keeps the target distribution exactly."""

from __future__ import annotations

import pytest
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


# Block verification. `_block_outcomes` composes one verification's outcomes from block_thresholds and the residual
# exactly as accept_block draws them, so the exact checks below hold for the rule accept_block runs.


def _conditionals(seed: int, vocab: int, equal_share: float) -> tuple[dict, dict]:
    """Context-dependent target and draft distributions over a small vocabulary, made on first use (zeros included;
    some contexts with q = p)."""
    g = torch.Generator().manual_seed(seed)
    target: dict[tuple[int, ...], torch.Tensor] = {}
    draft: dict[tuple[int, ...], torch.Tensor] = {}

    def rows(table: dict, ctx: tuple[int, ...], other: dict | None) -> torch.Tensor:
        if ctx not in table:
            if other is not None and float(torch.rand(1, generator=g)) < equal_share:
                table[ctx] = rows(other, ctx, None).clone()
            else:
                w = torch.randint(0, 4, (vocab,), generator=g).double()
                w[int(torch.randint(0, vocab, (1,), generator=g))] += 1.0
                table[ctx] = w / w.sum()
        return table[ctx]

    return (lambda ctx: rows(target, ctx, None)), (lambda ctx: rows(draft, ctx, target))  # type: ignore[return-value]


def _block_outcomes(ctx: tuple[int, ...], a: int, p_of, q_of, vocab: int) -> dict[tuple[int, ...], float]:
    """P(emitted tokens) of one block verification of a drafts drawn from q at context ctx."""
    import itertools

    from ignis.engine.accept import _residual, block_thresholds

    out: dict[tuple[int, ...], float] = {}
    for drafts in itertools.product(range(vocab), repeat=a):
        chance = 1.0
        for j, d in enumerate(drafts):
            chance *= float(q_of(ctx + drafts[:j])[d])
        if chance == 0.0:
            continue
        p = torch.stack([p_of(ctx + drafts[:j]) for j in range(a + 1)])
        q = torch.stack([q_of(ctx + drafts[:j]) for j in range(a)])
        h, w = block_thresholds(list(drafts), p, q)
        for kept in range(a + 1):
            share = h[kept] if kept else 1.0
            for j in range(kept + 1, a + 1):
                share *= 1.0 - h[j]
            if share == 0.0:
                continue
            last = p[a] if kept == a else _residual(w[kept], p[kept], q[kept], drafts[kept])
            for y, py in enumerate((last / last.sum()).tolist()):
                if py:
                    key = drafts[:kept] + (y,)
                    out[key] = out.get(key, 0.0) + chance * share * py
    return out


def _stream(ctx: tuple[int, ...], n: int, a: int, p_of, q_of, vocab: int) -> dict[tuple[int, ...], float]:
    """P(the next n tokens of the output stream) when verifications of a drafts repeat from ctx."""
    if n == 0:
        return {(): 1.0}
    out: dict[tuple[int, ...], float] = {}
    for emitted, chance in _block_outcomes(ctx, a, p_of, q_of, vocab).items():
        if len(emitted) >= n:
            out[emitted[:n]] = out.get(emitted[:n], 0.0) + chance
        else:
            for rest, more in _stream(ctx + emitted, n - len(emitted), a, p_of, q_of, vocab).items():
                out[emitted + rest] = out.get(emitted + rest, 0.0) + chance * more
    return out


def _stream_error(seed: int, drafts: int, n: int = 3, vocab: int = 3) -> float:
    """The largest gap between the stream's n-token distribution and the target's own."""
    import itertools

    p_of, q_of = _conditionals(seed, vocab, equal_share=0.3)
    got = _stream((), n, drafts, p_of, q_of, vocab)
    worst = 0.0
    for seq in itertools.product(range(vocab), repeat=n):
        want = 1.0
        for j, y in enumerate(seq):
            want *= float(p_of(seq[:j])[y])
        worst = max(worst, abs(got.get(seq, 0.0) - want))
    return worst


def test_block_verification_emits_exactly_the_targets_sequences() -> None:
    for seed in range(4):
        for drafts in (1, 2, 3):
            assert _stream_error(seed, drafts) < 1e-9


def test_the_exact_check_catches_a_residual_without_its_weight(monkeypatch) -> None:
    from ignis.engine import accept

    real = accept._residual
    monkeypatch.setattr(accept, "_residual", lambda w, p, q, d: real(1.0, p, q, d))
    assert max(_stream_error(seed, 3) for seed in range(4)) > 1e-3


def test_block_verification_keeps_more_drafts_than_the_token_rule() -> None:
    """On the paper's example (p = (1/3, 2/3), q = (2/3, 1/3) at every context, two drafts) the token rule keeps
    10/9 drafts a verification and block verification 11/9; on random conditionals it is never fewer."""
    import itertools

    def kept(a: int, p_of, q_of, vocab: int) -> tuple[float, float]:
        block = sum(chance * (len(e) - 1) for e, chance in _block_outcomes((), a, p_of, q_of, vocab).items())
        token = 0.0
        for drafts in itertools.product(range(vocab), repeat=a):
            chance, run = 1.0, 1.0
            for j, d in enumerate(drafts):
                chance *= float(q_of(drafts[:j])[d])
            if chance == 0.0:
                continue
            for j, d in enumerate(drafts):
                run *= min(1.0, float(p_of(drafts[:j])[d]) / float(q_of(drafts[:j])[d]))
                token += chance * run
        return block, token

    p, q = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64), torch.tensor([2 / 3, 1 / 3], dtype=torch.float64)
    block, token = kept(2, lambda ctx: p, lambda ctx: q, 2)
    assert abs(block - 11 / 9) < 1e-12 and abs(token - 10 / 9) < 1e-12
    for seed in range(4):
        p_of, q_of = _conditionals(seed, 3, equal_share=0.0)
        block, token = kept(3, p_of, q_of, 3)
        assert block >= token - 1e-12


@pytest.mark.parametrize("real_q", [False, True])
def test_accept_block_draws_the_target_stream(real_q: bool) -> None:
    """accept_block itself, end to end: with the same p (and q) at every context, the first two tokens of the output
    stream (a second verification where the first emitted one token) are independent draws from p."""
    from ignis.engine.accept import accept_block

    torch.manual_seed(0)
    vocab, k, trials = 5, 3, 12000
    p1 = torch.softmax(torch.randn(vocab) * 1.5, dim=-1)
    q1 = torch.softmax(torch.randn(vocab) * 1.5, dim=-1)
    p, q = p1.expand(k + 1, vocab), (q1.expand(k, vocab) if real_q else None)
    g = make_generator(3)
    fixed = [int(p1.argmax())] * k
    pairs = torch.zeros(vocab, vocab, dtype=torch.float64)
    for _ in range(trials):
        stream: list[int] = []
        while len(stream) < 2:
            drafts = fixed if q is None else torch.multinomial(q1, k, replacement=True, generator=g).tolist()
            v = accept_block(drafts, p, q, g)
            stream += drafts[: v.accepted] + [v.token]
        pairs[stream[0], stream[1]] += 1
    pairs /= trials
    assert _tv(pairs.sum(1), p1) < 0.03 and _tv(pairs.sum(0), p1) < 0.03
    assert _tv(pairs.flatten(), torch.outer(p1, p1).flatten()) < 0.05


def test_expected_kept_averages_to_each_rules_drafts_kept() -> None:
    """expected_kept over every draft sequence, weighted by q: the token rule's and block verification's drafts
    kept a verification (the paper's example: 10/9 and 11/9; random conditionals: what the enumeration gives)."""
    import itertools

    from ignis.engine.accept import expected_kept

    def mean_kept(a: int, p_of, q_of, vocab: int) -> tuple[float, float]:
        token = block = 0.0
        for drafts in itertools.product(range(vocab), repeat=a):
            chance = 1.0
            for j, d in enumerate(drafts):
                chance *= float(q_of(drafts[:j])[d])
            if chance:
                p = torch.stack([p_of(drafts[:j]) for j in range(a + 1)])
                q = torch.stack([q_of(drafts[:j]) for j in range(a)])
                t, b = expected_kept(list(drafts), p, q)
                token, block = token + chance * t, block + chance * b
        return token, block

    p, q = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64), torch.tensor([2 / 3, 1 / 3], dtype=torch.float64)
    token, block = mean_kept(2, lambda ctx: p, lambda ctx: q, 2)
    assert abs(token - 10 / 9) < 1e-12 and abs(block - 11 / 9) < 1e-12
    p_of, q_of = _conditionals(5, 3, equal_share=0.3)
    token, block = mean_kept(3, p_of, q_of, 3)
    enumerated = sum(c * (len(e) - 1) for e, c in _block_outcomes((), 3, p_of, q_of, 3).items())
    assert abs(block - enumerated) < 1e-9 and block >= token - 1e-12
