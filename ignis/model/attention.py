"""Gated full attention (Qwen3.5's `self_attn` layers, and the MTP layer) over each lane's keys in a page pool.

Owns: `GatedAttention` (projections, q/k norms, partial RoPE, output gate) and the three ways of attending: exact
(each query row alone against its causal prefix), SDPA per segment, and `decode` (B lanes x C columns against their
key slots with a position mask: static shapes, so a round can be captured). Does not own: the cache tensors (passed in
as `AttnState`: pages and the block table that maps each lane's positions to them, ignis.model.pool) or the lane
bookkeeping. The exact and SDPA forms read a segment's keys through the table into a contiguous copy first (the
reference: the same values, in the same order, as a per-lane cache); `decode` reads the pages in place.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import CausalBias, causal_lower_right

from ignis.kernels import attention, fused
from ignis.model.cache import AttnState
from ignis.model.config import ModelConfig
from ignis.model.decode import DecodeStep
from ignis.model.ops import (
    RMSNorm,
    Step,
    Weight,
    apply_rope,
    fuse_weights,
    linear,
    sigmoid,
)


PLANLESS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class GatedAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.num_heads = c.num_attention_heads
        self.num_kv = c.num_key_value_heads
        self.head_dim = c.head_dim
        self.scale = c.head_dim**-0.5
        # q_proj emits, per head, [query | gate] (not all queries then all gates).
        self.q_proj = nn.Linear(c.hidden_size, 2 * c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.qkv_proj: Weight | None = None  # [(2 nh + 2 nkv) hd, H]: q+gate | k | v, once fused

    def fuse(self) -> None:
        self.qkv_proj = fuse_weights(self.q_proj, self.k_proj, self.v_proj)
        self.q_norm.fuse()
        self.k_norm.fuse()

    def forward(self, x: torch.Tensor, step: Step, cache: AttnState) -> torch.Tensor:
        """x [T, H] (normed) -> [T, H]; writes every row's K/V at its position in its lane's cache first."""
        ex = step.exact
        t = x.shape[0]
        qg = linear(x, self.q_proj.weight, ex).view(t, self.num_heads, 2 * self.head_dim)
        q, gate = qg[..., : self.head_dim], qg[..., self.head_dim :]
        q = self.q_norm(q)
        k = self.k_norm(linear(x, self.k_proj.weight, ex).view(t, self.num_kv, self.head_dim))
        v = linear(x, self.v_proj.weight, ex).view(t, self.num_kv, self.head_dim)
        q = apply_rope(q, step.cos, step.sin)
        k = apply_rope(k, step.cos, step.sin)
        for seg in step.segments:
            rows = slice(seg.offset, seg.offset + seg.length)
            cache.write(seg.lane, seg.start, k[rows], v[rows])
        out = torch.empty_like(q)
        attend = self._attend_exact if ex else self._attend_sdpa
        for seg in step.segments:
            rows = slice(seg.offset, seg.offset + seg.length)
            keys, values = cache.read(seg.lane, seg.start + seg.length)  # [start + length, nkv, hd] each
            out[rows] = attend(q[rows], keys, values, seg.start)
        out = out.reshape(t, self.num_heads * self.head_dim) * sigmoid(gate.reshape(t, -1), ex)
        return linear(out, self.o_proj.weight, ex)

    def decode(self, x: torch.Tensor, step: DecodeStep, cache: AttnState) -> torch.Tensor:
        """x [B*C, H] (normed) -> [B*C, H]; writes every column's K/V at its position in its lane first."""
        nh, nkv = self.num_heads, self.num_kv
        if self.qkv_proj is not None:
            qkv = linear(x, self.qkv_proj, False)
        else:
            qkv = torch.cat([linear(x, m.weight, False) for m in (self.q_proj, self.k_proj, self.v_proj)], dim=-1)
        # q/k norms, RoPE and the K/V write, one launch on CUDA; queries come back as [B, nkv, group*C, hd]: the
        # query heads of one KV head attend together as group*C rows, with no copy of K/V per query head.
        qh = fused.qk_rope_write(qkv, _scale(self.q_norm), _scale(self.k_norm), self.q_norm.eps, step.cos, step.sin,
                                 cache.k, cache.v, cache.table, step.lanes, step.positions, nh, nkv)
        o = attention.attend(qh, cache.k, cache.v, cache.table, step.lanes, step.positions, step.span, self.scale, qkv,
                             nh)
        return linear(o, self.o_proj.weight, False)  # o: the gated heads [B*C, nh * hd]

    def _attend_exact(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        """q [L, nh, hd] at positions start..start+L-1; k/v [start + L, nkv, hd] of the lane -> [L, nh, hd].

        One row at a time, against exactly its causal prefix, so every op's shape depends only on the row's position:
        a row's bits are the same in a decode, a verify or a prefill chunk."""
        group = self.num_heads // self.num_kv
        out = torch.empty_like(q)
        for i in range(q.shape[0]):
            n = start + i + 1
            keys = k[:n].permute(1, 2, 0)  # [nkv, hd, n]
            vals = v[:n].transpose(0, 1)  # [nkv, n, hd]
            scores = (q[i].view(self.num_kv, group, self.head_dim) @ keys) * self.scale
            probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
            out[i] = (probs @ vals).view(self.num_heads, self.head_dim)
        return out

    def _attend_sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        length = q.shape[0]
        n = start + length
        qh = q.transpose(0, 1)[None]  # [1, nh, L, hd]
        kh = k[:n].transpose(0, 1)[None]  # [1, nkv, n, hd]
        vh = v[:n].transpose(0, 1)[None]
        mask: torch.Tensor | CausalBias | None
        if length == 1:
            mask, causal = None, False
        elif start == 0:
            mask, causal = None, True
        elif q.is_cuda and q.dtype != torch.float32:
            # A chunk after the prompt's first: row i sees keys 0..start+i, causal aligned to the bottom right. Flash
            # attention takes that alignment itself; a boolean [L, n] mask would send SDPA to a kernel that reads it
            # (and at n = 262,144 keys may materialise scores).
            mask, causal = causal_lower_right(length, n), False
        else:
            cols = torch.arange(n, device=q.device)
            mask = cols[None, :] <= (start + torch.arange(length, device=q.device))[:, None]  # [L, n] bool
            causal = False
        # Unmasked prefill avoids cuDNN's kernel, which builds an execution plan for every new prompt length (25 ms a
        # layer on the first request of a length, measured on the H200); flash attention has no per-shape plan.
        with sdpa_kernel(PLANLESS) if not isinstance(mask, torch.Tensor) and q.is_cuda else nullcontext():
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=causal, scale=self.scale,
                                               enable_gqa=self.num_kv != self.num_heads)
        return o[0].transpose(0, 1)


def _scale(norm: RMSNorm) -> torch.Tensor:
    """The fp32 weight 1 + w of a zero-centred norm (made once by `RMSNorm.fuse`)."""
    return norm.scale if norm.scale is not None else 1.0 + norm.weight.float()
