"""The 27B's verify rounds with 4-bit weights (the output head packed too), the tiled 4-bit product on and off, beside
the same rounds in bf16: what tools.bench_quant --tile-rounds runs. A round's rows are its lane bucket's lanes x
columns, so the rounds of 3 to 8 lanes at 8 columns (buckets of 4 and 8 lanes: 32 and 64 rows) are where
ignis.kernels.int4_tile takes products."""

from __future__ import annotations

from typing import Any

import torch
from ignis.kernels import int4_tile

from ignis.quant.linear import to_mma, uses_mma

LANES = (1, 2, 3, 4, 8)  # lanes of the rounds timed, 8 columns each (7 drafts): 8 to 64 rows


def tile_rounds(bw: float, context: int, iters: int, lanes: tuple[int, ...] = LANES) -> dict[str, Any]:
    """Each round's figures (tools.bench_quant.decode_step) in bf16, then with 4-bit weights and head: tiled, not,
    tiled again (an A/B/A on one model)."""
    from ignis.model.random import random_model
    from tools.bench_quant import GROUP, C, decode_step, fuse_and_own, to_int4

    dev = torch.device("cuda")
    out: dict[str, Any] = {}
    model = random_model(C, seed=0, mtp=False, device=dev, dtype=torch.bfloat16)
    rounds = [(n, 7) for n in lanes]
    for n, k in rounds:
        out[f"bf16 {n}x{k + 1}"] = decode_step("bf16", model, bw, context, iters, lanes=n, k=k)
    to_int4(model, GROUP)
    if uses_mma(dev, torch.bfloat16):
        to_mma(model, torch.bfloat16)
    fuse_and_own(model)
    to_int4(model, GROUP, head=True)
    if uses_mma(dev, torch.bfloat16):
        to_mma(model, torch.bfloat16)
    kept = int4_tile.TILE_ROWS
    try:
        for arm, rows in (("tiled", kept), ("mma", None), ("tiled again", kept)):
            int4_tile.TILE_ROWS = rows
            for n, k in rounds:
                out[f"int4 {arm} {n}x{k + 1}"] = decode_step(f"int4 {arm}", model, bw, context, iters, lanes=n, k=k)
    finally:
        int4_tile.TILE_ROWS = kept
    del model
    torch.cuda.empty_cache()
    return out
