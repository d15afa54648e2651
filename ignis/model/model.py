"""The Qwen3.5 hybrid decoder: embeddings, 3:1 Gated DeltaNet / gated-attention blocks, final norm, output head,
and the checkpoint's own MTP head.

Owns: `HybridModel` (one forward over a packed `Batch` against a `LaneCache`), `MTPHead`, `DecoderLayer`, `MLP`.
Does not own: loading weights (ignis.model.loader), scheduling lanes (ignis.engine), the drafting loop that calls
`MTPHead` (ignis.backends.mtp).

    x = embed(ids)
    for each layer:  x = x + Mixer(norm1(x));  x = x + MLP(norm2(x))     # Mixer: GatedDeltaNet | GatedAttention
    hidden = norm(x);  logits = lm_head(hidden[logit_rows])
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from ignis.kernels import fused
from ignis.model.attention import GatedAttention
from ignis.model.batch import Batch, ForwardOut, Segment
from ignis.model.cache import AttnState, GDNState, LaneCache
from ignis.model.config import ModelConfig
from ignis.model.decode import DecodeStep
from ignis.model.gdn import GatedDeltaNet
from ignis.model.ops import (
    RMSNorm,
    Rope,
    Step,
    Weight,
    fuse_weights,
    linear,
    silu,
    swiglu_linear,
)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.gate_up: Weight | None = None  # [2 inner, H], once fused

    def fuse(self) -> None:
        self.gate_up = fuse_weights(self.gate_proj, self.up_proj)

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """forward for the device round: the gate and up products as one, SwiGLU as one launch on CUDA."""
        if self.gate_up is None:
            return self.forward(x, False)
        return linear(swiglu_linear(x, self.gate_up), self.down_proj.weight, False)

    def forward(self, x: torch.Tensor, exact: bool) -> torch.Tensor:
        if self.gate_up is not None and not exact:
            gate, up = linear(x, self.gate_up, False).chunk(2, dim=-1)
            return linear(F.silu(gate) * up, self.down_proj.weight, False)
        gate = silu(linear(x, self.gate_proj.weight, exact), exact)
        return linear(gate * linear(x, self.up_proj.weight, exact), self.down_proj.weight, exact)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, kind: str) -> None:
        super().__init__()
        self.kind = kind
        if kind == "full_attention":
            self.self_attn = GatedAttention(config)
        else:
            self.linear_attn = GatedDeltaNet(config)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def fuse(self) -> None:
        (self.self_attn if self.kind == "full_attention" else self.linear_attn).fuse()
        self.mlp.fuse()
        self.input_layernorm.fuse()
        self.post_attention_layernorm.fuse()

    def forward(self, x: torch.Tensor, step: Step, state: AttnState | GDNState) -> torch.Tensor:
        """x [T, H] -> [T, H], the layer's output (the residual stream after it)."""
        h = self.input_layernorm(x)
        if isinstance(state, AttnState):
            h = self.self_attn(h, step, state)
        else:
            h = self.linear_attn(h, step, state)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x), step.exact)

    def decode(
        self, x: torch.Tensor, d: torch.Tensor | None, step: DecodeStep, state: AttnState | GDNState
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The device round's form of `forward`, with the residual add deferred: the stream before this layer is
        x + d (d None: x), after it the returned x' + d'. Each residual add runs inside the next norm's launch."""
        x, h = add_norm(x, d, self.input_layernorm)
        if isinstance(state, AttnState):
            h = self.self_attn.decode(h, step, state)
        else:
            h = self.linear_attn.decode(h, step, state)
        x, h = add_norm(x, h, self.post_attention_layernorm)
        return x, self.mlp.decode(h)


def add_norm(x: torch.Tensor, d: torch.Tensor | None, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + d, norm(x + d)): one launch on CUDA once the norm is fused."""
    if norm.scale is None:
        x = x if d is None else x + d
        return x, norm(x)
    return fused.add_rms_norm(x, d, norm.scale, norm.eps)


class HybridModel(nn.Module):
    def __init__(self, config: ModelConfig, *, mtp: bool = False, exact: bool = False) -> None:
        super().__init__()
        self.config = config
        self.exact = exact
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, kind) for kind in config.layer_types)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.mtp: MTPHead | None = MTPHead(config, exact=exact) if mtp else None
        self.rope = Rope(config.rotary_dim, config.rope_theta)

    @torch.no_grad()
    def fuse(self) -> None:
        """Fewer, larger kernels for models not in exact mode: projections that read the same input share one weight
        (the checkpoint's parameters become views of it), norms run as torch's rms_norm. Exact mode keeps the
        reference arithmetic, so an exact model is never fused."""
        if self.exact:
            raise ValueError("an exact model keeps its reference arithmetic; fuse only models with exact=False")
        for layer in self.layers:
            cast(DecoderLayer, layer).fuse()
        self.norm.fuse()
        if self.mtp is not None:
            cast(DecoderLayer, self.mtp.layers[0]).fuse()
            for n in (self.mtp.pre_fc_norm_embedding, self.mtp.pre_fc_norm_hidden, self.mtp.norm):
                n.fuse()

    @torch.no_grad()
    def forward(self, batch: Batch, cache: LaneCache, taps: tuple[int, ...] = ()) -> ForwardOut:
        """One pass over the packed rows of `batch`, reading and advancing each segment's lane in `cache`.

        taps: decoder-layer indices l whose output (transformers' hidden_states[l+1], before the final norm) is
        returned, concatenated in the order given."""
        n_layers = len(self.layers)
        for t in taps:
            if not 0 <= t < n_layers:
                raise ValueError(f"tap {t} out of range 0..{n_layers - 1}")
        for seg in batch.segments:
            cache.check_segment(seg.lane, seg.start, seg.length, seg.record)
        if any(seg.record for seg in batch.segments):
            cache.recording()
        x = self.embed(batch.tokens)
        step = Step.build(batch.segments, batch.positions, self.rope, x.dtype, self.exact)
        tapped: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, step, cache.layers[i])
            if i in taps:
                tapped[i] = x
        for seg in batch.segments:
            if seg.record:
                cache.recorded[seg.lane] = seg.length
        hidden = self.norm(x)
        return ForwardOut(
            hidden=hidden,
            logits=self.logits(hidden[batch.logit_rows]),
            taps=torch.cat([tapped[t] for t in taps], dim=-1) if taps else None,
        )

    @torch.no_grad()
    def decode(
        self,
        tokens: torch.Tensor,  # [B, C] int64, device
        step: DecodeStep,
        cache: LaneCache,
        taps: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The static decode/verify forward: (final-normed hidden [B*C, H], tapped outputs [B*C, len(taps) * H] or
        None). No host value is read, so it can be captured; logits are the caller's (`logits`)."""
        x, d = self.embed(tokens.reshape(-1)), None
        tapped: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            x, d = cast(DecoderLayer, layer).decode(x, d, step, cache.layers[i])
            if i in taps:
                tapped[i] = x + d
        _, hidden = add_norm(x, d, self.norm)
        return hidden, torch.cat([tapped[t] for t in taps], dim=-1) if taps else None

    def decode_step(
        self, lanes: torch.Tensor, positions: torch.Tensor, *, span: int, record: bool
    ) -> DecodeStep:
        """The `DecodeStep` of this model for lanes [B] at positions [B, C]."""
        return DecodeStep.build(lanes, positions, self.rope, self.embed_tokens.weight.dtype, span=span, record=record)

    @torch.no_grad()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [..] int64 -> [.., H] model dtype."""
        return F.embedding(ids, self.embed_tokens.weight)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [.., H] -> [.., V] float32 (lm_head, or the embedding when tied); with `out` (float32, the result's
        shape), written there, the head's output widened by that one copy rather than into a new tensor."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if out is None:
            return linear(hidden, weight, self.exact).float()
        return out.copy_(linear(hidden, weight, self.exact).view(out.shape))


class MTPHead(nn.Module):
    """The checkpoint's multi-token-prediction layer (`mtp.*`): predicts the token after next from the next token's
    embedding and the model's final hidden state, through one gated-attention decoder layer with its own K/V."""

    def __init__(self, config: ModelConfig, *, exact: bool = False) -> None:
        super().__init__()
        self.config = config
        self.exact = exact
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(h, config.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(config, "full_attention")])
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.rope = Rope(config.rotary_dim, config.rope_theta)

    @torch.no_grad()
    def forward(
        self,
        embeds: torch.Tensor,  # [T, H] model dtype: embedding of the token after each row's token
        hidden: torch.Tensor,  # [T, H] model dtype: final-normed hidden state of the row (or previous MTP output)
        positions: torch.Tensor,  # [T] int64
        segments: tuple[Segment, ...],
        kv: AttnState,  # the layer's own K/V (pages and block table; AttnState.contiguous for a per-lane cache)
    ) -> torch.Tensor:
        """-> [T, H]: mtp.norm(layer(fc(cat[norm_e(embeds), norm_h(hidden)]))); the embedding comes first."""
        x = linear(self.inputs(embeds, hidden), self.fc.weight, self.exact)
        step = Step.build(tuple(segments), positions, self.rope, x.dtype, self.exact)
        x = self.layers[0](x, step, kv)
        return self.norm(x)

    @torch.no_grad()
    def decode(
        self,
        tokens: torch.Tensor,  # [B*C] int64: the token after each row's token
        embedding: torch.Tensor,  # [V, H] model dtype: the model's embedding table (the layer shares it)
        hidden: torch.Tensor,  # [B*C, H] model dtype
        step: DecodeStep,  # over the MTP layer's own K/V slots
        kv: AttnState,  # the layer's own K/V (pages and block table)
    ) -> torch.Tensor:
        """`forward` for B lanes x C columns at device positions (static shapes, capturable), the tokens' embedding
        looked up in the norms' launch once they are fused."""
        x, d = cast(DecoderLayer, self.layers[0]).decode(
            linear(self.inputs(embedding, hidden, tokens), self.fc.weight, False), None, step, kv)
        return add_norm(x, d, self.norm)[1]

    def inputs(self, embeds: torch.Tensor, hidden: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """[T, 2H]: cat[norm_e(embeds), norm_h(hidden)], one launch on CUDA once the norms are fused; with `tokens`
        [T], embeds is the embedding table [V, H] and its rows `tokens` are taken (in that launch too)."""
        e, h = self.pre_fc_norm_embedding, self.pre_fc_norm_hidden
        if e.scale is None or h.scale is None:
            return torch.cat([e(embeds if tokens is None else F.embedding(tokens, embeds)), h(hidden)], dim=-1)
        return fused.rms_norm_pair(embeds, hidden, e.scale, h.scale, e.eps, ids=tokens)
