"""The Gated DeltaNet layer (Qwen3.5's `linear_attn`): projections, short conv, gates, delta rule, gated norm.

Owns: `GatedDeltaNet` and the choice, per segment, between the recurrent form (record=True or one row: decode and
verify share it, so their bits agree) and the chunked form (prefill; fla's kernel on CUDA when installed, a step's
segments on distinct lanes packed into one call); and `decode`, the recurrent form over B lanes x C columns with
device lane ids (static shapes, capturable; a long one-lane piece that records nothing, as the device prefill runs,
takes fla's chunked form there too). Does not own: the state tensors (ignis.model.cache) or the rule's arithmetic
(ignis.model.delta_rule).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ignis.kernels import fused
from ignis.kernels import gdn as gdn_kernels
from ignis.model import delta_rule
from ignis.model.batch import Segment
from ignis.model.cache import GDNState
from ignis.model.config import ModelConfig
from ignis.model.decode import DecodeStep
from ignis.model.ops import (
    Step,
    Weight,
    fuse_weights,
    gate_linear,
    gated_rms_norm,
    l2norm,
    linear,
    sigmoid,
    silu,
    softplus,
)

# Columns from which a one-lane piece that records nothing (a device prefill piece) runs fla's chunked form on CUDA,
# where fla is installed and passes its check: the recurrent kernel loops over columns one after another, the chunked
# form is matrix products over 64-column chunks. 0: never (tools.bench_prefill compares the two).
CHUNKED_COLUMNS = 64


def prefill_kernels(layer: GatedDeltaNet, exact: bool, x: torch.Tensor) -> tuple[object | None, bool]:
    """fla's chunk kernel for prefill segments where it runs (CUDA, not the exact mode) and passed its check
    (ignis.model.delta_rule.fla_chunk), and whether it also packs several into one call; None: the torch chunked
    form."""
    if exact or x.device.type != "cuda":
        return None, False
    shape = (layer.hk, layer.hv, layer.dk, layer.dv, x.dtype, x.device)
    return delta_rule.fla_chunk(*shape), delta_rule.fla_varlen(*shape) is not None


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.hk, self.hv = c.linear_num_key_heads, c.linear_num_value_heads
        self.dk, self.dv = c.linear_key_head_dim, c.linear_value_head_dim
        self.key_dim, self.value_dim = c.key_dim, c.value_dim
        self.eps = c.rms_norm_eps
        # Channel order of the conv and of in_proj_qkv: [q (key_dim) | k (key_dim) | v (value_dim)].
        self.in_proj_qkv = nn.Linear(c.hidden_size, c.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(c.hidden_size, c.value_dim, bias=False)
        self.in_proj_b = nn.Linear(c.hidden_size, c.linear_num_value_heads, bias=False)
        self.in_proj_a = nn.Linear(c.hidden_size, c.linear_num_value_heads, bias=False)
        self.conv1d = nn.Conv1d(
            c.conv_dim, c.conv_dim, c.linear_conv_kernel_dim, groups=c.conv_dim, bias=False
        )  # weight [conv_dim, 1, Kc]; only the weight is used
        self.dt_bias = nn.Parameter(torch.ones(c.linear_num_value_heads))
        self.A_log = nn.Parameter(torch.zeros(c.linear_num_value_heads))
        self.norm = _GatedNormWeight(c.linear_value_head_dim)
        self.out_proj = nn.Linear(c.value_dim, c.hidden_size, bias=False)
        # [conv_dim + value_dim + 2 Hv, H]: qkv | z | b | a, once fused. Where qkv and z are 4-bit packed or fp8 and the
        # gates keep their precision, two instead: qkv | z in the quantized form and b | a dense.
        self.in_proj: Weight | None = None
        self.in_proj_qkvz: Weight | None = None
        self.in_proj_ba: Weight | None = None
        self.decay_rate: torch.Tensor | None = None  # [Hv] float32: -exp(A_log), once fused
        self.conv_weight: torch.Tensor | None = None  # [conv_dim, Kc] float32, once fused

    def fuse(self) -> None:
        self.in_proj = fuse_weights(self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        if self.in_proj is None:
            self.in_proj_qkvz = fuse_weights(self.in_proj_qkv, self.in_proj_z)
            self.in_proj_ba = fuse_weights(self.in_proj_b, self.in_proj_a)
        self.decay_rate = -torch.exp(self.A_log.detach().float())
        self.conv_weight = self.conv1d.weight.detach()[:, 0, :].float()

    def forward(self, x: torch.Tensor, step: Step, cache: GDNState) -> torch.Tensor:
        """x [T, H] (normed) -> [T, H]; advances (or, for record=True segments, records) each lane's state."""
        ex = step.exact
        t = x.shape[0]
        qkv = linear(x, self.in_proj_qkv.weight, ex)  # [T, conv_dim] raw conv input
        z = linear(x, self.in_proj_z.weight, ex).view(t, self.hv, self.dv)
        beta = sigmoid(linear(x, self.in_proj_b.weight, ex).float(), ex)  # [T, Hv] f32
        a = linear(x, self.in_proj_a.weight, ex).float()
        g = -torch.exp(self.A_log.float()) * softplus(a + self.dt_bias.float(), ex)  # [T, Hv] f32, log-decay <= 0
        weight = self.conv1d.weight[:, 0, :]  # [conv_dim, Kc]
        out = torch.empty(t, self.hv, self.dv, dtype=torch.float32, device=x.device)

        for grp in step.recurrent:
            raw = qkv[grp.rows]  # [n, L, C]
            window = cache.conv[grp.lanes]  # [n, Kc-1, C]
            mixed = silu(delta_rule.short_conv(window, raw, weight), ex)
            if grp.record:
                assert cache.rec_inputs is not None and cache.rec_states is not None
                cache.rec_inputs[grp.lanes, : raw.shape[1]] = raw
            else:
                cache.conv[grp.lanes] = torch.cat([window, raw], dim=1)[:, -window.shape[1] :]
            q, k, v = self._heads(mixed)
            state = cache.state[grp.lanes]
            for j in range(raw.shape[1]):
                col = grp.rows[:, j]
                state, out[col] = delta_rule.recurrent_step(state, q[:, j], k[:, j], v[:, j], g[col], beta[col])
                if cache.rec_states is not None and grp.record:
                    cache.rec_states[grp.lanes, j] = state
            if not grp.record:
                cache.state[grp.lanes] = state

        fla, packed = prefill_kernels(self, ex, x) if step.chunked else (None, False)
        if fla is not None:
            lanes = [seg.lane for seg in step.chunked]
            # one call for all segments where fla packs them (each lane once), else one a segment
            runs = [step.chunked] if packed and len(set(lanes)) == len(lanes) else [(seg,) for seg in step.chunked]
            for run in runs:
                self._fla(fla, qkv, run, weight, g, beta, cache, out)
        else:
            for seg in step.chunked:
                rows = slice(seg.offset, seg.offset + seg.length)
                q, k, v = self._heads(self._conv(qkv, seg, weight, cache, ex)[None])
                state, out[rows] = delta_rule.chunked(cache.state[seg.lane], q[0], k[0], v[0], g[rows], beta[rows])
                cache.state[seg.lane] = state

        y = gated_rms_norm(out.to(x.dtype), z, self.norm.weight, self.eps, ex)
        return linear(y.reshape(t, self.value_dim), self.out_proj.weight, ex)

    def decode(self, x: torch.Tensor, step: DecodeStep, cache: GDNState) -> torch.Tensor:
        """x [B*C, H] (normed) -> [B*C, H]. One column (decode) advances each lane's state in place; C columns
        (verify, step.record) leave it alone and record each column (its raw conv input, and k, v, g, beta) for
        `LaneCache.commit_lanes`. The recurrence is one kernel launch on CUDA (ignis.kernels.gdn)."""
        b, c = step.positions.shape
        t, lanes = b * c, step.lanes
        if self.in_proj is not None:
            qkv, z, ba = torch.split(linear(x, self.in_proj, False), [self.key_dim * 2 + self.value_dim, self.value_dim,
                                                                 2 * self.hv], dim=-1)
        elif self.in_proj_qkvz is not None and self.in_proj_ba is not None:
            gates = self.in_proj_ba
            assert isinstance(gates, torch.Tensor)  # the gates keep their precision
            qkv, z = torch.split(linear(x, self.in_proj_qkvz, False), [self.key_dim * 2 + self.value_dim,
                                                                      self.value_dim], dim=-1)
            ba = gate_linear(x, gates)
        else:
            qkv, z = linear(x, self.in_proj_qkv.weight, False), linear(x, self.in_proj_z.weight, False)
            ba = torch.cat([F.linear(x, self.in_proj_b.weight), F.linear(x, self.in_proj_a.weight)], dim=-1)
        qkv = qkv.reshape(b, c, -1)  # [B, C, conv_dim] raw conv input
        rate = self.decay_rate if self.decay_rate is not None else -torch.exp(self.A_log.float())
        weight = self.conv_weight if self.conv_weight is not None else self.conv1d.weight[:, 0, :].float()
        # silu(conv) as float32 and the raw beta and decay projections as float32 (the recurrence applies the gates)
        record = None
        if step.record:
            assert cache.rec_inputs is not None
            record = cache.rec_inputs[:, :c]
        ba = ba.reshape(b, c, 2 * self.hv)
        fla = None
        if not step.record and b == 1 and c >= CHUNKED_COLUMNS > 0 and x.is_cuda:  # a long prefill piece
            fla = delta_rule.fla_chunk(self.hk, self.hv, self.dk, self.dv, x.dtype, x.device)
        if fla is not None:
            mixed, ba = fused.conv(cache.conv, lanes, qkv, weight, ba, record, key_heads=self.hk,
                                   dk=self.dk)  # q and k come out l2-normalised
            out = self._fla_piece(fla, mixed, ba, rate, cache, lanes, x.dtype)
            y = fused.gated_norm(out.view(t, self.hv, self.dv), z, self.norm.weight, self.eps)
        else:
            # The conv, the recurrence and the gated output norm (ops.gated_rms_norm: norm in fp32, cast, weight, then
            # the gate in fp32): one to three launches, as ignis.kernels.gdn's switches route them.
            y = gdn_kernels.conv_columns_normed(cache.conv, qkv, weight, ba, record, cache.state, lanes,
                                                self.dt_bias.float(), rate, cache.rec_kv if step.record else None, z,
                                                self.norm.weight, self.eps, key_heads=self.hk,
                                                write_state=not step.record)
        return linear(y, self.out_proj.weight, False)

    def _fla_piece(self, fla: object, mixed: torch.Tensor, ba: torch.Tensor, rate: torch.Tensor, cache: GDNState,
                   lanes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A prefill piece's recurrence in fla's chunked form: matrix products over chunks of 64 columns instead of
        a loop over the columns. mixed [1, C, conv_dim] f32 (q and k l2-normalised, q scaled, as the fused conv
        leaves them); ba [1, C, 2 Hv] f32 raw; lanes [1] int64, device. Advances the lane's state; returns out
        [1, C, Hv, dv] float32. Static shapes and no host sync: capturable like the rest of a piece."""
        c = mixed.shape[1]
        g, beta = gdn_kernels.gates(ba, self.dt_bias.float(), rate)  # [1, C, Hv] float32
        q, k, v = torch.split(mixed.to(dtype), [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        o, state = fla(  # type: ignore[operator]
            q.reshape(1, c, self.hk, self.dk),
            k.reshape(1, c, self.hk, self.dk),
            v.reshape(1, c, self.hv, self.dv),
            g=g,
            beta=beta.to(dtype),
            scale=1.0,
            initial_state=cache.state.index_select(0, lanes),
            output_final_state=True,
            use_qk_l2norm_in_kernel=False,
        )
        cache.state.index_copy_(0, lanes, state.float())
        return o.float()

    def _fla(self, fla: object, qkv: torch.Tensor, segs: tuple[Segment, ...], weight: torch.Tensor,
             g: torch.Tensor, beta: torch.Tensor, cache: GDNState, out: torch.Tensor) -> None:
        """Prefill segments (on distinct lanes) through one call of fla's chunk kernel, which does the l2 norms, the
        scale and the key-head pairing itself; several are packed with cu_seqlens, each from its lane's state. qkv
        [T, conv_dim] model dtype; g, beta [T, Hv] f32; fills out [T, Hv, dv] f32 at the segments' rows and advances
        their lanes' states and conv windows."""
        dev, dtype = qkv.device, qkv.dtype
        rows = torch.cat([torch.arange(seg.offset, seg.offset + seg.length) for seg in segs]).to(dev)
        lanes = torch.tensor([seg.lane for seg in segs], device=dev)
        mixed = torch.cat([self._conv(qkv, seg, weight, cache, False).to(dtype) for seg in segs])
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        length = q.shape[0]
        ends = torch.tensor([0, *[seg.length for seg in segs]]).cumsum(0).to(dev)
        packed = {} if len(segs) == 1 else {"cu_seqlens": ends}
        o, state = fla(  # type: ignore[operator]
            q.reshape(1, length, self.hk, self.dk),
            k.reshape(1, length, self.hk, self.dk),
            v.reshape(1, length, self.hv, self.dv),
            g=g[rows][None],
            beta=beta[rows][None].to(dtype),
            scale=self.dk**-0.5,
            initial_state=cache.state.index_select(0, lanes),
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            **packed,
        )
        cache.state.index_copy_(0, lanes, state.float())
        out[rows] = o[0].float()

    def _conv(self, qkv: torch.Tensor, seg: Segment, weight: torch.Tensor, cache: GDNState,
              exact: bool) -> torch.Tensor:
        """silu(short conv) of a prefill segment's rows of qkv over its lane's window, [L, conv_dim] f32, and the
        window moved on past them."""
        raw = qkv[seg.offset : seg.offset + seg.length][None]
        window = cache.conv[seg.lane][None]
        mixed = silu(delta_rule.short_conv(window, raw, weight), exact)[0]
        cache.conv[seg.lane] = torch.cat([window[0], raw[0]])[-window.shape[1] :]
        return mixed

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """mixed [n, L, conv_dim] f32 -> q, k [n, L, Hv, dk] (l2-normed, q scaled, repeated to value heads), v."""
        n, length = mixed.shape[:2]
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2norm(q.reshape(n, length, self.hk, self.dk)) * self.dk**-0.5
        k = l2norm(k.reshape(n, length, self.hk, self.dk))
        r = self.hv // self.hk
        if r > 1:
            q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
        return q, k, v.reshape(n, length, self.hv, self.dv)


class _GatedNormWeight(nn.Module):
    """Holds the GDN output norm's weight (`norm.weight`, plain w, init 1); the math is ops.gated_rms_norm."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
