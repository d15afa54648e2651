"""The 4-bit product at 1 to 64 rows, int4_tile's launches (forced, and as shipped) against int4_mma's own warps and
bf16 cuBLAS: what tools.bench_quant --sweep-tile runs. Each product's tiled result is first checked bit for bit against
int4_mma's (a row's sums must not depend on which kernel a batch takes), then every form is timed as
tools.quant_products times the products."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from ignis.kernels import int4_tile
from ignis.kernels.int4_mma import int4_mma
from ignis.kernels.int4_tile import Tile

from tools.quant_products import SHAPES, _timed, floor_ms, mma_copies, weight_copies

TILE_ROWS = (1, 8, 16, 17, 32, 64)  # the forced launches run at every count, below int4_tile.TILE_ROWS too
# launches timed beside tile_for's own (F 2 and F 1; RS: a feature group's row tiles over more warps, for more warps
# an SM at 64 rows, with the registers for two blocks of threads an SM)
TILES = (Tile(), Tile(f=1), Tile(rs=2, minb=2), Tile(f=1, rs=2, minb=2), Tile(rs=4), Tile(rb=2, rs=2), Tile(stages=6))


def _mma_alone(x: torch.Tensor, w: Any) -> torch.Tensor:
    """int4_mma's own warps whatever the rows."""
    before, int4_tile.TILE_ROWS = int4_tile.TILE_ROWS, None
    try:
        return int4_mma(x, w)
    finally:
        int4_tile.TILE_ROWS = before


def sweep_tile(bw: float, reps: int) -> list[dict[str, Any]]:
    rows_out: list[dict[str, Any]] = []
    dev = torch.device("cuda")
    for name, nout, ncols in SHAPES:
        nm, cm = mma_copies(nout, ncols, dev)
        wb = weight_copies(nout * ncols * 2, lambda: torch.randn(nout, ncols, device=dev).bfloat16())  # noqa: B023
        for r in TILE_ROWS:
            x = torch.randn(r, ncols, device=dev).bfloat16()
            floor = floor_ms(nm, r, nout, ncols, bw)
            floor_bf16 = floor_ms(nout * ncols * 2, r, nout, ncols, bw)
            want = _mma_alone(x, cm[0])
            forms: list[tuple[str, Tile | None]] = [("mma", None), ("as shipped", None)]
            forms += [(f"tile rb{t.rb} f{t.f} s{t.stages} m{t.minb} rs{t.rs}", t) for t in TILES]
            for form, tile in forms:
                row: dict[str, Any] = {"shape": name, "rows": r, "form": form}
                if form == "mma":
                    said = _timed(row, [partial(_mma_alone, x, p) for p in cm], reps, floor)
                else:
                    kept = int4_tile.TILE, int4_tile.TILE_ROWS
                    if tile is not None:  # forced, at every row count
                        int4_tile.TILE, int4_tile.TILE_ROWS = tile, 1
                    try:
                        got = int4_mma(x, cm[0])
                        row["bits_equal"] = bool(torch.equal(got, want))
                        said = _timed(row, [partial(int4_mma, x, p) for p in cm], reps, floor)
                    except Exception as e:  # noqa: BLE001 - a launch that does not compile or fit: reported
                        row["error"] = repr(e)[:300]
                        said = f"failed: {row['error'][:100]}"
                    finally:
                        int4_tile.TILE, int4_tile.TILE_ROWS = kept
                    said += "" if row.get("bits_equal", True) else "  BITS DIFFER"
                rows_out.append(row)
                print(f"tile {name:22s} rows {r:2d}  {form:24s} {said}", flush=True)
            row = {"shape": name, "rows": r, "form": "bf16"}
            said = _timed(row, [partial(F.linear, x, w) for w in wb], reps, floor_bf16)
            rows_out.append(row)
            print(f"tile {name:22s} rows {r:2d}  {'bf16 (its own floor)':24s} {said}", flush=True)
        del cm, wb
        torch.cuda.empty_cache()
    return rows_out
