"""A sampling lane's draft drawn from its shaped distribution over a few candidates, in one Triton launch for every
row: `shaped_draw`.

Owns: the kernel and its launch on torch's current stream (allocating only its outputs, so a CUDA graph captures it).
Does not own: the rule, which is ignis.backends.base.Choice.draw's torch path (the CPU's and the reference: the
request's temperature, then its top-k, top-p and min-p cuts as ignis.engine.device_sampling.shape_probs applies
them, renormalised, and the inverse CDF at the lane's uniform), or which drafts are drawn (the backends).

Why: the torch path is about thirty launches a slot (a sort, a softmax, a scan, scatters and masks over 16-32
columns), so a sampled one-lane 27B dflash2 round ran some 780 kernels more than a greedy one, each a few
microseconds of a graph's time for almost no work. Here a program holds a row's C <= 64 candidates in registers: the
stable descending rank of each comes from a C x C comparison (ties to the earlier column, as the stable sort), the
top-k cut keeps a column when fewer than top-k columns are strictly larger, the top-p cut when the mass of the columns
ranked before it is below top-p, and the draw takes the first column whose float64 CDF exceeds u times the total (the
searchsorted of the torch path). The same cuts on the same values; sums run in another order, so q agrees to
float32's rounding and a draw differs only where u falls within that rounding of a CDF step.

Importing this module imports triton. Without a GPU, TRITON_INTERPRET=1 runs the kernel on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_COLUMNS = 64  # candidates a row may hold (a program's registers)


@triton.jit
def _shaped_draw(
    scores,  # [R, C] f32 contiguous
    temperature, top_k, top_p, min_p,  # [R] f32, i64, f32, f32
    u,  # [R] f64: the row's uniform
    greedy,  # [R] i64: the column a greedy row keeps
    q,  # [R, C] f32 out: the row's distribution over its columns (one-hot at `greedy` for a greedy row)
    chosen,  # [R] i64 out
    C, BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    ok = i < C
    t = tl.load(temperature + r)
    keep_row = tl.load(greedy + r)
    x = tl.load(scores + r * C + i, mask=ok, other=float("-inf")) / tl.where(t > 0, t, 1.0)
    xi, xj = x[:, None], x[None, :]
    ii, jj = i[:, None], i[None, :]
    okj = ok[None, :]
    larger = ((xj > xi) & okj).to(tl.int32)  # [i, j]: column j strictly above column i
    before = larger | ((xj == xi) & (jj < ii) & okj).to(tl.int32)  # j ranked before i in the stable order
    k = tl.load(top_k + r)
    keep = ok & ((tl.sum(larger, axis=1) < k) | (k <= 0) | (k >= C))  # top-k 0 or the row's width: no cut
    z = tl.where(keep, x, float("-inf"))
    e = tl.where(keep, tl.exp(z - tl.max(z, axis=0)), 0.0)
    p = e / tl.sum(e, axis=0)
    mass = tl.sum(tl.where(before != 0, p[None, :], 0.0), axis=1)  # mass of the columns ranked before each
    tp = tl.load(top_p + r) + tl.zeros([BLOCK], tl.float32)  # the row's top-p at every column
    p = tl.where((mass >= tp) & (tp < 1.0), 0.0, p)  # top-p 1: no cut
    p = tl.where(p < tl.load(min_p + r) * tl.max(p, axis=0), 0.0, p)
    p = p / tl.sum(p, axis=0)
    cdf = tl.cumsum(p.to(tl.float64), axis=0)
    total = tl.sum(p.to(tl.float64), axis=0)
    thr = tl.load(u + r) * total
    drawn = tl.minimum(tl.sum((ok & (cdf <= thr)).to(tl.int64), axis=0), C - 1)
    samples = t > 0
    pick = tl.where(samples, drawn, keep_row)
    tl.store(q + r * C + i, tl.where(samples, p, tl.where(i == keep_row, 1.0, 0.0)), mask=ok)
    tl.store(chosen + r, pick)


def shaped_draw(scores: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor, u: torch.Tensor, greedy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [R, C] f32 (C <= MAX_COLUMNS), per row temperature f32 (0: greedy), top_k i64 (0: off), top_p f32,
    min_p f32, u f64 and the greedy column i64 -> (q [R, C] f32, chosen [R] i64): sampling rows drawn from their
    shaped softmax at u, greedy rows their `greedy` column with a one-hot q."""
    rows, width = scores.shape
    if width > MAX_COLUMNS:
        raise ValueError(f"shaped_draw takes at most {MAX_COLUMNS} columns a row, got {width}")
    q = torch.empty((rows, width), dtype=torch.float32, device=scores.device)
    chosen = torch.empty(rows, dtype=torch.int64, device=scores.device)
    if rows:
        _shaped_draw[(rows,)](scores.float().contiguous(), temperature.float().contiguous(), top_k.contiguous(),
                              top_p.float().contiguous(), min_p.float().contiguous(), u.contiguous(),
                              greedy.contiguous(), q, chosen, width, BLOCK=max(2, triton.next_power_of_2(width)),
                              num_warps=1)
    return q, chosen
