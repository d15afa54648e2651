"""The drafter's inference form on CUDA: its block rows and context writes reading and writing the lanes' context
rings in place (docs/adr/0010-drafter-ring-kernels.md).

Owns: `block` (what `DrafterModel.block` computes over `ContextCache.gather` and `block_mask`) and `write` (what
`DrafterModel.context_kv` + `ContextCache.write_rows` store), each layer's attention one Triton kernel over its fused
q|k|v product and each context write one kernel after its k/v product (ignis.kernels.drafter_triton), every residual
add joined to the next Qwen3 norm (ignis.kernels.norm_triton). Does not own: the weights or the reference arithmetic
(.model, which the CPU and training run), the rings' storage (.context) or when this form runs (the backend's `ring`
switch: CUDA, fused, outside the exact mode).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from ignis.backends.dflash2.model import DrafterModel, GroupedConv, Layer, Norm

from ignis.model.ops import linear

if TYPE_CHECKING:
    from ignis.kernels import norm_triton

Rings = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # per layer (K, V, positions held), as ContextCache.rings
# Whether a sublayer's side-1 grouped conv joins the next norm's launch (norm_triton.Conv) rather than taking its own
# (fused.grouped_conv): the same bits either way; tools.bench_round --drafter-conv times the two.
JOIN_CONV = True


def write(
    model: DrafterModel,
    taps: torch.Tensor,  # [T, len(target_layer_ids) * H] model dtype, CUDA: the target's tapped outputs
    positions: torch.Tensor,  # [T] int64: the rows' absolute positions
    lane_ix: torch.Tensor,  # [T] int64: each row's lane in the rings (the scratch lane for rows not kept)
    rings: Rings,
) -> None:
    """`context_kv` of committed rows stored straight into their lanes' ring slots."""
    from ignis.kernels import drafter_triton

    c = _add_norm(model.hidden_norm, model.fc(taps), None)[1]
    cos, sin = _rope_table(model, c)
    stacked = model.context_weights
    # every layer's k | v of the rows in one strided-batched product where the layers' weights share a buffer
    kvs = torch.bmm(c.expand(stacked.shape[0], -1, -1), stacked.transpose(1, 2)) if stacked is not None else None
    for i, (layer, (k, v, held)) in enumerate(zip(model.layers, rings)):
        att = cast(Layer, layer).self_attn
        assert att.qkv_proj is not None
        kv = kvs[i] if kvs is not None else linear(c, att.qkv_proj[att.num_heads * att.head_dim :], False)
        drafter_triton.ring_write(kv, att.k_norm.weight, att.k_norm.eps, cos, sin, lane_ix, positions, k, v, held)


def block(
    model: DrafterModel,
    x: torch.Tensor,  # [n, B, H] model dtype, CUDA: embedded [anchor, MASK...] rows (already scaled)
    positions: torch.Tensor,  # [n, B] int64: absolute positions of the rows
    rings: Rings,
    lanes: torch.Tensor,  # [n] int64: each block's lane in the rings
    span: int,  # ring slots worth reading: every lane has committed fewer rows
) -> torch.Tensor:
    """The final-normed hidden state of every block row, [n, B, H], as `DrafterModel.block` computes it."""
    from ignis.kernels import drafter_triton

    c = model.config
    n, rows, hidden = x.shape
    cos, sin = _rope_table(model, x)
    q_pos = positions.contiguous()
    h, d, conv = x.reshape(n * rows, hidden).contiguous(), None, None
    for i, (layer, (k, v, held)) in enumerate(zip(model.layers, rings)):
        layer = cast(Layer, layer)
        att = layer.self_attn
        assert att.qkv_proj is not None
        h, a = _add_norm(layer.input_layernorm, h, d, conv)
        dyn = None
        if layer.attention_conv is not None:
            a, dyn = layer.attention_conv.prepare(a.view(n, rows, hidden))
        qkv = linear(a.reshape(n * rows, hidden), att.qkv_proj, False)
        window = c.sliding_window if c.layer_types[i] == "sliding_attention" else None
        o = linear(drafter_triton.ring_attention(
            qkv, att.q_norm.weight, att.k_norm.weight, att.q_norm.eps, cos, sin, k, v, held, lanes, q_pos, span,
            window, c.causal[i], att.num_heads), att.o_proj.weight, False)
        o, conv = _finish(layer.attention_conv, o.view(n, rows, hidden), dyn)
        h, y = _add_norm(layer.post_attention_layernorm, h, o.reshape(n * rows, hidden), conv)
        if layer.mlp_conv is not None:
            y3, dyn = layer.mlp_conv.prepare(y.view(n, rows, hidden))
            d3, conv = _finish(layer.mlp_conv, layer.mlp(y3), dyn)
            d = d3.reshape(n * rows, hidden)
        else:
            d, conv = layer.mlp(y), None
    return _add_norm(model.norm, h, d, conv)[1].view(n, rows, hidden)


def _finish(gc: GroupedConv | None, y: torch.Tensor, dyn: torch.Tensor | None,
            ) -> tuple[torch.Tensor, norm_triton.Conv | None]:
    """A sublayer's output y [n, B, H] and the side-1 conv its next norm applies first (`norm_triton.Conv`, so the
    conv's launch joins the norm's), or y convolved here and None where that kernel takes no such conv (not two
    taps) or the layer has none."""
    from ignis.kernels import norm_triton

    if gc is None:
        return y, None
    assert dyn is not None
    if gc.kernel != 2 or not JOIN_CONV:
        return gc.finish(y, dyn), None
    return y, norm_triton.Conv(gc.base_kernel[1].to(y.dtype), dyn, gc.group, y.shape[1])


def _add_norm(norm: Norm, h: torch.Tensor, d: torch.Tensor | None, conv: norm_triton.Conv | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + d, norm(h + d)) in one Triton launch, rounding as `Norm` does; with `conv`, d convolved first."""
    from ignis.kernels import norm_triton

    return norm_triton.add_rms_norm(h, d, norm.weight, norm.eps, round_first=True, conv=conv)


def _rope_table(model: DrafterModel, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The precomputed (cos, sin) tables the kernels index by position."""
    table = model.rope.precomputed(like.dtype, like.device)
    if table is None:
        raise RuntimeError("the drafter's ring kernels read RoPE rows by position: call rope.precompute first")
    return table
