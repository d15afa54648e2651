"""The 4-bit proposal head: the target's whole output head as 4-bit codes, read by the 4-bit product.

Owns: building the head for `spec.draft_head = "int4"` from the target's output head (or taking the target's own
where a quantized target already holds it packed) and the logits it gives. Does not own: the format and its
rounding (ignis.quant.format), the product (ignis.quant.linear) or what the drafter does with the logits (.selector).

Unlike the shortlist head every token of the vocabulary can still be proposed; only the rows' values round, to the
format's min-max codes over groups of 128 input columns (64 where 128 does not divide the hidden size), as
`DrafterModel.to_int4` rounds the drafter's projections. On a GPU that runs the mma kernel the head is held in its
order only, so it costs half a byte a weight plus 4 bytes a row and group; the drafter reads it each round instead of
the target's 16-bit head. Drafts only propose: the output stays the target's.
"""

from __future__ import annotations

import torch
from torch import nn

from ignis.model.ops import Weight, linear
from ignis.quant.format import quantize
from ignis.quant.linear import MmaCodes, PackedWeight, QuantLinear, uses_mma

GROUPS = (128, 64)  # the first that divides the hidden size


def head_group(hidden: int) -> int:
    """The head's group of input columns; ValueError where none of GROUPS divides `hidden`."""
    for g in GROUPS:
        if hidden % g == 0:
            return g
    raise ValueError(f"the hidden size {hidden} is not a multiple of {GROUPS[-1]}: the 4-bit format's groups do not "
                     "divide it")


def held_bytes(vocab: int, hidden: int, mma: bool, dtype_size: int) -> int:
    """What the packed head holds: half a byte a weight, and a group's scale and zero point (4 bytes a row and group
    in the mma kernel's order, else a scale in the model's dtype and a byte)."""
    group = head_group(hidden)
    return vocab * hidden // 2 + vocab * (hidden // group) * (4 if mma else dtype_size + 1)


class PackedHead:
    """logits(hidden) over the whole vocabulary through a 4-bit copy of the target's output head."""

    def __init__(self, target_head: Weight, *, exact: bool) -> None:
        """target_head: the target's output head as `HybridModel.logits` reads it ([V, H] dense, or already packed:
        then it is used as it is, no copy)."""
        self.exact = exact
        self.module: QuantLinear | None = None
        if isinstance(target_head, (PackedWeight, MmaCodes)):
            self.weight: Weight = target_head
            return
        if not isinstance(target_head, torch.Tensor):
            raise ValueError(f"the target's output head is {type(target_head).__name__}, neither dense nor 4-bit")
        dense = target_head.detach()
        vocab, hidden = dense.shape
        group = head_group(hidden)
        module = QuantLinear(hidden, vocab, group).to(dense.device)
        qweight, scales, qzeros = quantize(dense, group)
        module.qweight, module.scales, module.qzeros = qweight, scales.to(dense.dtype), qzeros
        if uses_mma(dense.device, dense.dtype):
            module.repack(dense.dtype)
        self.module = module
        self.weight = module.weight

    def nbytes(self) -> int:
        """Bytes this head holds of its own (0 where it is the target's)."""
        if self.module is None:
            return 0
        return sum(t.nbytes for t in self.module.buffers())

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> [..., V] float32."""
        return linear(hidden, self.weight, self.exact).float()


def target_head(model: nn.Module) -> Weight:
    """The weight `HybridModel.logits` reads: lm_head's, or the embedding's when tied."""
    head = getattr(model, "lm_head", None)
    return model.embed_tokens.weight if head is None else head.weight  # type: ignore[union-attr,return-value]
