"""The 4-bit product for 17 to 64 rows (verify rounds of several lanes): int4_mma's arithmetic, bit for bit, with x
staged once a block of threads in shared memory (ignis.kernels.int4_tile_kernel has the why).

Owns: the launch shape `Tile`, `tile_for` (which calls of ignis.kernels.int4_mma come here, with which launch: from
TILE_ROWS rows; SHAPE_TILES, the weights that take their own) and `run` (the launch on torch's current stream,
capturable). Does not own: the weight's layout or the input split (the split is int4_mma.split's: it fixes the order
of a row's sums), argument checks (int4_mma.int4_mma makes them) or the kernel source.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from ignis.kernels.int4_tile_kernel import SOURCE
from ignis.kernels.launch import SPLIT_COUNTERS, split_counters

# Rows from which int4_mma's calls run this kernel (None: never), and past which only a weight of few feature blocks
# does (`tile_for`). On the H200 at the 27B's products (tools.bench_quant --sweep-tile; BENCHMARKS.md): at 17-48 rows
# it beats int4_mma's own warps on gate_up (61 against 95 us at 17 rows, 104 against 130 at 48), mlp down, in_proj
# and o_proj; at 64 rows on the 5,120-output ones (down 77 against 101, o_proj 37 against 42) and not on the wide
# ones (gate_up 155 against 138). Below 17 rows int4_mma's own warps, which load their x themselves, are as fast.
TILE_ROWS: int | None = 17
WIDE_ROWS = 48
NARROW_BLOCKS_PER_SM = 4  # fewer 16-feature blocks an SM than this: a narrow weight (int4_mma.ROW_SPLIT_BELOW's)


@dataclass(frozen=True)
class Tile:
    """A launch: RB feature groups of F 16-feature blocks a block of threads (even with SwiGLU: gate blocks and their
    up partners), each group's row tiles over RS warps, STAGES chunks (x, codes and scales) in the ring in shared
    memory, registers for MINB blocks an SM. None of them changes a row's sums."""

    rb: int = 4
    f: int = 2
    stages: int = 4
    minb: int = 1  # blocks of threads an SM the registers are budgeted for
    rs: int = 1  # warps each feature group's row tiles are split over

    def shared(self, nt: int) -> int:
        """Bytes of dynamic shared memory a block of threads takes at NT row tiles: the ring's stages of x (rows padded
        to 72 values), codes (512 bytes a feature block) and scales (64)."""
        return self.stages * (nt * 8 * 72 * 2 + self.rb * self.f * (512 + 64))


# A launch every call from TILE_ROWS rows takes instead of `tile_for`'s (tools.bench_quant --sweep-tile sets one for a
# run; None: choose).
TILE: Tile | None = None
# Weight shapes [out, in] -> the launch they take where `tile_for` tiles, over its rule's. mlp down on its
# int4_mma.SPLITS split (KS 1 x KW 8) at F 2 against the narrow weights' F 1 on an H100 (BENCHMARKS.md, "mlp down on
# KS 1 x KW 8"), PDL on, us: 17 rows 35.8 against 34.2, 24 rows 38.9 against 40.5, 32 rows 43.9 against 57.7, 48 rows
# 58.6 against 75.0, 64 rows 84.3 against 85.2. o_proj keeps F 1 (17 rows 16.9 against 19.9, 64 rows 38.6 against 49.3).
SHAPE_TILES: dict[tuple[int, int], Tile] = {(5120, 17408): Tile()}


def tile_for(rows: int, nout: int, ncols: int, sms: int, swiglu: bool) -> Tile | None:
    """The launch for `rows` rows of a weight [nout, ncols], or None where int4_mma's own warps are the faster:
    below TILE_ROWS, and past WIDE_ROWS for a wide weight. SHAPE_TILES's launch where it names the weight; else a
    narrow weight takes one feature block a warp (more warps for its few blocks; the SwiGLU store needs two), a wide
    one two (x read once for both)."""
    narrow = nout // 16 < NARROW_BLOCKS_PER_SM * sms
    if TILE_ROWS is None or rows < TILE_ROWS:
        return None
    if TILE is not None:
        return TILE
    if rows > WIDE_ROWS and not narrow:
        return None
    if (nout, ncols) in SHAPE_TILES:
        return SHAPE_TILES[(nout, ncols)]
    return Tile(f=1) if narrow and not swiglu else Tile(f=2)


def _function(device: torch.device, nt: int, tile: Tile, ks: int, kw: int, gpc: int, dtype: torch.dtype,
              scale_dtype: torch.dtype, early: bool, swiglu: bool) -> object:
    from ignis.kernels.nvrtc import load

    macros = {**dict(defines(nt, tile, ks, kw, gpc, swiglu)), "F16": int(dtype == torch.float16),
              "SBF16": int(scale_dtype == torch.bfloat16), "PDL": int(early)}
    return load(SOURCE, "int4_tile", tuple(macros.items()), device)


def defines(nt: int, tile: Tile, ks: int, kw: int, gpc: int, swiglu: bool = False) -> tuple[tuple[str, int], ...]:
    """The macros a bf16 launch compiles with (for the CPU tests' compile of every variant)."""
    return (("NT", nt), ("F", tile.f), ("RB", tile.rb), ("STAGES", tile.stages), ("MINB", tile.minb), ("RS", tile.rs),
            ("KS", ks), ("KW", kw), ("GPC", gpc), ("F16", 0), ("SBF16", 1), ("SWIGLU", int(swiglu)), ("PDL", 0))


def run(rows: torch.Tensor, codes: torch.Tensor, zs: torch.Tensor, out: torch.Tensor, *, nout: int, ncols: int,
        group: int, ks: int, kw: int, unit: int, nt: int, dtype: torch.dtype, scale_dtype: torch.dtype,
        swiglu: bool, early: bool, tile: Tile) -> None:
    """rows [M, ncols] (16-byte aligned rows, M <= 8 nt) @ the packed weight -> out [M, nout] (or [M, nout / 2] with
    `swiglu`), with int4_mma.choose's split (ks, kw, unit) of the weight's input and `tile`'s launch. Asynchronous; no
    host read."""
    if swiglu and tile.f % 2:
        raise ValueError(f"int4_tile's SwiGLU takes an even F (gate blocks and their up partners), got {tile}")
    nt = -(-nt // tile.rs) * tile.rs  # the row tiles split evenly over RS warps (the added ones are zero rows)
    nrows = rows.shape[0]
    fo = tile.f // 2 if swiglu else tile.f
    width = nout // 2 if swiglu else nout
    grid = (math.ceil(width // 16 / (tile.rb * fo)), ks * kw, 1)
    if ks * kw > 1:
        if grid[0] > SPLIT_COUNTERS:
            raise ValueError(f"{grid[0]} feature tiles exceed the {SPLIT_COUNTERS} split counters")
        ws = torch.empty((ks * kw, nrows, nout), dtype=torch.float32, device=rows.device)  # each part's totals
        cnt = split_counters(rows.device)
    else:
        ws, cnt = out, out  # not read
    fn = _function(rows.device, nt, tile, ks, kw, group // 64, dtype, scale_dtype, early, swiglu)
    args = (codes, zs, rows, out, ws, cnt, nrows, nout, ncols, rows.stride(0), unit)
    fn(grid, 32 * tile.rb * tile.rs, args, early, tile.shared(nt))  # type: ignore[operator]
