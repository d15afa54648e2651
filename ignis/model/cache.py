"""Per-lane state of every layer of the hybrid model, and how a speculative verify keeps only its accepted prefix.

Owns: `LaneCache` (the attention layers' K/V in a page pool, the conv window and fp32 recurrent state of the Gated
DeltaNet layers, and the scratch a record=True segment writes), `GDNState`. Does not own: the pages and the block
table (ignis.model.pool: `AttnState`, `KVPool`), which lane serves which request, how long a lane's sequence is or which
pages it holds (ignis.engine); the math that fills the state (ignis.model.attention, .gdn).

Attention K/V need no rollback: a rejected column's keys sit past the lane's length and are overwritten later. The
recurrent layers do: a record=True segment leaves the lane's state alone and keeps, per column, the state after it
and the raw conv input, so `commit` (one lane, host count) or `commit_lanes` (many lanes, device counts) can pick the
state after the last accepted column.

Every tensor has one lane more than asked for, the scratch lane (index `lanes`): the padding rows of a static decode
bucket and start-up warm-ups point there, so they never touch a request's state (its attention keys go to the pool's
null page). A lane may hold up to `context + max_cols` attention positions: a verify near the end of the context
writes its overhanging columns' keys there, past any position a lane can commit. Without a pool given, every lane's
positions are mapped to pages of their own at construction (`KVPool.full`): code that drives the model directly
needs no page bookkeeping; the engine passes a shared pool whose pages the scheduler hands out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ignis.kernels.gdn import record_width, replay, window
from ignis.model.config import ModelConfig
from ignis.model.pool import AttnState, KVPool

__all__ = ["AttnState", "GDNState", "LaneCache"]


@dataclass
class GDNState:
    conv: torch.Tensor  # [lanes + 1, Kc-1, conv_dim] model dtype, device: the last Kc-1 raw conv inputs
    state: torch.Tensor  # [lanes + 1, Hv, dk, dv] float32, device
    rec_inputs: torch.Tensor | None  # [lanes + 1, max_cols, conv_dim] model dtype, device: raw conv input per column
    rec_kv: torch.Tensor | None  # [lanes + 1, max_cols, Hv, dk + dv + 2] float32, device: each column's k, v, g, beta
    # [lanes + 1, max_cols, Hv, dk, dv] float32, device: state after each column (the host round's record; made on
    # first use, since the device round records columns in rec_kv instead)
    rec_states: torch.Tensor | None = None


class LaneCache:
    """Per-lane state of every layer: K/V for attention layers, conv window + fp32 recurrent state for GDN layers."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        lanes: int,
        context: int,
        max_cols: int,
        device: str | torch.device,
        dtype: torch.dtype,
        pool: KVPool | None = None,
    ) -> None:
        """pool: where the attention layers' K/V go (None: a pool of its own, every lane's positions mapped)."""
        if lanes < 1 or context < 1 or max_cols < 1:
            raise ValueError(f"LaneCache needs lanes, context, max_cols >= 1, got {lanes}, {context}, {max_cols}")
        if pool is None:
            pool = KVPool.full(config, lanes=lanes, positions=context + max_cols, device=device, dtype=dtype)
        elif pool.lanes != lanes or pool.width * pool.page < context + max_cols:
            raise ValueError(f"the pool serves {pool.lanes} lanes of {pool.width * pool.page} positions; this cache "
                             f"needs {lanes} lanes of {context + max_cols}")
        self.pool = pool
        self.config = config
        self.lanes = lanes
        self.scratch = lanes  # the extra lane padding rows and warm-ups write to
        self.context = context
        self.max_cols = max_cols
        self.recorded = [0] * (lanes + 1)  # columns of the pending record=True segment, per lane
        self._conv_taps = torch.arange(1, config.linear_conv_kernel_dim, device=device)  # [Kc-1] int64
        c = config
        kc = c.linear_conv_kernel_dim
        state_shape = (c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
        record = max_cols > 1
        rows = lanes + 1
        # Every GDN layer's tensors are slices of one tensor each, so a commit replays all layers in one launch.
        g = sum(1 for kind in c.layer_types if kind != "full_attention")
        self._conv = torch.zeros(g, rows, kc - 1, c.conv_dim, dtype=dtype, device=device)
        self._state = torch.zeros(g, rows, *state_shape, dtype=torch.float32, device=device)
        self._rec_inputs = torch.zeros(g, rows, max_cols, c.conv_dim, dtype=dtype, device=device) if record else None
        self._rec_kv = torch.zeros(g, rows, max_cols, c.linear_num_value_heads, record_width(
            c.linear_key_head_dim, c.linear_value_head_dim), dtype=torch.float32, device=device) if record else None
        self.layers: list[AttnState | GDNState] = []
        for kind in c.layer_types:
            if kind == "full_attention":
                self.layers.append(pool.layer())
            else:
                j = sum(1 for s in self.layers if isinstance(s, GDNState))
                self.layers.append(GDNState(
                    conv=self._conv[j], state=self._state[j],
                    rec_inputs=self._rec_inputs[j] if self._rec_inputs is not None else None,
                    rec_kv=self._rec_kv[j] if self._rec_kv is not None else None,
                ))

    def reset(self, lane: int) -> None:
        """Zero the lane's recurrent and conv state (a new request starts on it)."""
        self._check_lane(lane)
        for s in self.layers:
            if isinstance(s, GDNState):
                s.conv[lane].zero_()
                s.state[lane].zero_()
        self.recorded[lane] = 0

    def recording(self) -> None:
        """Make the host round's per-column state buffers, if no record=True segment has needed them yet."""
        for s in self.layers:
            if isinstance(s, GDNState) and s.rec_states is None and s.rec_inputs is not None:
                s.rec_states = torch.zeros((s.state.shape[0], self.max_cols, *s.state.shape[1:]), dtype=torch.float32,
                                           device=s.state.device)

    def commit(self, lane: int, cols: int) -> None:
        """After a record=True segment on `lane`: keep the state after its first `cols` columns (1..length)."""
        self._check_lane(lane)
        n = self.recorded[lane]
        if not 1 <= cols <= n:
            raise ValueError(f"commit(lane={lane}, cols={cols}): the lane's last record=True segment had {n} columns")
        for s in self.layers:
            if isinstance(s, GDNState):
                assert s.rec_states is not None and s.rec_inputs is not None
                s.state[lane].copy_(s.rec_states[lane, cols - 1])
                joined = torch.cat([s.conv[lane], s.rec_inputs[lane, :cols]])
                s.conv[lane].copy_(joined[-s.conv.shape[1] :])
        self.recorded[lane] = 0

    def commit_lanes(
        self,
        lanes: torch.Tensor,  # [B] int64, device
        last: torch.Tensor,  # [B] int64, device: index of each lane's last committed column (accepted drafts)
    ) -> None:
        """After a static verify (`DecodeStep.record`): replay each lane's recorded columns 0..last onto its state and
        keep the conv window ending at column `last`. Device tensors only, no host read: capturable."""
        if self._state.shape[0]:  # every GDN layer in one launch each
            assert self._rec_kv is not None and self._rec_inputs is not None
            replay(self._state, lanes, self._rec_kv, last)
            window(self._conv, self._rec_inputs, lanes, last, self._conv_taps)

    def lane_state(self, lane: int, upto: int) -> dict[str, torch.Tensor]:
        """Copies of everything the target's layers carry for the lane's positions 0..upto-1, by name (for inspection
        and tests)."""
        return {name: t.clone() for name, t in self.lane_read(lane, upto).items() if name.startswith("layers.")}

    def lane_read(self, lane: int, upto: int) -> dict[str, torch.Tensor]:
        """Everything the lane carries for positions 0..upto-1, by name: copies of the K/V of those positions (read
        through its pages, in this cache's layers and the pool's others: a backend's, as mtp's), and views of the
        recurrent state and conv window after position upto-1 (valid only when the lane has run exactly that far).
        `lane_write` puts them back (retained slots, ignis.engine.lane_store)."""
        out: dict[str, torch.Tensor] = {}
        for i, s in enumerate(self.layers):
            if isinstance(s, AttnState):
                out[f"layers.{i}.k"], out[f"layers.{i}.v"] = s.read(lane, upto)
            else:
                out[f"layers.{i}.conv"] = s.conv[lane]
                out[f"layers.{i}.state"] = s.state[lane]
        for j, s in enumerate(self._others()):
            out[f"pool.{j}.k"], out[f"pool.{j}.v"] = s.read(lane, upto)
        return out

    def lane_write(self, lane: int, upto: int, saved: dict[str, torch.Tensor]) -> None:
        """Restore what `lane_read` gave (or host copies of it) into `lane`, whose pages must cover 0..upto-1. On a
        GPU the copies are asynchronous from pinned memory, ordered on the current stream."""
        pinned = self.pool.table.is_cuda
        named = [(f"layers.{i}", s) for i, s in enumerate(self.layers)] + [
            (f"pool.{j}", s) for j, s in enumerate(self._others())]
        for name, s in named:
            if isinstance(s, AttnState):
                k, v = (saved[f"{name}.{n}"].to(s.k.device, non_blocking=pinned) for n in "kv")
                s.write(lane, 0, k, v)
            else:
                s.conv[lane].copy_(saved[f"{name}.conv"], non_blocking=pinned)
                s.state[lane].copy_(saved[f"{name}.state"], non_blocking=pinned)

    def state_bytes(self, upto: int) -> int:
        """Bytes `lane_read(lane, upto)` gives."""
        total = 0
        for s in [*self.layers, *self._others()]:
            if isinstance(s, AttnState):
                total += 2 * upto * s.k.shape[2] * s.k.shape[3] * s.k.element_size()
            else:
                total += s.conv[0].nbytes + s.state[0].nbytes
        return total

    def _others(self) -> list[AttnState]:
        """The pool's layers that are not this cache's (a backend's)."""
        return [s for s in self.pool.layers if not any(s is t for t in self.layers)]

    def nbytes(self) -> int:
        """Device bytes of the lanes' caches: the recurrent states and verify records, and the whole K/V pool."""
        total = self.pool.nbytes()
        for s in self.layers:
            if isinstance(s, GDNState):
                parts = (s.conv, s.state, s.rec_inputs, s.rec_kv, s.rec_states)
                total += sum(t.numel() * t.element_size() for t in parts if t is not None)
        return total

    def check_segment(self, lane: int, start: int, length: int, record: bool) -> None:
        """Refuse a segment the cache cannot hold, before any layer writes."""
        self._check_lane(lane)
        if start < 0 or length < 1 or start + length > self.context:
            raise ValueError(f"segment of lane {lane} at {start}..{start + length - 1} exceeds context {self.context}")
        if lane != self.scratch and start + length > self.pool.held(lane) * self.pool.page:
            raise ValueError(f"segment of lane {lane} at {start}..{start + length - 1} reaches past the "
                             f"{self.pool.held(lane)} pages it holds")
        if record and length > self.max_cols:
            raise ValueError(f"record=True segment of {length} columns exceeds max_cols={self.max_cols}")

    def _check_lane(self, lane: int) -> None:
        if not 0 <= lane <= self.scratch:
            raise ValueError(f"lane {lane} out of range 0..{self.lanes - 1} (or the scratch lane {self.scratch})")
