"""Device acceptance and sampling (ignis.engine.device_sampling) against the host reference rules.

Vectorised over lanes, the device rules must shape probabilities as `target_probs` does, accept greedily as
`accept_greedy` does, and keep the target distribution under rejection sampling for one-hot and real q (checked by
total variation over many lanes at once, the same bound as the host rule's test, which a wrong residual breaks);
block verification keeps what the host rule's thresholds keep for the same uniforms, and emits its token from the same
residual.
"""

from __future__ import annotations

import pytest
import torch

from ignis.engine import accept as host
from ignis.engine.device_sampling import (
    STREAM_ACCEPT,
    STREAM_BONUS,
    accept_block,
    accept_greedy,
    accept_sampled,
    SCAN_BLOCK,
    draw,
    first_above,
    row_cumsum,
    shape_probs,
    uniforms,
)
from ignis.engine.sampling import target_probs
from ignis.params import SamplingParams


def test_uniforms_are_reproducible_distinct_and_uniform() -> None:
    seeds = torch.tensor([7, 7, 8, -3, 2**62])
    positions = torch.tensor([10, 11, 10, 10, 10])
    u = uniforms(seeds, positions, STREAM_ACCEPT, 4)
    assert u.shape == (5, 4) and u.dtype == torch.float64
    assert torch.equal(u, uniforms(seeds, positions, STREAM_ACCEPT, 4))
    assert torch.equal(u[:1], uniforms(seeds[:1], positions[:1], STREAM_ACCEPT, 4))  # alone or beside others
    assert len({float(x) for x in u.flatten()}) == 20
    assert not torch.equal(u, uniforms(seeds, positions, STREAM_BONUS, 4))
    many = uniforms(torch.arange(4000), torch.zeros(4000, dtype=torch.long), STREAM_ACCEPT, 8).flatten()
    assert ((many >= 0) & (many < 1)).all()
    hist = torch.histc(many.float(), bins=10, min=0, max=1) / many.numel()
    assert float((hist - 0.1).abs().max()) < 0.01


def test_shape_probs_matches_target_probs_row_by_row() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 3
    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=5),
              SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=0.5, min_p=0.1),
              SamplingParams(temperature=1.0, top_k=10, top_p=0.9, min_p=0.05), SamplingParams(temperature=2.0, top_k=50)]
    got = shape_probs(logits, torch.tensor([p.temperature for p in params]), torch.tensor([p.top_k for p in params]),
                      torch.tensor([p.top_p for p in params]), torch.tensor([p.min_p for p in params]))
    want = torch.cat([target_probs(logits[i : i + 1], p) for i, p in enumerate(params)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert torch.equal(got > 0, want > 0)


def test_draw_never_picks_a_zero_weight_token() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5], [1.0, 0.0, 0.0, 0.0]]).repeat(500, 1)
    u = uniforms(torch.arange(1000), torch.zeros(1000, dtype=torch.long), STREAM_BONUS, 1)[:, 0]
    picked = draw(probs, u)
    assert set(picked[0::2].tolist()) == {1, 3} and set(picked[1::2].tolist()) == {0}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_blocked_scan_is_the_cumsum_to_rounding(dtype: torch.dtype) -> None:
    """row_cumsum's CUDA form (forced here on the CPU): rows of a whole number of blocks and not, a vocabulary's
    length; the CPU's own form is torch.cumsum itself."""
    g = torch.Generator().manual_seed(4)
    for v in (SCAN_BLOCK - 1, 3 * SCAN_BLOCK, 248320):
        x = torch.rand(3, v, generator=g, dtype=dtype) * (torch.rand(3, v, generator=g) < 0.5)
        got, want = row_cumsum(x, blocked=True), torch.cumsum(x, dim=-1)
        tol = 1e-6 if dtype == torch.float32 else 1e-13
        assert got.shape == want.shape and torch.allclose(got, want, rtol=tol, atol=tol * float(want[:, -1].max()))
    assert torch.equal(row_cumsum(x), torch.cumsum(x, dim=-1))


def test_a_draw_over_a_cdf_that_steps_back_still_never_picks_a_zero_weight() -> None:
    """A cdf summed in pieces may step back by a rounding where a piece starts (here by hand, at index 2, a zero
    weight): a threshold inside that step picks the weight whose sum exceeds it, where counting the sums at or below
    it would land on the zero; past the end, the last positive weight; over a monotone cdf, the first index above the
    threshold, as the host rule does."""
    probs = torch.tensor([[0.25, 0.25, 0.0, 0.5, 0.0]])
    cdf = torch.tensor([[0.25, 0.5, 0.5 - 1e-9, 1.0, 1.0]], dtype=torch.float64)
    picks = [int(first_above(cdf, probs, torch.tensor([t], dtype=torch.float64))) for t in (0.1, 0.4999999995, 0.7,
                                                                                              1.0)]
    assert picks == [0, 1, 3, 3]
    assert int((cdf <= 0.4999999995).sum()) == 2  # the count rule's pick: the zero weight
    monotone = torch.cumsum(probs.double(), dim=-1)
    for t in torch.linspace(0, 0.999, 50).tolist():
        want = int((monotone <= t).sum())  # the count rule over a monotone cdf
        assert int(first_above(monotone, probs, torch.tensor([t], dtype=torch.float64))) == want


def test_greedy_acceptance_equals_the_host_rule() -> None:
    g = torch.Generator().manual_seed(1)
    k, n = 4, 300
    argmax = torch.randint(0, 3, (n, k + 1), generator=g)
    drafts = torch.where(torch.rand(n, k, generator=g) < 0.7, argmax[:, :k], torch.randint(0, 3, (n, k), generator=g))
    allowed = torch.randint(0, k + 1, (n,), generator=g)
    accepted, token = accept_greedy(drafts, argmax, allowed)
    for i in range(n):
        v = host.accept_greedy(drafts[i, : allowed[i]].tolist(), argmax[i].tolist())
        assert (int(accepted[i]), int(token[i])) == (v.accepted, v.token)


def _emitted(p: torch.Tensor, q: torch.Tensor | None, lanes: int, broken: bool = False) -> tuple[torch.Tensor, ...]:
    """First and second emitted token of `lanes` independent lanes with the same p (and q)."""
    k, vocab = q.shape[0] if q is not None else p.shape[0] - 1, p.shape[-1]
    seeds, start = torch.arange(lanes), torch.full((lanes,), 5)
    if q is None:
        drafts = p[:-1].argmax(dim=-1).expand(lanes, k)
    else:
        du = uniforms(seeds, start, 7, k)
        drafts = torch.stack([draw(q[i].expand(lanes, vocab), du[:, i]) for i in range(k)], dim=1)
    pp = p.expand(lanes, k + 1, vocab)
    qq = q.expand(lanes, k, vocab) if q is not None else None
    u_token = uniforms(seeds, start, STREAM_BONUS, 1)[:, 0]
    accepted, token = accept_sampled(drafts, pp, qq, uniforms(seeds, start, STREAM_ACCEPT, k), u_token,
                                     torch.full((lanes,), k))
    if broken:  # the classic bug: after a rejection, sample the token from p instead of the residual
        token = draw(pp.gather(1, accepted[:, None, None].expand(lanes, 1, vocab))[:, 0], u_token)
    emitted = torch.cat([drafts, torch.zeros(lanes, 1, dtype=torch.long)], 1).scatter(1, accepted[:, None],
                                                                                      token[:, None])
    first = torch.bincount(emitted[:, 0], minlength=vocab).double() / lanes
    two = accepted >= 1
    second = torch.bincount(emitted[two, 1], minlength=vocab).double() / max(int(two.sum()), 1)
    return first, second, two.sum()


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b.double()).abs().sum())


@pytest.mark.parametrize("real_q", [False, True])
def test_rejection_sampling_keeps_the_target_distribution(real_q: bool) -> None:
    g = torch.Generator().manual_seed(0)
    vocab, k = 6, 2
    p = torch.softmax(torch.randn(k + 1, vocab, generator=g) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(k, vocab, generator=g) * 1.5, dim=-1) if real_q else None
    first, second, n2 = _emitted(p, q, 20000)
    assert _tv(first, p[0]) < 0.03
    assert int(n2) > 1500 and _tv(second, p[1]) < 0.04


def test_the_bound_catches_a_residual_taken_from_p() -> None:
    g = torch.Generator().manual_seed(0)
    vocab, k = 6, 2
    p = torch.softmax(torch.randn(k + 1, vocab, generator=g) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(k, vocab, generator=g) * 1.5, dim=-1)
    first, _, _ = _emitted(p, q, 20000, broken=True)
    assert _tv(first, p[0]) > 0.03


@pytest.mark.parametrize("real_q", [False, True])
def test_block_verification_equals_the_host_rule_for_the_same_uniforms(real_q: bool) -> None:
    from ignis.engine.accept import _residual, block_thresholds

    g = torch.Generator().manual_seed(2)
    n, k, vocab = 400, 4, 5
    p = torch.softmax(torch.randn(n, k + 1, vocab, generator=g) * 2.0, dim=-1)
    p = torch.where(torch.rand(n, k + 1, vocab, generator=g) < 0.15, 0.0, p)  # zeros, as top-k and top-p leave
    p = p / p.sum(-1, keepdim=True)
    q = torch.softmax(torch.randn(n, k, vocab, generator=g) * 2.0, dim=-1)
    q = torch.where(torch.rand(n, 1, 1, generator=g) < 0.2, p[:, :k], q)  # some lanes draft with q = p
    drafts = torch.stack([draw(q[:, j], torch.rand(n, generator=g, dtype=torch.float64)) for j in range(k)], dim=1)
    if not real_q:
        drafts = p[:, :k].argmax(dim=-1)
    u = torch.rand(n, k, generator=g, dtype=torch.float64)
    u_token = torch.rand(n, generator=g, dtype=torch.float64)
    allowed = torch.randint(0, k + 1, (n,), generator=g)
    accepted, token = accept_block(drafts, p, q if real_q else None, u, u_token, allowed)
    for i in range(n):
        a = int(allowed[i])
        mine = drafts[i, :a].tolist()
        qi = q[i, :a] if real_q else None
        h, w = block_thresholds(mine, p[i, : a + 1], qi)
        kept = next((j for j in range(a, 0, -1) if float(u[i, j - 1]) < h[j]), 0)
        assert int(accepted[i]) == kept
        last = p[i, a] if kept == a else _residual(w[kept], p[i, kept], None if qi is None else qi[kept], mine[kept])
        if float(last.sum()) <= 0.0:
            last = p[i, kept]
        assert int(token[i]) == int(draw(last[None], u_token[i : i + 1])[0])


def test_block_verification_draws_the_target_stream() -> None:
    """With the same p and q at every context, the output stream's first two tokens (a second verification where the
    first emitted one token) are independent draws from p, over many lanes at once."""
    g = torch.Generator().manual_seed(0)
    vocab, k, lanes = 5, 3, 30000
    p1 = torch.softmax(torch.randn(vocab, generator=g) * 1.5, dim=-1)
    q1 = torch.softmax(torch.randn(vocab, generator=g) * 1.5, dim=-1)
    seeds = torch.arange(lanes)
    emitted, kept = [], []
    for start in (5, 6):  # two verifications a lane, at two anchor positions
        pos = torch.full((lanes,), start)
        du = uniforms(seeds, pos, 7, k)
        drafts = torch.stack([draw(q1.expand(lanes, vocab), du[:, j]) for j in range(k)], dim=1)
        accepted, token = accept_block(drafts, p1.expand(lanes, k + 1, vocab), q1.expand(lanes, k, vocab),
                                       uniforms(seeds, pos, STREAM_ACCEPT, k),
                                       uniforms(seeds, pos, STREAM_BONUS, 1)[:, 0], torch.full((lanes,), k))
        row = torch.cat([drafts, torch.zeros(lanes, 1, dtype=torch.long)], 1)
        emitted.append(row.scatter(1, accepted[:, None], token[:, None]))
        kept.append(accepted)
    first = emitted[0]
    second = torch.where(kept[0] >= 1, first[:, 1], emitted[1][:, 0])
    pairs = torch.bincount(first[:, 0] * vocab + second, minlength=vocab * vocab).double() / lanes
    assert _tv(pairs.view(vocab, vocab).sum(1), p1) < 0.02 and _tv(pairs.view(vocab, vocab).sum(0), p1) < 0.02
    assert _tv(pairs, torch.outer(p1, p1).flatten()) < 0.04


def _rows(n: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Per-row (temperature, top_k 1..20, top_p, min_p) as sampled requests set them, some cuts off."""
    temperature = 0.3 + 1.5 * torch.rand(n, generator=g)
    top_k = torch.randint(1, 21, (n,), generator=g)
    top_p = torch.where(torch.rand(n, generator=g) < 0.3, 1.0, 0.5 + 0.5 * torch.rand(n, generator=g))
    min_p = torch.where(torch.rand(n, generator=g) < 0.5, 0.0, 0.2 * torch.rand(n, generator=g))
    return temperature, top_k, top_p, min_p


def test_shape_candidates_is_shape_probs_held_on_the_largest_logits() -> None:
    """The sparse p, scattered back over the vocabulary, is the dense p to float32's rounding, with the same support,
    for rows of top-k 1..20 held on 32 candidates (and a row of exact ties at its k-th logit)."""
    from ignis.engine.device_sampling import shape_candidates

    g = torch.Generator().manual_seed(3)
    n, vocab = 64, 500
    logits = torch.randn(n, vocab, generator=g) * 3
    logits[0, :40] = 50.0  # ties at the k-th logit: both paths keep every tied token the candidates hold
    rows = _rows(n, g)
    rows[1][0], rows[2][0], rows[3][0] = 20, 1.0, 0.0  # top-k 20, no top-p or min-p cut
    cols, probs = shape_candidates(logits, *rows, width=32)
    dense = shape_probs(logits, *rows)
    assert cols.shape == probs.shape == (n, 32)
    got = torch.zeros_like(dense).scatter_(1, cols, probs)
    torch.testing.assert_close(got[1:], dense[1:], rtol=1e-5, atol=1e-7)
    assert torch.equal(got[1:] > 0, dense[1:] > 0)
    # 40 tokens tie at the k-th logit: the dense row keeps all 40, the sparse one the 32 of smallest id it holds
    assert int((dense[0] > 0).sum()) == 40 and torch.equal(cols[0], torch.arange(32))
    assert bool((probs[0] - 1 / 32).abs().max() < 1e-6)


@pytest.mark.parametrize("rule", ["token", "block"])
@pytest.mark.parametrize("real_q", [False, True])
def test_acceptance_over_a_sparse_p_equals_the_dense_one(rule: str, real_q: bool) -> None:
    """The same drafts, q and uniforms against p held sparse (`shape_candidates`) and dense (`shape_probs`): the same
    drafts kept and the same token, lane by lane, for draft-by-draft and block verification."""
    from ignis.engine.device_sampling import shape_candidates

    g = torch.Generator().manual_seed(4)
    b, k, vocab = 300, 4, 400
    logits = torch.randn(b * (k + 1), vocab, generator=g) * 2.5
    rows = [t.repeat_interleave(k + 1) for t in _rows(b, g)]
    dense = shape_probs(logits, *rows).view(b, k + 1, vocab)
    cols, sparse = shape_candidates(logits, *rows, width=32)
    cols, sparse = cols.view(b, k + 1, 32), sparse.view(b, k + 1, 32)
    q = torch.softmax(torch.randn(b, k, vocab, generator=g) * 2.5, dim=-1)
    q = torch.where(torch.rand(b, 1, 1, generator=g) < 0.3, dense[:, :k], q)  # some lanes draft with q = p
    drafts = torch.stack([draw(q[:, j], torch.rand(b, generator=g, dtype=torch.float64)) for j in range(k)], dim=1)
    if not real_q:
        drafts = dense[:, :k].argmax(dim=-1)
    u = torch.rand(b, k, generator=g, dtype=torch.float64)
    u_token = torch.rand(b, generator=g, dtype=torch.float64)
    allowed = torch.randint(0, k + 1, (b,), generator=g)
    accept = accept_block if rule == "block" else accept_sampled
    qq = q if real_q else None
    want = accept(drafts, dense, qq, u, u_token, allowed)
    got = accept(drafts, sparse, qq, u, u_token, allowed, cols)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert 0 < int((want[0] > 0).sum()) < b and int((want[0] < allowed).sum()) > 0  # keeps and rejections both
    none = torch.zeros(b, 0, dtype=torch.long)  # no drafts: the token alone, from p
    assert torch.equal(accept(none, sparse[:, :1], None, u[:, :0], u_token, allowed * 0, cols[:, :1])[1],
                       accept(none, dense[:, :1], None, u[:, :0], u_token, allowed * 0)[1])


@pytest.mark.parametrize("width", [16, 32, 5])
def test_the_shaped_draw_in_one_launch_equals_choice_draws_torch_path(width: int) -> None:
    """ignis.kernels.draw_triton (Triton's interpreter here) against Choice.draw's torch path, its reference: the same
    q to float32's rounding and the same columns, for sampling rows with and without cuts, tied scores and greedy
    rows (a one-hot q at their argmax)."""
    from ignis.backends.base import Choice
    from ignis.kernels.draw_triton import shaped_draw

    g = torch.Generator().manual_seed(width)
    n, k = 40, 3
    scores = torch.round(torch.randn(n, k, width, generator=g) * 4) / 4  # ties among the candidates
    temperature = torch.where(torch.rand(n, generator=g) < 0.2, 0.0, 0.3 + 1.5 * torch.rand(n, generator=g))
    temperature, top_k, top_p, min_p = temperature, *(t for t in _rows(n, g)[1:])
    top_k = torch.where(torch.rand(n, generator=g) < 0.3, 0, top_k)
    u = torch.rand(n, k, generator=g, dtype=torch.float64)
    choice = Choice(temperature, u, top_k, top_p, min_p)
    greedy = scores.argmax(dim=-1)
    want_q, want = choice.draw(scores, greedy, None)
    rows = [t.repeat_interleave(k) for t in (temperature, top_k, top_p, min_p)]
    got_q, got = shaped_draw(scores.reshape(-1, width), *rows, u.reshape(-1), greedy.reshape(-1))
    torch.testing.assert_close(got_q.view(n, k, width), want_q, rtol=1e-5, atol=1e-7)
    assert torch.equal(got.view(n, k), want)
    assert bool((temperature == 0).any()) and bool(((temperature > 0) & (top_k > 0)).any())


DRAW_COMPILE = r"""
from ignis.kernels.draw_triton import _shaped_draw
from tests.sm90 import build, spills

types = {"scores": "*fp32", "temperature": "*fp32", "top_k": "*i64", "top_p": "*fp32", "min_p": "*fp32", "u": "*fp64",
         "greedy": "*i64", "q": "*fp32", "chosen": "*i64"}
for block in (16, 32, 64):
    kernel = build(_shaped_draw, types, {"BLOCK": block}, (), 1, 1)
    assert ".target sm_90a" in kernel.asm["ptx"] and spills(kernel) == 0, block
    print("ok", block)
"""


def test_the_shaped_draw_compiles_for_sm90_without_spills() -> None:
    from sm90 import run_child

    assert run_child(DRAW_COMPILE).count("ok") == 3
