"""What a static decode/verify forward needs: B lanes x C columns at device positions, one shape per bucket.

Owns: `DecodeStep` (lane ids, positions, RoPE tables and the key mask of one decode or verify forward). Does not own
the layer math (ignis.model.attention / .gdn `decode` methods) or which lanes run (ignis.engine).

Unlike `Step` (packed segments described on the host), nothing here depends on a host value but the shapes: B, C and
the key span are fixed per bucket, lane ids and positions are device tensors. The same forward therefore runs eagerly
or replays as a CUDA graph, and padding rows of a bucket point at the cache's scratch lane, so they never touch a real
lane's state. Attention reads key slots 0..span-1 of each lane and masks those past each column's position, so a lane
of any length up to span - C gives the same result whatever the span.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ignis.model.ops import Rope


@dataclass(frozen=True)
class DecodeStep:
    lanes: torch.Tensor  # [B] int64, device: cache lane of each row block (padding: the scratch lane)
    positions: torch.Tensor  # [B, C] int64, device: absolute position of every column
    cos: torch.Tensor  # [B*C, rotary_dim] model dtype, device
    sin: torch.Tensor  # [B*C, rotary_dim] model dtype, device
    mask: torch.Tensor  # [B, 1, group*C, span] bool, device: key slot visible to query (heads of a KV group x cols)
    record: bool  # C > 1 (verify): GDN layers keep the state after every column and leave the lane's state alone

    @property
    def rows(self) -> int:
        return self.positions.numel()

    @property
    def cols(self) -> int:
        return self.positions.shape[1]

    @property
    def span(self) -> int:
        return self.mask.shape[-1]

    @staticmethod
    def build(
        lanes: torch.Tensor,  # [B] int64, device
        positions: torch.Tensor,  # [B, C] int64, device
        rope: Rope,
        dtype: torch.dtype,
        *,
        span: int,
        group: int,
        record: bool,
    ) -> DecodeStep:
        """`group`: query heads per KV head of the attention layers; `span`: key slots each lane reads."""
        b, c = positions.shape
        cos, sin = rope.tables(positions.reshape(-1), dtype)
        slots = torch.arange(span, device=positions.device)
        visible = slots[None, None, :] <= positions[:, :, None]  # [B, C, span]
        mask = visible[:, None, None].expand(b, 1, group, c, span).reshape(b, 1, group * c, span)
        return DecodeStep(lanes, positions, cos, sin, mask, record)
