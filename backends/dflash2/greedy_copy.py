"""spec.draft_weights = "int4-greedy": a 4-bit copy of the drafter's layers for the rounds whose drafts cannot change
what the round outputs (docs/adr/0014-greedy-drafter-copy.md).

Owns: `packed_copy` (a DrafterModel that shares every tensor of the drafter but its layers' attention and MLP
projections, which it holds as 4-bit codes), when a round reads it (`reads_copy`: every lane greedy, at most GREEDY_ROWS
block rows), what "auto" resolves to apart from memory (`auto_copy`, `resolve`) and what the copy holds (`copy_bytes`,
for the memory plan). Does not own: whether a round is greedy (Choice.greedy_round, set by the round), whether the
memory spares the copy (ignis.engine.defaults.settle_draft_weights, ignis.plan.memory_plan), the 4-bit format or its
products (ignis.quant, ignis.model.ops.linear).

Why it is exact: a greedy round emits the target's argmax whatever the drafts are, so drafting it with a cheaper copy
changes only how many drafts are kept. A round with a sampled lane drafts with the drafter as it is (the drafts
steer which tokens a seeded request draws), so a request samples the same tokens alone and beside others. The
context's K/V (fc, every layer's k and v) are always written by the drafter as it is: what a lane's context holds does
not depend on which rounds it took part in.

Why it pays: one lane's block is 8 rows, where the drafter's round is its bytes (the 27B's layers read 3.2 GB of
16-bit projections a round, 0.85 GB in 4 bits) and the 4-bit product at 8-16 rows takes about half a 16-bit
product's time; at more rows it is no faster (BENCHMARKS.md), so larger rounds keep the 16-bit layers, and the copy
costs memory (0.79 GiB at the 27B shape) rather than any round's time.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ignis.backends.dflash2.model import INT4_GROUPS, DrafterModel, int4_layout, layer_projection

# Most block rows (lanes x (drafts + 1)) a greedy round drafts with the copy: two lanes of 7 drafts. The 4-bit product
# ran 2-2.5x its bytes at 16 rows on the H200 (half a 16-bit product's time) and 3.4-5.5x at 32 (no faster).
GREEDY_ROWS = 16
# "auto" holds the copy for 16-bit layer projections of at least this many bytes on a GPU that runs the 4-bit mma
# kernel, outside exact mode: the 27B's random 5-layer drafter (3.2 GB) measured its one-lane rounds 0.6-0.7 ms shorter
# with 4-bit layers on the H200 beside a 16-bit target and 0.56 ms (6.6%) beside a 4-bit one; a small drafter (the
# built-in's) is left as it is. The engine keeps the copy only where the K/V pool loses no memory to it
# (ignis.engine.defaults, ignis.plan.memory_plan): a card filled to hold its target's contexts gets none.
AUTO_BYTES = 1 << 30


def auto_copy(projection_bytes: int, element_size: int, *, mma: bool, exact: bool) -> bool:
    """spec.draft_weights = "auto"'s rule apart from memory, for layer projections of `projection_bytes` held in
    `element_size`-byte weights where the 4-bit product runs the mma kernel (`mma`) or not: True for "int4-greedy",
    else "model"."""
    return mma and not exact and element_size == 2 and projection_bytes >= AUTO_BYTES


def resolve(choice: str, drafter: DrafterModel, target: nn.Module, device: torch.device) -> str:
    """spec.draft_weights as the backend takes it: "auto" (left so only where the engine did not settle it: a backend
    built outside an engine) becomes "int4-greedy" or "model" (`auto_makes_copy`), others stay."""
    if choice != "auto":
        return choice
    shapes = list(projection_shapes(drafter).values())
    weight = next((p for n, p in drafter.named_parameters() if layer_projection(n)), None)
    if weight is None:
        return "model"
    exact = bool(getattr(target, "exact", False))
    return "int4-greedy" if auto_makes_copy(shapes, device, weight.dtype, exact) else "model"


def auto_makes_copy(shapes: list[tuple[int, int]], device: torch.device, dtype: torch.dtype, exact: bool) -> bool:
    """`auto_copy` for layer projections of these (out, in) shapes held in `dtype` on `device`: the backend's
    resolution and the memory plan's."""
    if not shapes:
        return False
    _, mma = int4_layout(shapes, device, dtype)
    size = torch.finfo(dtype).bits // 8
    return auto_copy(sum(out * cols for out, cols in shapes) * size, size, mma=mma, exact=exact)


def projection_shapes(drafter: DrafterModel) -> dict[str, tuple[int, int]]:
    """(out, in) of every layer projection the copy packs, by module name."""
    return {n: (m.out_features, m.in_features) for n, m in drafter.named_modules()
            if layer_projection(n) and isinstance(m, nn.Linear)}


def copy_bytes(shapes: list[tuple[int, int]], device: torch.device, dtype: torch.dtype) -> int:
    """What the copy holds for layer projections of these (out, in) shapes: half a byte a weight, and a group's scale
    and zero point (4 bytes a row and group in the mma kernel's order, else a scale in `dtype` and a byte)."""
    groups, mma = int4_layout(shapes, device, dtype)
    held = 4 if mma else torch.finfo(dtype).bits // 8 + 1
    return sum(out * cols // 2 + out * (cols // (g or INT4_GROUPS[-1])) * held
               for (out, cols), g in zip(shapes, groups, strict=True))


def packed_copy(drafter: DrafterModel) -> DrafterModel:
    """The drafter with its layers' projections in 4 bits (`DrafterModel.to_int4`), every other tensor (fc, norms,
    convs, selector, RoPE tables) the drafter's own: call before either is fused. ValueError where a projection's
    inputs are not a multiple of the format's smallest group."""
    shared: dict[int, object] = {id(t): t for t in (*drafter.parameters(), *drafter.buffers())}
    shared[id(drafter.rope)] = drafter.rope
    twin = copy.deepcopy(drafter, memo=shared)
    twin.to_int4(layer_projection)
    return twin


def reads_copy(greedy_round: bool, lanes: int, drafts: int) -> bool:
    """Whether a round of `lanes` blocks of `drafts` drafts (and their anchors) drafts with the copy."""
    return greedy_round and lanes * (drafts + 1) <= GREEDY_ROWS
