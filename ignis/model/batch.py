"""What one target forward is asked to do: packed rows from several lanes, and what it gives back.

Owns: `Segment`, `Batch`, `ForwardOut`. Does not own: which lanes are scheduled (ignis.engine) or the layer math
(ignis.model.model). A batch packs each lane's rows contiguously; linear layers see all rows at once, attention and
the recurrent layers see one segment at a time against that lane's cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Segment:
    """Rows [offset, offset+length) of the batch belong to `lane`, at absolute positions start..start+length-1.

    prefill=True (prompt rows): recurrent layers use the chunked form, chunk by chunk from the segment's start (the
    scheduler starts prefill segments at multiples of 64), so a prompt's bits never depend on how it was split.
    prefill=False (decode and verify rows): the per-token recurrent form, identical for one row or K+1.
    record=False: recurrent layers advance the lane's state in place.
    record=True (speculative verify of [anchor, d1..dK]): recurrent layers leave the lane's state untouched and keep
    the state after every column in scratch; `LaneCache.commit(lane, cols)` later keeps the first `cols` columns.
    Attention layers write keys/values of every row at their positions either way (rejected columns are simply
    overwritten later, since the lane's length never advanced past them).
    """

    lane: int
    offset: int
    start: int
    length: int
    record: bool = False
    prefill: bool = False


@dataclass
class Batch:
    tokens: torch.Tensor  # [T] int64, device
    positions: torch.Tensor  # [T] int64, device
    segments: tuple[Segment, ...]
    logit_rows: torch.Tensor  # [R] int64, device: rows whose next-token logits are wanted


@dataclass
class ForwardOut:
    hidden: torch.Tensor  # [T, H] model dtype: final-normed hidden state of every row
    logits: torch.Tensor  # [R, V] float32: logits of `Batch.logit_rows`
    taps: torch.Tensor | None  # [T, len(taps) * H] model dtype: outputs of the tapped layers, in the order asked
