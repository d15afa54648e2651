"""What a static decode/verify forward needs: B lanes x C columns at device positions, one shape per bucket.

Owns: `DecodeStep` (lane ids, positions, RoPE tables and the key span of one decode or verify forward). Does not own
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
    span: int  # key slots each lane's rows may read: column c of lane b sees slots 0..positions[b, c] of them
    record: bool  # C > 1 (verify): GDN layers keep the state after every column and leave the lane's state alone

    @property
    def rows(self) -> int:
        return self.positions.numel()

    @property
    def cols(self) -> int:
        return self.positions.shape[1]

    @staticmethod
    def build(
        lanes: torch.Tensor,  # [B] int64, device
        positions: torch.Tensor,  # [B, C] int64, device
        rope: Rope,
        dtype: torch.dtype,
        *,
        span: int,
        record: bool,
    ) -> DecodeStep:
        """`span`: key slots each lane reads. No mask is built: the attention kernels read positions, and only the
        reference makes one (ignis.kernels.attention.visibility)."""
        cos, sin = rope.tables(positions.reshape(-1), dtype)
        return DecodeStep(lanes, positions, cos, sin, span, record)
