"""The DFlash-family drafter network: context projection, decoder layers with injected context K/V, grouped convs.

Owns: `DrafterModel` (parameters named exactly as the checkpoint's tensors), `context_kv` (what one committed token
contributes to every layer, computed once) and `block` (one pass over the lanes' blocks against their context).
Does not own: which context rows a lane keeps (.context), the output head and the choice of drafts (.heads,
.selector), or file formats (.weights). Training (ignis.train, `ignis train-drafter`) runs this same module.

Per layer (research/dflash.md §1.4, dflash2.md §1): Q comes from the block rows only; K/V are the context's
(k_norm(k_proj(c)) with RoPE at the token's absolute position, v_proj(c)) followed by the block rows' own. Norms are
Qwen3's (x / rms(x) * w), not the target's zero-centred ones. DFlash2 wraps the attention and the MLP in grouped
dynamic causal convs over block rows, whose output-side coefficients are predicted from the sublayer's input.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from ignis.backends.dflash2.config import DrafterConfig
from ignis.kernels import fused, int4_mma
from torch import nn

from ignis.model.ops import Rope, Weight, apply_rope, fuse_rows, linear, swiglu_linear
from ignis.quant.format import quantize
from ignis.quant.fp8 import Fp8Linear, fuse_fp8, quantize_fp8
from ignis.quant.linear import QuantLinear, fuse_packed, uses_mma


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # `converted`'s
INT4_GROUPS = (128, 64)  # `to_int4`'s group of input columns: the first that divides a projection's inputs


def int4_layout(shapes: list[tuple[int, int]], device: torch.device, dtype: torch.dtype) -> tuple[list[int], bool]:
    """For the (out, in) projections `to_int4` packs on `device` in `dtype`: the group of each (the first of
    INT4_GROUPS dividing its inputs, 0 where none does), and whether all are held in the mma kernel's order (it runs
    there and takes every one of them: a layer's projections fuse only when held alike)."""
    groups = [next((g for g in INT4_GROUPS if cols % g == 0), 0) for _, cols in shapes]
    mma = all(groups) and uses_mma(device, dtype) and all(
        int4_mma.fits(out, cols, g) for (out, cols), g in zip(shapes, groups, strict=True))
    return groups, mma


def converted(name: str) -> bool:
    """Whether `to_fp8` and `to_int4` (spec.draft_weights) convert the module `name` (or the checkpoint tensor
    `name`.weight): fc and every layer's attention and MLP projections."""
    name = name.removesuffix(".weight")
    return name == "fc" or layer_projection(name)


def layer_projection(name: str) -> bool:
    """Whether the module `name` (or the checkpoint tensor `name`.weight) is one of a layer's attention and MLP
    projections: what a block pass reads and the context's writes do not all read (.greedy_copy packs these)."""
    name = name.removesuffix(".weight")
    return name.startswith("layers.") and name.rsplit(".", 1)[-1] in PROJECTIONS


class Norm(nn.Module):
    """Qwen3 RMSNorm: x / rms(x) * w in fp32, cast back before the weight (HF Qwen3RMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class GroupedConv(nn.Module):
    """DFlash2's grouped dynamic causal conv over the rows of each block (row 0 is the anchor, zero-padded before).

    out[t, c] = sum_tap (base[side, tap, c] + dyn[t, side, tap, c // group]) * x[t - tap, c]
    `prepare` convolves the sublayer input (side 0) and returns the coefficients of side 1, which `finish` applies
    to the sublayer output: both sides' dynamic taps are predicted from the normalised input rows.
    """

    def __init__(self, hidden: int, kernel: int, group: int) -> None:
        super().__init__()
        self.kernel = kernel
        self.group = group
        self.groups = hidden // group
        base = torch.zeros(2, kernel, hidden)
        base[:, 0] = 1.0  # identity until trained: an untrained DFlash2 layer is a DFlash layer
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(hidden, 2 * kernel * self.groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, B, H] -> (convolved x [n, B, H], side-1 coefficients [n, B, kernel, groups])."""
        dyn = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel, self.groups)
        return self._convolve(x, dyn[..., 0, :, :], 0), dyn[..., 1, :, :]

    def finish(self, y: torch.Tensor, dyn: torch.Tensor) -> torch.Tensor:
        return self._convolve(y, dyn, 1)

    def _convolve(self, x: torch.Tensor, dyn: torch.Tensor, side: int) -> torch.Tensor:
        return fused.grouped_conv(x, self.base_kernel[side].to(x.dtype), dyn, self.group)


class Attention(nn.Module):
    def __init__(self, c: DrafterConfig) -> None:
        super().__init__()
        self.num_heads = c.num_heads
        self.num_kv = c.num_kv_heads
        self.head_dim = c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = Norm(c.head_dim, c.rms_norm_eps)
        self.k_norm = Norm(c.head_dim, c.rms_norm_eps)

        self.qkv_proj: Weight | None = None  # [(nh + 2 nkv) hd, H]: q | k | v, once fused (inference)

    def fuse(self, out: torch.Tensor | None = None) -> None:
        """out: where a dense q | k | v is held (`fuse_rows`), else a new tensor."""
        if isinstance(self.q_proj, Fp8Linear):
            self.qkv_proj = fuse_fp8((self.q_proj, self.k_proj, self.v_proj))  # type: ignore[arg-type]
        elif isinstance(self.q_proj, QuantLinear):  # None where the three did not pack alike: they run unfused
            self.qkv_proj = fuse_packed((self.q_proj, self.k_proj, self.v_proj))  # type: ignore[arg-type]
        else:
            self.qkv_proj = fuse_rows(self.q_proj, self.k_proj, self.v_proj, out=out)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> K, V [T, nkv, hd]: K normed and rotated at the rows' positions (cos/sin [T, rd])."""
        t, nkv, hd = x.shape[0], self.num_kv, self.head_dim
        if self.qkv_proj is not None:
            k, v = linear(x, self.qkv_proj[self.num_heads * hd :], False).split(nkv * hd, dim=-1)
        else:
            k, v = self.k_proj(x), self.v_proj(x)
        return apply_rope(self.k_norm(k.reshape(t, nkv, hd)), cos, sin), v.reshape(t, nkv, hd)

    def forward(
        self,
        x: torch.Tensor,  # [n, B, H] the block rows, normed (and convolved)
        cos: torch.Tensor,  # [n*B, rd] model dtype, device
        sin: torch.Tensor,  # [n*B, rd] model dtype, device
        ctx_k: torch.Tensor,  # [m, C, nkv, hd] model dtype, device: context keys, normed and rotated
        ctx_v: torch.Tensor,  # [m, C, nkv, hd] model dtype, device
        mask: torch.Tensor,  # [m, P*B, C + P*B] bool, device: key visible to query row
    ) -> torch.Tensor:
        """Each block's rows against its context and its own rows. Blocks share a context in runs of P = n / m
        (serving: P = 1, a context each; training: a sequence's blocks, one copy of its context): the P blocks of a
        run attend as one query set of P*B rows, whose keys are the context and all P blocks' rows, and `mask` keeps
        each block to its own (`shared_context_mask`)."""
        n, rows, _ = x.shape
        m = ctx_k.shape[0]
        flat = x.reshape(n * rows, -1)
        t, nh, nkv, hd = n * rows, self.num_heads, self.num_kv, self.head_dim
        if self.qkv_proj is not None:
            # One product for q, k and v, one rotation for q and k together.
            q, k, v = linear(flat, self.qkv_proj, False).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            qk = apply_rope(torch.cat([self.q_norm(q.reshape(t, nh, hd)), self.k_norm(k.reshape(t, nkv, hd))], dim=1),
                            cos, sin)
            q, k, v = qk[:, :nh].reshape(t, nh, hd), qk[:, nh:], v.reshape(t, nkv, hd)
        else:
            q = apply_rope(self.q_norm(self.q_proj(flat).view(t, nh, hd)), cos, sin)
            k, v = self.keys(flat, cos, sin)
        r = n // m * rows  # query rows a context serves
        k = torch.cat([ctx_k, k.view(m, r, self.num_kv, self.head_dim)], dim=1)
        v = torch.cat([ctx_v, v.view(m, r, self.num_kv, self.head_dim)], dim=1)
        group, nkv, hd = self.num_heads // self.num_kv, self.num_kv, self.head_dim
        # The query heads of one KV head attend together as group*r rows: no copy of K/V per query head.
        qh = q.view(m, r, nkv, group, hd).permute(0, 2, 3, 1, 4).reshape(m, nkv, group * r, hd)
        kh, vh = k.transpose(1, 2), v.transpose(1, 2)  # [m, nkv, C+r, hd]
        # Under training autocast the cached context keys may be fp32 beside bf16 values: one dtype for the kernel.
        kh, vh = kh.to(qh.dtype), vh.to(qh.dtype)
        am = mask[:, None, None].expand(m, 1, group, r, mask.shape[-1]).reshape(m, 1, group * r, mask.shape[-1])
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=am, scale=hd**-0.5)  # [m, nkv, group*r, hd]
        o = o.view(m, nkv, group, r, hd).permute(0, 3, 1, 2, 4).reshape(n, rows, self.num_heads * hd)
        return self.o_proj(o)


class Mlp(nn.Module):
    def __init__(self, c: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.gate_up: Weight | None = None  # [2 inner, H], once fused (inference)

    def fuse(self) -> None:
        if isinstance(self.gate_proj, Fp8Linear):
            self.gate_up = fuse_fp8((self.gate_proj, self.up_proj))  # type: ignore[arg-type]
        elif isinstance(self.gate_proj, QuantLinear):
            self.gate_up = fuse_packed((self.gate_proj, self.up_proj))  # type: ignore[arg-type]
        else:
            self.gate_up = fuse_rows(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            return linear(swiglu_linear(x, self.gate_up), self.down_proj.weight, False)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: DrafterConfig) -> None:
        super().__init__()
        self.input_layernorm = Norm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = Norm(c.hidden_size, c.rms_norm_eps)
        self.mlp = Mlp(c)
        self.attention_conv: GroupedConv | None = None
        self.mlp_conv: GroupedConv | None = None
        if c.is_v2:
            self.attention_conv = GroupedConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size)
            self.mlp_conv = GroupedConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.input_layernorm(h)
        if self.attention_conv is not None:
            x, dyn = self.attention_conv.prepare(x)
            h = h + self.attention_conv.finish(self.self_attn(x, cos, sin, ctx_k, ctx_v, mask), dyn)
        else:
            h = h + self.self_attn(x, cos, sin, ctx_k, ctx_v, mask)
        y = self.post_attention_layernorm(h)
        if self.mlp_conv is not None:
            y, dyn = self.mlp_conv.prepare(y)
            return h + self.mlp_conv.finish(self.mlp(y), dyn)
        return h + self.mlp(y)


class Selector(nn.Module):
    """DFlash2's candidate selector weights: a rank-r trilinear Markov edge between consecutive drafts."""

    def __init__(self, c: DrafterConfig) -> None:
        super().__init__()
        self.hidden_projection = nn.Linear(c.hidden_size, c.selector_rank, bias=False)
        # Bare tensors in the checkpoint (no `.weight`), so plain parameters rather than nn.Embedding. Not zero:
        # in a trilinear product two zero factors would hold each other's gradient at zero.
        self.predecessor_codebook = nn.Parameter(torch.randn(c.vocab_size, c.selector_rank) * 0.02)
        self.successor_codebook = nn.Parameter(torch.randn(c.vocab_size, c.selector_rank) * 0.02)


class DrafterModel(nn.Module):
    def __init__(self, c: DrafterConfig) -> None:
        super().__init__()
        self.config = c
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = Norm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.num_layers))
        self.norm = Norm(c.hidden_size, c.rms_norm_eps)
        self.candidate_selector = Selector(c) if c.is_v2 else None
        self.rope = Rope(c.rotary_dim, c.rope_theta)
        # [L, 2 nkv hd, H]: every layer's k | v rows, a view of the layers' fused q | k | v (`fuse`, dense weights)
        self.context_weights: torch.Tensor | None = None

    @torch.no_grad()
    def to_fp8(self) -> int:
        """Inference only, before `fuse`: fc and every layer's attention and MLP projections become Fp8Linear (e4m3
        codes, a scale per output row; ignis.quant.fp8), one at a time on the weight's device. The grouped convs'
        kernel projections and the selector stay in their precision (small, and read by every row). Returns how
        many were converted."""
        done = 0
        for name, module in list(self.named_modules()):
            if converted(name):
                assert isinstance(module, nn.Linear) and module.bias is None
                parent, _, attr = name.rpartition(".")
                setattr(self.get_submodule(parent), attr, Fp8Linear(quantize_fp8(module.weight)))
                done += 1
        return done

    @torch.no_grad()
    def to_int4(self, names: Callable[[str], bool] = converted) -> int:
        """Inference only, before `fuse`: the projections `names` selects (`converted`'s by default) become 4-bit
        QuantLinear (the format's min-max codes over groups of 128 input columns, 64 where 128 does not divide them;
        ignis.quant.format), one at a time on the weight's device, all held in the mma kernel's order where that
        kernel runs and takes every one of them (else none, so that a layer's projections still fuse). Raises
        ValueError, before converting any, where a projection's inputs are not a multiple of 64. Returns how many
        were converted."""
        targets = [(name, cast(nn.Linear, m)) for name, m in self.named_modules() if names(name)]
        if not targets:
            return 0
        weight = targets[0][1].weight
        groups, mma = int4_layout([(m.out_features, m.in_features) for _, m in targets], weight.device, weight.dtype)
        for (name, module), group in zip(targets, groups, strict=True):
            if not group:
                raise ValueError(f"{name} takes {module.in_features} inputs, not a multiple of {INT4_GROUPS[-1]}: "
                                 f"the 4-bit format's groups do not divide them")
        for (name, module), group in zip(targets, groups, strict=True):
            assert module.bias is None
            packed = QuantLinear(module.in_features, module.out_features, group)
            qweight, scales, qzeros = quantize(module.weight, group)
            # scales take the model's dtype, as a quantized checkpoint's do when it loads (ignis.model.loader)
            packed.qweight, packed.scales, packed.qzeros = qweight, scales.to(module.weight.dtype), qzeros
            if mma:
                packed.repack(module.weight.dtype)
            parent, _, attr = name.rpartition(".")
            setattr(self.get_submodule(parent), attr, packed)
        return len(targets)

    @torch.no_grad()
    def fuse(self) -> None:
        """Inference only: each layer's q, k, v and gate, up projections become one product each (views of one
        weight, no extra memory). A model being trained stays unfused. Dense layers hold their q | k | v in one buffer
        [L, rows, H], so that the context's keys and values of every layer are one batched product
        (`context_weights`)."""
        attns = [cast(Layer, layer).self_attn for layer in self.layers]
        stacked = None
        if all(type(a.q_proj) is nn.Linear for a in attns):
            q = attns[0].q_proj.weight
            rows = q.shape[0] + attns[0].k_proj.weight.shape[0] + attns[0].v_proj.weight.shape[0]
            stacked = torch.empty((len(attns), rows, q.shape[1]), dtype=q.dtype, device=q.device)
        for i, (layer, att) in enumerate(zip(self.layers, attns)):
            att.fuse(stacked[i] if stacked is not None else None)
            cast(Layer, layer).mlp.fuse()
        if stacked is not None:
            self.context_weights = stacked[:, attns[0].num_heads * attns[0].head_dim :]

    def context_kv(
        self,
        taps: torch.Tensor,  # [T, len(target_layer_ids) * H] model dtype, device: the target's tapped outputs
        positions: torch.Tensor,  # [T] int64, device: the rows' absolute positions
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (K, V) [T, nkv, hd] for committed context rows: fc + hidden_norm, then k/v projections."""
        c = self.hidden_norm(self.fc(taps))
        cos, sin = self.rope.tables(positions, c.dtype)
        return [cast(Layer, layer).self_attn.keys(c, cos, sin) for layer in self.layers]

    def block(
        self,
        x: torch.Tensor,  # [n, B, H] model dtype, device: embedded [anchor, MASK...] rows (already scaled)
        positions: torch.Tensor,  # [n, B] int64, device: absolute positions of the rows
        context: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (K, V) [m, C_l, nkv, hd], m dividing n
        masks: list[torch.Tensor],  # per layer [m, P*B, C_l + P*B] bool, P = n / m: key visible to query row
    ) -> torch.Tensor:
        """The final-normed hidden state of every block row, [n, B, H]. Serving gives each block its own context
        (m = n); training gives a sequence's P blocks one copy (`Attention.forward`)."""
        cos, sin = self.rope.tables(positions.reshape(-1), x.dtype)
        h = x
        for layer, (k, v), mask in zip(self.layers, context, masks):
            h = layer(h, cos, sin, k, v, mask)
        return self.norm(h)


def block_mask(
    c: DrafterConfig,
    layer: int,
    ctx_pos: torch.Tensor,  # [n, C] int64, device: position held in each context slot, -1 if empty
    q_pos: torch.Tensor,  # [n, B] int64, device: positions of the block rows
) -> torch.Tensor:
    """[n, B, C + B] bool: which context slots and block rows each block row attends to, as the format defines.

    Context rows must precede the block's anchor (they always do: only committed rows are context). Sliding layers
    see a key iff q_pos - k_pos < window (and, non-causal, k_pos - q_pos < window); causal layers see block rows
    up to their own."""
    window = c.sliding_window if c.layer_types[layer] == "sliding_attention" else None
    anchor = q_pos[:, :1]
    ctx = (ctx_pos >= 0) & (ctx_pos < anchor)  # [n, C]
    ctx = ctx[:, None, :].expand(-1, q_pos.shape[1], -1)
    if window is not None:
        ctx = ctx & (q_pos[:, :, None] - ctx_pos[:, None, :] < window)
    dq = q_pos[:, :, None] - q_pos[:, None, :]  # [n, B, B]: query minus key position
    own = torch.ones_like(dq, dtype=torch.bool)
    if c.causal[layer]:
        own = own & (dq >= 0)
    if window is not None:
        own = own & (dq < window) & (-dq < window)
    return torch.cat([ctx, own], dim=-1)


def shared_context_mask(
    c: DrafterConfig,
    layer: int,
    ctx_pos: torch.Tensor,  # [m, C] int64, device: position held in each context slot, -1 if empty
    q_pos: torch.Tensor,  # [m, P, B] int64, device: positions of the rows of P blocks sharing that context
) -> torch.Tensor:
    """[m, P*B, C + P*B] bool: `block_mask` for P blocks that attend as one query set against one copy of their
    context: each row sees what `block_mask` lets it see of the context, and of the P blocks' rows only its own
    block's, so the result is the P blocks' own attention, row for row."""
    m, per, rows = q_pos.shape
    each = block_mask(c, layer, ctx_pos.repeat_interleave(per, dim=0), q_pos.reshape(m * per, rows))
    ctx = each[..., : ctx_pos.shape[1]].reshape(m, per * rows, -1)
    own = torch.zeros((per, m, rows, per, rows), dtype=torch.bool, device=q_pos.device)
    idx = torch.arange(per, device=q_pos.device)
    own[idx, :, :, idx, :] = each[..., ctx_pos.shape[1] :].view(m, per, rows, rows).transpose(0, 1)
    return torch.cat([ctx, own.permute(1, 0, 2, 3, 4).reshape(m, per * rows, per * rows)], dim=-1)
