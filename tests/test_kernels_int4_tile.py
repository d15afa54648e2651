"""The tiled 4-bit product's CPU side (ignis.kernels.int4_tile): every launch the engine makes at the 27B's and the
built-in model's shapes compiled for sm_90 by NVRTC without a spill, with its SwiGLU store, launched ahead, and for
fp16 activations. The kernel runs on a GPU only: tests/test_quant_mma_gpu.py checks its bits against int4_mma's."""

from __future__ import annotations

import pytest
from ignis.kernels import int4_tile
from ignis.kernels.int4_mma import choose, row_tiles, split
from ignis.kernels.int4_tile import TILE_ROWS, Tile, defines, tile_for
from ignis.kernels.int4_tile_kernel import SOURCE
from ignis.kernels.nvrtc import compile_cubin

SMS = 132  # an H200's
SHAPES = [(34816, 5120), (5120, 17408), (16384, 5120), (14336, 5120), (5120, 6144), (2048, 384), (384, 1024),
          (1280, 384), (512, 384)]


def test_the_tiled_kernel_takes_the_rows_and_weights_int4_mmas_own_warps_are_slow_at() -> None:
    assert TILE_ROWS is not None and 9 <= TILE_ROWS <= 33 and row_tiles(TILE_ROWS) >= 2
    assert tile_for(TILE_ROWS - 1, 5120, 6144, SMS, False) is None
    assert tile_for(48, 34816, 5120, SMS, False) == Tile(f=2) and tile_for(49, 34816, 5120, SMS, False) is None  # wide
    assert tile_for(64, 5120, 6144, SMS, False) == Tile(f=1)  # narrow: a feature block a warp
    assert tile_for(64, 5120, 6144, SMS, True) == Tile(f=2)  # the SwiGLU store: a gate block and its up partner


def test_a_weight_named_in_shape_tiles_takes_its_own_launch_where_the_rows_are_tiled(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert int4_tile.SHAPE_TILES[(5120, 17408)] == Tile()  # what ships: mlp down at F 2
    monkeypatch.setattr(int4_tile, "SHAPE_TILES", {(5120, 6144): Tile(stages=6)})
    assert tile_for(17, 5120, 6144, SMS, False) == Tile(stages=6)
    assert tile_for(TILE_ROWS - 1, 5120, 6144, SMS, False) is None  # still int4_mma's own warps below TILE_ROWS
    assert tile_for(64, 5120, 17408, SMS, False) == Tile(f=1)  # not named: the narrow weights' rule
    monkeypatch.setattr(int4_tile, "SHAPE_TILES", {(34816, 5120): Tile(f=1)})
    assert tile_for(49, 34816, 5120, SMS, False) is None  # a wide weight past WIDE_ROWS is not tiled, named or not


@pytest.mark.parametrize("swiglu", [False, True])
def test_every_tiled_launch_compiles_for_sm90_without_spills(swiglu: bool) -> None:
    seen = set()
    for nout, ncols in SHAPES:
        base = split(nout, ncols, 128, SMS)  # the split the engine's calls take
        for rows in range(TILE_ROWS or 64, 65):
            tile = tile_for(rows, nout, ncols, SMS, swiglu)
            if tile is not None:
                seen.add(defines(-(-rows // 8), tile, base.ks, base.kw, 2, swiglu))  # NT: the rows' tiles
    for d in sorted(seen):
        cubin = compile_cubin(SOURCE, "int4_tile", "sm_90", d)
        # the SwiGLU store over a split of 8 parts or more at NT 8 (never a gate | up weight of the 27B or the built-in
        # model: their inputs split in 3 or 4) spills 16 bytes; nothing else may
        spilt = swiglu and dict(d)["NT"] == 8 and dict(d)["KS"] * dict(d)["KW"] >= 8
        assert cubin.spills <= (16 if spilt else 0) and 0 < cubin.registers <= 255, (dict(d), cubin.spills)


def test_launched_ahead_for_fp16_and_with_the_rows_over_more_warps_the_kernel_compiles_without_spills() -> None:
    base = choose(5120, 17408, 128, SMS)
    plain = dict(defines(8, Tile(f=1), base.ks, base.kw, 2))
    for changed in ({"PDL": 1}, {"F16": 1}, {"F16": 1, "SBF16": 0}, {"GPC": 1}, {"RS": 2, "MINB": 2}, {"RS": 4}):
        cubin = compile_cubin(SOURCE, "int4_tile", "sm_90", tuple(sorted({**plain, **changed}.items())))
        assert cubin.spills == 0 and cubin.registers <= 255, changed


def test_a_tile_of_odd_f_refuses_the_swiglu_store() -> None:
    import torch
    from ignis.kernels.int4_tile import run

    x = torch.zeros(17, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="even F"):
        run(x, x, x, x, nout=32, ncols=64, group=64, ks=1, kw=1, unit=1, nt=4, dtype=torch.bfloat16,
            scale_dtype=torch.bfloat16, swiglu=True, early=False, tile=Tile(f=1))
