"""Acceptance: which drafts a lane keeps, and the token the model adds after them.

Owns: the greedy rule and speculative rejection sampling, and `Anatomy`, where sampled drafts are lost position by
position. Does not own: producing drafts (ignis.backends) or committing state (ignis.engine.round).

Greedy: keep the longest run of drafts equal to the model's argmax at the same column, then add the argmax of the
first column that was not matched (or of the last column). The result is exactly what plain greedy decoding emits.

Sampling (Leviathan et al. / Chen et al.): for draft d_i drawn from q_i, accept with probability min(1, p_i(d)/q_i(d)),
i.e. when u * q_i(d) < p_i(d) for u ~ U[0,1). At the first rejection emit a token from the residual
norm(max(0, p_i - q_i)) and stop; if every draft is accepted, emit the bonus from p_K. Each emitted token is then
distributed exactly as p, whatever q is. A one-hot q (a deterministic drafter) makes the rule "accept with
probability p_i(d)" and the residual "p_i with d removed".

Block verification (Sun et al., "Block Verification Accelerates Speculative Decoding", ICLR 2025) judges the drafts as
one block: a draft the token rule would turn down may still be kept when the drafts after it are likelier under p than
under q. With w_0 = 1 and w_j = min(1, w_{j-1} p_{j-1}(d_{j-1}) / q_{j-1}(d_{j-1})) for the a drafts, the residual
mass r_j = sum max(0, w_j p_j - q_j) and h_j = r_j / (r_j + 1 - w_j) for 0 < j < a, h_a = w_a, it keeps the longest
prefix of length j with u_j < h_j (j = 1..a, every u_j drawn) and emits a token from norm(max(0, w_j p_j - q_j)), or
from p_a after all a. Each emitted sequence is distributed exactly as under p, and the expected drafts kept are the
most any rule that sees only these conditionals can keep: never fewer than the token rule's (tests/test_accept.py
checks both by exact enumeration).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ignis.engine.sampling import draw, uniform


@dataclass(frozen=True)
class Verdict:
    accepted: int  # drafts kept, 0..k
    token: int  # the model's own token after them (correction or bonus)
    measured: int | None = None  # under teacher forcing: what the rule accepted, while `accepted` follows the record


@dataclass
class Anatomy:
    """Where sampled drafts are lost, draft position by position, over the verifies it is shown: the chance the
    verifier keeps a draft drawn from q, sum min(p, q), which is what a position keeps on average given the drafts
    before it were kept; the target's mass on tokens q cannot propose (outside q's support after the request's cuts);
    and the sizes of both supports. Also, over the same verifies, the drafts each rule would keep in expectation
    (`expected_kept`): a paired comparison of the rules without their draws' noise. A diagnostic of the host round
    (tools.acceptance --anatomy)."""

    reached: list[int] = field(default_factory=list)  # verifies that reached position i
    kept: list[float] = field(default_factory=list)  # sums of sum min(p, q) at position i
    outside: list[float] = field(default_factory=list)  # sums of p's mass where q is 0
    q_support: list[float] = field(default_factory=list)
    p_support: list[float] = field(default_factory=list)
    judged: int = 0  # verifies `judge` saw
    token_kept: float = 0.0  # sums of the expected drafts kept, by rule
    block_kept: float = 0.0

    def judge(self, drafts: list[int], p: torch.Tensor, q: torch.Tensor | None) -> None:
        """One verify's expected drafts kept under each rule (p [a+1, V], q [a, V] or None for one-hot drafts); a
        verify without drafts is not counted."""
        if not drafts:
            return
        token, block = expected_kept(drafts, p, q)
        self.judged += 1
        self.token_kept += token
        self.block_kept += block

    def expected(self) -> dict[str, float]:
        """The verifies judged and the mean expected drafts kept a verify under each rule."""
        n = max(self.judged, 1)
        return {"verifies": self.judged, "token": self.token_kept / n, "block": self.block_kept / n}

    def add(self, p: torch.Tensor, q: torch.Tensor, reached: int) -> None:
        """p [>= reached, V] and q [>= reached, V] float32 of one verify whose first `reached` positions were drawn
        (every draft before a position kept)."""
        if reached <= 0:
            return
        ps, qs = p[:reached].float(), q[:reached].float()
        columns = (torch.minimum(ps, qs).sum(-1), ps.masked_fill(qs > 0, 0.0).sum(-1), (qs > 0).sum(-1).float(),
                   (ps > 0).sum(-1).float())
        sums = (self.kept, self.outside, self.q_support, self.p_support)
        while len(self.reached) < reached:
            self.reached.append(0)
            for s in sums:
                s.append(0.0)
        for i in range(reached):
            self.reached[i] += 1
        for s, c in zip(sums, columns, strict=True):
            for i, v in enumerate(c.tolist()):
                s[i] += v

    def rows(self) -> list[dict[str, Any]]:
        """A row a position: reached, and the means of the chance kept, p outside q's support and the supports."""
        return [{"position": i + 1, "reached": n, "kept": self.kept[i] / n, "p_outside_q": self.outside[i] / n,
                 "q_support": self.q_support[i] / n, "p_support": self.p_support[i] / n}
                for i, n in enumerate(self.reached) if n]


def teacher_forced(v: Verdict, drafts: list[int], record: list[int], at: int) -> Verdict:
    """Keep the recorded continuation record[at:] instead of the rule's choice, and remember what the rule accepted.

    The lane advances over the drafts that equal the record (their rows are valid) plus the next recorded token, so
    replaying a recorded turn measures acceptance at the contexts the turn really had."""
    m = 0
    while m < len(drafts) and drafts[m] == record[at + m]:
        m += 1
    return Verdict(m, record[at + m], measured=v.accepted)


def accept_greedy(drafts: list[int], argmax: list[int]) -> Verdict:
    """drafts: k ids; argmax: k+1 ids, the model's argmax at columns 0..k."""
    a = 0
    while a < len(drafts) and drafts[a] == argmax[a]:
        a += 1
    return Verdict(a, argmax[a])


def accept_sampled(
    drafts: list[int],
    p: torch.Tensor,  # [k+1, V] float32: target distribution at each column (already shaped by the request's params)
    q: torch.Tensor | None,  # [k, V] float32: draft distribution per slot; None = one-hot at the drafts
    generator: torch.Generator,
) -> Verdict:
    for i, d in enumerate(drafts):
        p_d = float(p[i, d])
        q_d = 1.0 if q is None else float(q[i, d])
        if q_d > 0.0 and uniform(generator) * q_d < p_d:
            continue
        if q is None:
            residual = p[i].clone()
            residual[d] = 0.0
        else:
            residual = torch.clamp(p[i] - q[i], min=0.0)
        if float(residual.sum()) <= 0.0:
            residual = p[i]
        return Verdict(i, draw(residual / residual.sum(), generator))
    return Verdict(len(drafts), draw(p[len(drafts)], generator))


Rule = Literal["block", "token"]  # spec.verify: how a sampled lane's drafts are judged


def block_thresholds(
    drafts: list[int],
    p: torch.Tensor,  # [a+1, V] float32
    q: torch.Tensor | None,  # [a, V] float32; None = one-hot at the drafts
) -> tuple[list[float], list[float]]:
    """(h, w) of block verification for the a drafts: h[j] for j = 1..a (h[0] = 1 is not used: the empty prefix is
    always kept) and the weights w[0..a]."""
    a = len(drafts)
    w = [1.0]
    for ratio in _ratios(drafts, p, q):
        w.append(min(1.0, w[-1] * ratio))
    h = [1.0]
    for j in range(1, a):
        mass = float(_residual(w[j], p[j], q[j] if q is not None else None, drafts[j]).sum())
        room = mass + 1.0 - w[j]
        h.append(mass / room if room > 0.0 else 0.0)
    if a:
        h.append(w[a])
    return h, w


def _ratios(drafts: list[int], p: torch.Tensor, q: torch.Tensor | None) -> list[float]:
    """p_j(d_j) / q_j(d_j) for each draft (q one-hot at the drafts where None); 0 where q gives the draft nothing."""
    out = []
    for j, d in enumerate(drafts):
        q_d = 1.0 if q is None else float(q[j, d])
        out.append(float(p[j, d]) / q_d if q_d > 0.0 else 0.0)
    return out


def _residual(w: float, p: torch.Tensor, q: torch.Tensor | None, d: int) -> torch.Tensor:
    """max(0, w p - q) over the vocabulary; a one-hot q at d."""
    if q is None:
        out = w * p
        out[d] = max(0.0, w * float(p[d]) - 1.0)
        return out
    return torch.clamp(w * p - q, min=0.0)


def accept_block(
    drafts: list[int],
    p: torch.Tensor,  # [k+1, V] float32, as accept_sampled takes it
    q: torch.Tensor | None,  # [k, V] float32; None = one-hot at the drafts
    generator: torch.Generator,
) -> Verdict:
    """Block verification of one lane's drafts (the module's docstring): every u_j is drawn, u_1 first, then the
    emitted token."""
    a = len(drafts)
    h, w = block_thresholds(drafts, p, q)
    u = [uniform(generator) for _ in range(a)]
    kept = next((j for j in range(a, 0, -1) if u[j - 1] < h[j]), 0)
    if kept == a:
        return Verdict(a, draw(p[a], generator))
    residual = _residual(w[kept], p[kept], q[kept] if q is not None else None, drafts[kept])
    if float(residual.sum()) <= 0.0:  # only by rounding: a kept length with no residual has probability 0
        residual = p[kept]
    return Verdict(kept, draw(residual / residual.sum(), generator))


def expected_kept(drafts: list[int], p: torch.Tensor, q: torch.Tensor | None) -> tuple[float, float]:
    """The drafts the token rule and block verification keep in expectation over their uniforms, for these drafts
    (p [a+1, V], q [a, V] or None for one-hot drafts): sum over j of the chance that the first j are kept, that is
    the products of min(1, p/q) for the token rule, and 1 - prod_{i >= j} (1 - h_i) for the block rule."""
    token, run = 0.0, 1.0
    for ratio in _ratios(drafts, p, q):
        run *= min(1.0, ratio)
        token += run
    h, _ = block_thresholds(drafts, p, q)
    block, none_from = 0.0, 1.0
    for j in range(len(drafts), 0, -1):
        none_from *= 1.0 - h[j]
        block += 1.0 - none_from
    return token, block
