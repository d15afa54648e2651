"""Kernel variants the round benchmarks time side by side: the module switches of ignis.kernels and ignis.model.ops
that choose a round's kernels, set from the benchmarks' comma-list options (tools.bench_round, tools.bench_gdn,
tools.bench_quant).

Owns: the options' words (`PDL_SWITCH`, `GDN_KERNELS`), every combination of the lists (`combinations`) and setting
one (`apply_variant`, `recurrence_kernel`). Does not own: what the switches do (their modules) or the timing.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from ignis.backends import base as backends
from ignis.backends.dflash2 import ring, selector
from ignis.kernels import attention, fused, gdn, gdn_chunk, gdn_cuda, int4_tile, launch
from ignis.model import ops
from ignis.quant import fp8

PDL_SWITCH = {"auto": None, "off": False, "on": True}  # --pdl's words: ignis.kernels.launch.PDL's values
# the options `apply_variant` sets, comma lists
VARIANTS = ("conv_blocks", "blas", "stream", "gdn", "conv", "pdl", "gdn_pdl", "trigger", "int4_tile", "fp8_kernel",
            "draw", "drafter_conv", "selector", "attention_blocks", "replay")
TRIGGERS = {"late": False, "early": True}  # --trigger's words: ignis.kernels.launch.EARLY_TRIGGER's values


def combinations(args: argparse.Namespace) -> list[dict[str, str]]:
    """Every combination of the variant options' comma lists, in the order the options list them."""
    return [dict(zip(VARIANTS, values)) for values in itertools.product(
        *(getattr(args, name).split(",") for name in VARIANTS))]


_TILE_ROWS_SHIPPED = int4_tile.TILE_ROWS  # --int4-tile on: from where ignis ships it
_DRAW_SHIPPED = backends.DRAW_COLUMNS  # --draw triton: the most columns a sampled draft's one-launch draw takes
GDN_KERNELS = ("auto", "numba", "cuda", "cuda4", "cuda5", "cuda6", "step", "step4", "step5", "step-normed",
               "apart", "chunk1", "chunk2", "chunk2x8", "columns", "chunkapart")  # --gdn's words (`recurrence_kernel`)
# chunk words: a verify in chunk form at every lane count in one block shape of ignis.kernels.gdn_chunk's (state
# columns a thread, row slices a block, blocks an SM bounded for)
CHUNK_SHAPES = {"chunk1": (1, 4, 6), "chunk2": (2, 4, 4), "chunk2x8": (2, 8, 2)}
# the recurrence's switches as ignis ships them, which --gdn auto restores
_GDN_SHIPPED = (gdn.CUDA_COLUMNS, gdn.CUDA_NORMED, gdn.STEP, gdn.CHUNK_VERIFY, gdn_cuda.BLOCKS, gdn_cuda.KEEP_K,
                gdn_cuda.STEP_BLOCKS, gdn_chunk.SHAPE, gdn_chunk.FEW, gdn.CHUNK_CONV_LANES)


def recurrence_kernel(word: str) -> None:
    """Route a decode's and a verify's conv and recurrence: auto, as shipped; numba; cuda, the CUDA C++ kernel holding
    a whole head with the gated norm joined; cudaN, the CUDA C++ recurrence alone bounded for N blocks an SM (k read
    again past 4), then the norm's own launch (these three run a verify's columns one by one too); step and apart: as
    shipped but for a decode's conv, joined to the recurrence's launch (ignis.kernels.gdn.STEP) or launched before it;
    stepN: joined, bounded for N blocks an SM; step-normed: a decode's conv, recurrence and gated norm in one launch
    (the whole head's kernel); chunk1, chunk2, chunk2x8: as shipped, a verify in chunk form (ignis.kernels.gdn_chunk)
    in one of CHUNK_SHAPES at every lane count; columns: as shipped, a verify's columns one by one; chunkapart: as
    shipped, a verify's conv in its own launch at every lane count (ignis.kernels.gdn.CHUNK_CONV_LANES 0)."""
    if word not in GDN_KERNELS:
        raise ValueError(f"--gdn takes {', '.join(GDN_KERNELS)}; got {word!r}")
    (gdn.CUDA_COLUMNS, gdn.CUDA_NORMED, gdn.STEP, gdn.CHUNK_VERIFY, gdn_cuda.BLOCKS, gdn_cuda.KEEP_K,
     gdn_cuda.STEP_BLOCKS, gdn_chunk.SHAPE, gdn_chunk.FEW, gdn.CHUNK_CONV_LANES) = _GDN_SHIPPED
    if word == "auto":
        return
    if word == "columns":
        gdn.CHUNK_VERIFY = False
        return
    if word == "chunkapart":
        gdn.CHUNK_CONV_LANES = 0
        return
    if word.startswith("chunk"):
        gdn.CHUNK_VERIFY = True
        gdn_chunk.SHAPE = gdn_chunk.FEW = CHUNK_SHAPES[word]  # part of the compiled kernel's key
        return
    if word == "apart" or word.startswith("step"):
        gdn.STEP = word != "apart"
        if word == "step-normed":
            gdn.CUDA_NORMED = True
        if word[4:].isdigit():
            gdn_cuda.STEP_BLOCKS = int(word[4:])
        return
    gdn.STEP = gdn.CHUNK_VERIFY = False
    gdn.CUDA_COLUMNS = word != "numba"
    gdn.CUDA_NORMED = word == "cuda"
    blocks = int(word[4:]) if word.startswith("cuda") and word[4:] else 4
    gdn_cuda.BLOCKS, gdn_cuda.KEEP_K = blocks, blocks <= 4  # part of the compiled kernels' key: no stale kernel runs


def apply_variant(variant: dict[str, str]) -> None:
    """Set the kernels' module switches for one combination of the variant options."""
    fused.CONV_BLOCKS = int(variant["conv_blocks"])
    torch.backends.cuda.preferred_blas_library(variant["blas"])
    ops.STREAMING = variant["stream"] == "on"
    recurrence_kernel(variant["gdn"])
    fused.CUDA_CONV = {"auto": None, "numba": False, "cuda": True}[variant["conv"]]
    launch.PDL = PDL_SWITCH[variant["pdl"]]
    launch.GDN_PDL = PDL_SWITCH[variant["gdn_pdl"]]
    launch.EARLY_TRIGGER = TRIGGERS[variant["trigger"]]
    int4_tile.TILE_ROWS = _TILE_ROWS_SHIPPED if variant["int4_tile"] == "on" else None
    fp8.FP8_KERNEL = variant["fp8_kernel"]
    backends.DRAW_COLUMNS = {"triton": _DRAW_SHIPPED, "torch": 0}[variant["draw"]]
    ring.JOIN_CONV = {"joined": True, "apart": False}[variant["drafter_conv"]]
    selector.FUSED = {"triton": True, "torch": False}[variant["selector"]]
    attention.TARGET_BLOCKS = int(variant["attention_blocks"])
    gdn.CUDA_REPLAY = {"cuda": True, "numba": False}[variant["replay"]]
