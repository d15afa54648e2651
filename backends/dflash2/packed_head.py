"""The 4-bit proposal head: the target's whole output head as 4-bit codes, read by the 4-bit product.

Owns: building the head for `spec.draft_head = "int4"` from the target's output head (or taking the target's own
where a quantized target already holds it packed), the logits it gives and the candidates it offers. Does not own:
the format and its rounding (ignis.quant.format), the product (ignis.quant.linear) or the walk over the candidates
(.selector).

Unlike the shortlist head every token of the vocabulary can still be proposed. The 4-bit logits (the format's min-max
codes over groups of 128 input columns, 64 where 128 does not divide the hidden size, as `DrafterModel.to_int4` rounds
the drafter's projections) only narrow the vocabulary to RESCORE times the candidates the selector takes; those rows
of the target's own 16-bit head then give the logits the selector sees (`candidates`), so its candidates and their
values are the full head's wherever the 4-bit logits keep the true top ones among their wider set. On the built-in
pair the 4-bit logits alone cost 1-2% of the greedy tokens a round. A round reads the 4-bit head (a quarter of the
16-bit head's bytes) and RESCORE x top-k rows of the 16-bit one. On a GPU that runs the mma kernel the 4-bit copy
is held in its order only: half a byte a weight plus 4 bytes a row and group. Where the target's head is 4-bit
already it is used as it is, and its logits are the target's own. Outside exact mode a call of more than PACKED_ROWS
rows (three lanes' drafts or more) reads the 16-bit head instead, where the 4-bit product is the slower read. The
`mtp` backend's drafts, and slot 1 of a dflash2 drafter trained behind the MTP layer, read it too (`for_spec`, and
ignis.backends.mtp). Drafts only propose: the output stays the target's.
"""

from __future__ import annotations

import torch
from torch import nn

from ignis.backends.dflash2.model import INT4_GROUPS
from ignis.backends.dflash2.selector import fused_on, topk
from ignis.errors import ConfigError
from ignis.model.ops import Weight, linear
from ignis.quant.format import quantize
from ignis.quant.linear import PACKED, QuantLinear, uses_mma

RESCORE = 2  # tokens the 4-bit logits keep for each candidate the selector takes; their 16-bit logits then choose
# Most rows a call reads the 4-bit head for outside exact mode; more (drafts of three lanes or more) read the target's
# 16-bit head, which is held anyway: the 4-bit product ran 2-2.5x its bytes at 16 rows and 3.4-5.5x at 32 on the H200
# (BENCHMARKS.md), so past 16 rows the 16-bit head is the faster read.
PACKED_ROWS = 16
QUANTIZE_ROWS = 16384  # rows of the head quantized at once as it is packed
# spec.draft_head = "auto" takes the 4-bit head for a 16-bit head of at least this many bytes on a GPU that runs the
# mma kernel, outside exact mode, beside a target whose projections are not 4-bit: the 27B's 2.54 GB head (2.4 GiB)
# measured 0.6-0.65 ms off a one-lane drafting round on the H200 with the same candidates; a small head (the
# built-in's 6 MiB) is left as it is, where a 4-bit copy has little to save, and a 4-bit target (chosen to fit a card)
# is not given a copy to hold.
AUTO_BYTES = 1 << 30


def head_group(hidden: int) -> int:
    """The head's group of input columns, as `DrafterModel.to_int4` picks its projections' (the first of INT4_GROUPS
    dividing them); ValueError where none divides `hidden`."""
    for g in INT4_GROUPS:
        if hidden % g == 0:
            return g
    raise ValueError(f"the hidden size {hidden} is not a multiple of {INT4_GROUPS[-1]}: the 4-bit format's groups do "
                     "not divide it")


def auto_int4(vocab: int, hidden: int, element_size: int, *, mma: bool, exact: bool, quantized: bool) -> bool:
    """What spec.draft_head = "auto" resolves to for a target head [vocab, hidden] of `element_size`-byte weights
    (0 where it is packed) beside projections that are 4-bit or not (`quantized`), where the 4-bit product runs the
    mma kernel (`mma`: a GPU with NVRTC, the kernel it was measured with) or not: True for "int4", else "full"."""
    return (mma and not exact and not quantized and element_size == 2 and hidden % INT4_GROUPS[-1] == 0
            and vocab * hidden * element_size >= AUTO_BYTES)


def resolve(choice: str, model: nn.Module, device: torch.device) -> str:
    """spec.draft_head as the backend takes it: "auto" becomes "int4" or "full" (`auto_int4`), others stay."""
    if choice != "auto":
        return choice
    head = target_head(model)
    size = head.element_size() if isinstance(head, torch.Tensor) else 0
    quantized = any(isinstance(m, QuantLinear) for m in model.modules())
    exact = bool(getattr(model, "exact", False))
    mma = isinstance(head, torch.Tensor) and uses_mma(device, head.dtype)
    return "int4" if auto_int4(head.shape[0], head.shape[1], size, mma=mma, exact=exact, quantized=quantized) \
        else "full"


def for_spec(choice: str, model: nn.Module, device: torch.device, *,
             allowed: tuple[str, ...] = ("auto", "full", "shortlist", "int4")) -> tuple[str, PackedHead | None]:
    """spec.draft_head = `choice` resolved (`resolve`), and the 4-bit head it makes: (the settled choice, the head
    where it is "int4", else None). ConfigError where a backend does not take the choice (`allowed`) or the 4-bit
    format does not fit the target's head."""
    if choice not in allowed:
        raise ConfigError("spec.draft_head", f"got {choice!r}; this backend takes {', '.join(map(repr, allowed))}")
    settled = resolve(choice, model, device)
    if settled != "int4":
        return settled, None
    try:
        return settled, PackedHead(target_head(model), exact=bool(getattr(model, "exact", False)))
    except ValueError as e:
        raise ConfigError("spec.draft_head", f"int4 does not fit the target's output head: {e}") from e


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
        self.dense: torch.Tensor | None = None  # [V, H] the target's 16-bit head, for `candidates`
        if isinstance(target_head, PACKED):
            self.weight: Weight = target_head
            return
        if not isinstance(target_head, torch.Tensor):
            raise ValueError(f"the target's output head is {type(target_head).__name__}, neither dense nor 4-bit")
        dense = target_head.detach()
        vocab, hidden = dense.shape
        group = head_group(hidden)
        module = QuantLinear(hidden, vocab, group).to(dense.device)
        # a slice of rows at a time: quantize's float32 temporaries of a whole 27B head would be several GiB
        parts = [quantize(dense[r : r + QUANTIZE_ROWS], group) for r in range(0, vocab, QUANTIZE_ROWS)]
        qweight, scales, qzeros = (torch.cat(t) for t in zip(*parts, strict=True))
        module.qweight, module.scales, module.qzeros = qweight, scales.to(dense.dtype), qzeros
        if uses_mma(dense.device, dense.dtype):
            module.repack(dense.dtype)
        self.module = module
        self.weight = module.weight
        self.dense = dense

    def nbytes(self) -> int:
        """Bytes this head holds of its own (0 where it is the target's)."""
        if self.module is None:
            return 0
        return sum(t.nbytes for t in self.module.buffers())

    def dense_rows(self, hidden: torch.Tensor) -> bool:
        """Whether this call reads the target's 16-bit head: more than PACKED_ROWS rows outside exact mode, where the
        target's head is 16-bit. Exact mode always takes the 4-bit path, so a row's drafts never depend on the rows
        beside it."""
        return self.dense is not None and not self.exact and hidden.numel() > PACKED_ROWS * hidden.shape[-1]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> [..., V] from the 4-bit head (or the 16-bit one, `dense_rows`), in the product's dtype
        (the model's: float32 in exact mode): `candidates` ranks them as they are."""
        if self.dense is not None and self.dense_rows(hidden):
            return linear(hidden, self.dense, self.exact)
        return linear(hidden, self.weight, self.exact)

    def candidates(self, hidden: torch.Tensor, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k best tokens of each row and their logits, largest first, ties to the smaller id (as the selector's
        top-k over a full head's logits): hidden [n, s, H] and this head's `logits` [n, s, V] -> values [n, s, k]
        float32, ids [n, s, k] int64. The RESCORE x k best by the 4-bit logits are scored again by the target's
        16-bit rows, rounded to the model's dtype as the target's head rounds its logits."""
        n, s, vocab = logits.shape
        rows = logits.reshape(n * s, vocab)
        if self.dense is None or self.dense_rows(hidden):  # logits of the head the target itself reads
            values, ids = topk(rows, k)
            return values.float().view(n, s, k), ids.view(n, s, k)
        wide = min(RESCORE * k, vocab)
        if fused_on(rows) and not self.exact:  # the rescoring in two launches: no sort, gather or second top-k
            from ignis.kernels import selector_triton

            values, ids = selector_triton.rescore(hidden.reshape(n * s, -1).to(self.dense.dtype), self.dense,
                                                  topk(rows, wide)[1], k)
            return values.view(n, s, k), ids.view(n, s, k)
        ids = topk(rows, wide)[1].sort(dim=-1).values  # by id, so equal logits keep the smaller id first
        # one product a row against its own rows (bmm: each row's bits are its own whatever rows share the call)
        exact = torch.bmm(self.dense[ids], hidden.reshape(n * s, -1, 1).to(self.dense.dtype))[..., 0]
        values, at = topk(exact.float(), k)
        return values.view(n, s, k), ids.gather(1, at).view(n, s, k)


def target_head(model: nn.Module) -> Weight:
    """The weight `HybridModel.logits` reads: lm_head's, or the embedding's when tied."""
    head = getattr(model, "lm_head", None)
    return model.embed_tokens.weight if head is None else head.weight  # type: ignore[union-attr,return-value]
