"""The drafter's per-lane context: every layer's K/V of committed tokens, each computed once when observed.

Owns: `ContextCache` (per layer K, V and the position held by each slot), writing committed rows (host lists, or
device tensors for a captured round), and handing a batch of lanes their slots with the visibility mask. Does not own: the projections that produce K/V
(.model.DrafterModel.context_kv) or the attention itself.

Full-attention layers keep every position (slot = position). Sliding layers keep a ring of window - 1 slots
(slot = position mod size): the block's anchor row at position s sees context down to s - window + 1 and no row
of the block reaches further back, so nothing older is ever visible. Each slot records the position it holds and
the mask is built from those positions, so a ring gives exactly what recomputing the window from scratch gives.
Every tensor holds one lane more than asked for, the scratch lane (index `lanes`), where a device round sends the
rows a lane did not keep.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ignis.backends.dflash2.config import DrafterConfig
from ignis.backends.dflash2.model import block_mask


@dataclass
class LayerContext:
    k: torch.Tensor  # [lanes + 1, size, nkv, hd] model dtype, device: normed, rotated keys
    v: torch.Tensor  # [lanes + 1, size, nkv, hd] model dtype, device
    pos: torch.Tensor  # [lanes + 1, size] int64, device: position held by each slot, -1 if none

    @property
    def size(self) -> int:
        return self.pos.shape[1]


class ContextCache:
    def __init__(self, cfg: DrafterConfig, *, lanes: int, context: int, device: torch.device, dtype: torch.dtype) -> None:
        self.cfg = cfg
        self.scratch = lanes
        self.layers: list[LayerContext] = []
        for kind in cfg.layer_types:
            size = context
            if kind == "sliding_attention":
                assert cfg.sliding_window is not None
                size = max(1, min(context, cfg.sliding_window - 1))
            shape = (lanes + 1, size, cfg.num_kv_heads, cfg.head_dim)
            self.layers.append(LayerContext(
                k=torch.zeros(shape, dtype=dtype, device=device),
                v=torch.zeros(shape, dtype=dtype, device=device),
                pos=torch.full((lanes + 1, size), -1, dtype=torch.long, device=device),
            ))
        self.keep = max(layer.size for layer in self.layers)  # rows of one lane any layer can still use
        self.ring = min(layer.size for layer in self.layers)  # rows one device write may carry a lane (no slot twice)

    def nbytes(self) -> int:
        return sum(t.nbytes for layer in self.layers for t in (layer.k, layer.v, layer.pos))

    def rings(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per layer (K, V, positions held): what the ring kernels read and write in place."""
        return [(layer.k, layer.v, layer.pos) for layer in self.layers]

    def reset(self, lane: int) -> None:
        for layer in self.layers:
            layer.pos[lane] = -1

    def lane_views(self, lane: int, length: int) -> dict[str, torch.Tensor]:
        """Views of the lane's slots after positions 0..length-1: a full-attention layer's first `length`, a sliding
        layer's whole ring (with the position each slot holds)."""
        out: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            used = min(length, layer.size)
            out[f"layers.{i}.k"] = layer.k[lane, :used]
            out[f"layers.{i}.v"] = layer.v[lane, :used]
            out[f"layers.{i}.pos"] = layer.pos[lane]
        return out

    def write(
        self,
        lanes: list[int],
        starts: list[int],
        counts: list[int],  # rows per lane, in the order of `kv`'s rows
        kv: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (K, V) [T, nkv, hd] for those rows
        device: torch.device,
    ) -> None:
        """Store rows start..start+count-1 of each lane (T = sum(counts)); rows a layer can never show are skipped."""
        for layer, (k, v) in zip(self.layers, kv):
            rows: list[int] = []
            lane_ix: list[int] = []
            positions: list[int] = []
            offset = 0
            for lane, start, n in zip(lanes, starts, counts):
                first = max(start, start + n - layer.size)
                rows.extend(range(offset + first - start, offset + n))
                positions.extend(range(first, start + n))
                lane_ix.extend([lane] * (start + n - first))
                offset += n
            slots = [p % layer.size for p in positions]
            r = torch.tensor(rows, dtype=torch.long, device=device)
            where = (torch.tensor(lane_ix, dtype=torch.long, device=device),
                     torch.tensor(slots, dtype=torch.long, device=device))
            layer.k.index_put_(where, k.index_select(0, r))
            layer.v.index_put_(where, v.index_select(0, r))
            layer.pos.index_put_(where, torch.tensor(positions, dtype=torch.long, device=device))

    def write_rows(
        self,
        lane_ix: torch.Tensor,  # [T] int64, device: lane of each row (the scratch lane for rows not kept)
        positions: torch.Tensor,  # [T] int64, device
        kv: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (K, V) [T, nkv, hd]
    ) -> None:
        """Device form of `write`: every row goes to its lane's slot; no host value is read."""
        for layer, (k, v) in zip(self.layers, kv):
            where = (lane_ix, positions % layer.size)
            layer.k.index_put_(where, k)
            layer.v.index_put_(where, v)
            layer.pos.index_put_(where, positions)

    def gather(
        self,
        lane_ix: torch.Tensor,  # [n] int64, device
        q_pos: torch.Tensor,  # [n, B] int64, device: block row positions
        span: int,  # every lane has committed fewer than `span` rows (a host bound: no device read)
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
        """Per layer the lanes' (K, V) [n, used, nkv, hd] and the block mask [n, B, used + B]."""
        kv, masks = [], []
        shared: dict[tuple[int, str, bool], torch.Tensor] = {}  # layers of one kind and size share their slots' mask
        for i, layer in enumerate(self.layers):
            used = max(1, min(layer.size, span))  # slots past the longest lane's length hold nothing yet
            kv.append((layer.k[lane_ix, :used], layer.v[lane_ix, :used]))
            key = (used, self.cfg.layer_types[i], self.cfg.causal[i])
            if key not in shared:
                shared[key] = block_mask(self.cfg, i, layer.pos[lane_ix, :used], q_pos)
            masks.append(shared[key])
        return kv, masks
