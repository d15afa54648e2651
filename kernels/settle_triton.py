"""A round's acceptance settled in one Triton launch for every lane: `settle`.

Owns: the kernel and its launch on torch's current stream (allocating only its outputs, so a CUDA graph captures it).
Does not own: the rules, which are ignis.engine.device_sampling's torch path (`settle_reference`: `accept_greedy`, the
sampled lanes' results taken where a lane samples, the rows' following tokens and the read-back row), the argmax over
the vocabulary or the sampled acceptance itself (ignis.engine.device_sampling), or where it runs (that module's
`settle`).

Why: the torch path is a dozen launches a round over a few int64 a lane (a comparison, a mask, a cumulative product,
a sum and a gather for the greedy prefix, two selections where lanes sample, a concatenation and a scatter for the
following tokens, a concatenation for the read-back row). In a small model's graph each is a few microseconds of
launch for almost no work. Here a program holds its lane's K drafts and K+1 argmax columns in registers: the drafts
kept are the first column that misses (a draft unlike the argmax, or past `allowed`), the token is the argmax there,
and the outputs are written from the same registers. Integers only, so the results are the reference's exactly.

Importing this module imports triton. Without a GPU, TRITON_INTERPRET=1 runs the kernel on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _settle(
    drafts, draft_stride,  # [B, K] i64, rows draft_stride apart
    argmax,  # [B, K+1] i64 contiguous: the model's choice at every column
    allowed,  # [B] i64: drafts the lane may keep
    sampled_accepted, sampled_token, greedy,  # [B] i64 each (SAMPLED): the sampled acceptance, 1 where a lane is greedy
    accepted_out, token_out,  # [B] i64 out
    following,  # [B, K+1] i64 out: the token after each row (the drafts, the token at the first row not kept)
    read_back,  # [B, K+2] i64 out: accepted, the drafts, the token
    K, SAMPLED: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    in_drafts = j < K
    d = tl.load(drafts + b * draft_stride + j, mask=in_drafts, other=0)
    m = tl.load(argmax + b * (K + 1) + j, mask=j < K + 1, other=0)
    miss = in_drafts & ((d != m) | (j >= tl.load(allowed + b)))
    accepted = tl.min(tl.where(miss, j, K), axis=0).to(tl.int64)
    token = tl.sum(tl.where(j == accepted, m, 0), axis=0)
    if SAMPLED:
        keep = tl.load(greedy + b) != 0
        accepted = tl.where(keep, accepted, tl.load(sampled_accepted + b))
        token = tl.where(keep, token, tl.load(sampled_token + b))
    tl.store(accepted_out + b, accepted)
    tl.store(token_out + b, token)
    tl.store(following + b * (K + 1) + j, tl.where(in_drafts & (j != accepted), d, token), mask=j < K + 1)
    row = read_back + b * (K + 2)
    tl.store(row, accepted)
    tl.store(row + 1 + j, d, mask=in_drafts)
    tl.store(row + K + 1, token)


def settle(
    drafts: torch.Tensor, argmax: torch.Tensor, allowed: torch.Tensor, read_back: torch.Tensor,
    sampled: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """drafts [B, K] i64 (rows may be strided), argmax [B, K+1] i64, allowed [B] i64, and where lanes sample their
    (accepted [B], token [B], greedy [B]) i64 -> (accepted [B], token [B], following [B, K+1]), with read_back
    [B, K+2] i64 (contiguous) written: ignis.engine.device_sampling.settle_reference's results, bit for bit."""
    b, k = drafts.shape
    if argmax.shape != (b, k + 1) or read_back.shape != (b, k + 2) or not read_back.is_contiguous():
        raise ValueError(f"settle: argmax {tuple(argmax.shape)} and read_back {tuple(read_back.shape)} for drafts "
                         f"{tuple(drafts.shape)}")
    accepted = torch.empty(b, dtype=torch.int64, device=drafts.device)
    token = torch.empty(b, dtype=torch.int64, device=drafts.device)
    following = torch.empty((b, k + 1), dtype=torch.int64, device=drafts.device)
    if drafts.stride(1) != 1 and k > 1:
        drafts = drafts.contiguous()
    a_s, t_s, greedy = sampled if sampled is not None else (accepted, token, accepted)  # not read unless SAMPLED
    if b:
        _settle[(b,)](drafts, drafts.stride(0), argmax.contiguous(), allowed.contiguous(), a_s.contiguous(),
                      t_s.contiguous(), greedy.contiguous(), accepted, token, following, read_back, k,
                      SAMPLED=sampled is not None, BLOCK=max(2, triton.next_power_of_2(k + 1)), num_warps=1)
    return accepted, token, following
