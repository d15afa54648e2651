"""Acceptance: which drafts a lane keeps, and the token the model adds after them.

Owns: the greedy rule and speculative rejection sampling. Does not own: producing drafts (ignis.backends) or
committing state (ignis.engine.round).

Greedy: keep the longest run of drafts equal to the model's argmax at the same column, then add the argmax of the
first column that was not matched (or of the last column). The result is exactly what plain greedy decoding emits.

Sampling (Leviathan et al. / Chen et al.): for draft d_i drawn from q_i, accept with probability min(1, p_i(d)/q_i(d)),
i.e. when u * q_i(d) < p_i(d) for u ~ U[0,1). At the first rejection emit a token from the residual
norm(max(0, p_i - q_i)) and stop; if every draft is accepted, emit the bonus from p_K. Each emitted token is then
distributed exactly as p, whatever q is. A one-hot q (a deterministic drafter) makes the rule "accept with
probability p_i(d)" and the residual "p_i with d removed".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ignis.engine.sampling import draw, uniform


@dataclass(frozen=True)
class Verdict:
    accepted: int  # drafts kept, 0..k
    token: int  # the model's own token after them (correction or bonus)
    measured: int | None = None  # under teacher forcing: what the rule accepted, while `accepted` follows the record


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
