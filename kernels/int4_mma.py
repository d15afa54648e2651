"""The 4-bit GEMV/GEMM with the weight as the tensor cores' 16-row operand: x [rows, in] @ W^T for an ignis-int4 W
repacked into the register order of mma.m16n8k16, for the 1 to 64 rows of decode and verify rounds.

Owns: `pack` (the format's codes, scales and zero points -> `MmaCodes`, on any device), `unpack` (back to the
format's codes, for the dequantized reference and prefill), the launch shape `Shape`, `choose`, `split` (SPLITS'
weights' own input splits) and `ringed` (which weights' launches take the kernel's ring loop: RING_LAUNCHES),
X_PAD_ROW0 (what the lanes of the rows past a call's load), and `int4_mma` (the launch on torch's current stream,
capturable; from ignis.kernels.int4_tile.TILE_ROWS rows it may hand the call to that module's kernel, which stages x
in shared memory and gives the same bits). Does not own: the format (ignis.quant.format), the kernel source and its
layout's definition (ignis.kernels.int4_mma_kernel), compiling (ignis.kernels.nvrtc), or when this kernel runs
(ignis.quant.linear). docs/adr/0005-int4-gemv.md has the why and the measurements.

Numerics: q - z and x are exact bf16/fp16 operands, every product exact and every sum fp32 (tensor cores within a
group of the weight, then fp32 fused multiply-adds by the group's scale); the result is rounded once to x's dtype. It
differs from the fp32 reference `int4_gemv_reference` only by the order (and, inside the tensor cores, the alignment)
of fp32 additions, and a row's result does not depend on how many rows share the call: the launch's KW and U come
from the weight's shape alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

import torch
from ignis.kernels.int4_mma_kernel import SOURCE
from ignis.kernels import int4_tile
from ignis.kernels import launch as launches
from ignis.kernels.launch import SPLIT_COUNTERS, pdl, sm_count, split_counters

from ignis.quant.format import dequantize

MAX_ROWS = 64  # activation rows a call takes: NT tiles of 8, NT <= 8
ROW_TILES = (1, 2, 4, 8)  # NT variants compiled (tiles of 8 rows)
MAGIC = {torch.bfloat16: 128.0, torch.float16: 1024.0}  # the float whose low mantissa bits hold a code
ACTIVATIONS = tuple(MAGIC)
AIM_WARPS_PER_SM = 23  # what the input split aims at (fitted to the H200 sweep of the 27B's five products)
SHARED = 48 * 1024  # static shared memory a block of threads may have (the KW warps' partial sums)


@dataclass(frozen=True)
class MmaCodes:
    """An int4 weight [out, in] in the kernel's order: `codes` uint8 [out/16, in/64, 512] (a 16-feature, 64-column
    tile is 32 lanes x 16 bytes) and `zs` int16 [out/16, in/group, 8, 4] (lane group g: feature g's scale bits and
    -(magic + z) in the activation dtype, then feature g + 8's)."""

    codes: torch.Tensor  # [out/16, in/64, 512] uint8
    zs: torch.Tensor  # [out/16, in/group, 8, 4] int16
    group: int
    dtype: torch.dtype  # the activations' (bf16 or fp16): zs holds its magic number
    scale_dtype: torch.dtype  # the scales' (fp16 or bf16)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.codes.shape[0] * 16, self.codes.shape[1] * 64))

    def __getitem__(self, rows: slice) -> MmaCodes:
        """Features rows.start..rows.stop (multiples of 16, no step) as views, as a dense weight's rows slice."""
        if rows.step not in (None, 1):
            raise ValueError(f"MmaCodes rows are taken without a step, got {rows}")
        return self.rows(rows.start or 0, self.shape[0] if rows.stop is None else rows.stop)

    def rows(self, start: int, stop: int) -> MmaCodes:
        """Features start..stop (multiples of 16) as views."""
        if start % 16 or stop % 16:
            raise ValueError(f"MmaCodes rows are taken in blocks of 16, got {start}..{stop}")
        return replace(self, codes=self.codes[start // 16 : stop // 16], zs=self.zs[start // 16 : stop // 16])

    def dequantize(self) -> torch.Tensor:
        """The weight [out, in] in the activation dtype: what the kernel multiplies by, for prefill-sized inputs."""
        return dequantize(*unpack(self), self.dtype)


def fits(nout: int, ncols: int, group: int) -> bool:
    """Whether a weight [nout, ncols] in groups of `group` can be packed: 16-feature tiles, 64-column chunks, groups
    of whole chunks."""
    return nout % 16 == 0 and group % 64 == 0 and ncols % group == 0


def _nibble_order(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [out, in] (0..15) -> the packed bytes [out/16, in/64, 512] of the kernel's layout."""
    nout, ncols = codes.shape
    # feature = rb * 16 + h * 8 + g; column = c * 64 + t * 16 + half * 8 + 2 p + parity
    c = codes.reshape(nout // 16, 2, 8, ncols // 64, 4, 2, 4, 2)  # rb h g c t half p parity
    c = c.permute(0, 3, 2, 4, 5, 1, 7, 6)  # rb c g t half h parity p: word (half, h), nibble parity * 4 + p
    c = c.reshape(nout // 16, ncols // 64, 32, 4, 4, 2)  # rb c lane word byte nibble-in-byte
    return (c[..., 0] | (c[..., 1] << 4)).reshape(nout // 16, ncols // 64, 512)


def pack(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, dtype: torch.dtype) -> MmaCodes:
    """The format's qweight uint8 [out, in/2], scales [out, in/group] (fp16 or bf16) and qzeros uint8 [out, in/group]
    -> the kernel's layout for activations of `dtype` (bf16 or fp16). On the weight's device, without a copy of the
    unpacked codes larger than the weight's own codes twice."""
    nout, ncols = qweight.shape[0], 2 * qweight.shape[1]
    group = ncols // scales.shape[1]
    if dtype not in MAGIC or scales.dtype not in (torch.float16, torch.bfloat16) or not fits(nout, ncols, group):
        raise ValueError(f"int4_mma packs [out, in] weights with out % 16 == 0 and groups of a multiple of 64 "
                         f"columns, fp16 or bf16 scales, for bf16 or fp16 activations; got [{nout}, {ncols}] in "
                         f"groups of {group}, scales {scales.dtype}, activations {dtype}")
    codes = torch.stack((qweight & 0xF, qweight >> 4), dim=-1).reshape(nout, ncols)  # [out, in] uint8
    negz = (-(qzeros.to(torch.float32) + MAGIC[dtype])).to(dtype).view(torch.int16)  # [out, groups]
    zs = torch.stack((scales.view(torch.int16), negz), dim=-1)  # [out, groups, 2]
    zs = zs.reshape(nout // 16, 2, 8, -1, 2).permute(0, 3, 2, 1, 4).reshape(nout // 16, -1, 8, 4)
    return MmaCodes(_nibble_order(codes).contiguous(), zs.contiguous(), group, dtype, scales.dtype)


def unpack(w: MmaCodes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`pack`'s inverse: (qweight uint8 [out, in/2], scales [out, in/group], qzeros uint8 [out, in/group])."""
    nout, ncols = w.shape
    b = w.codes.reshape(nout // 16, ncols // 64, 8, 4, 2, 2, 4)  # rb c g t half h byte
    nib = torch.stack((b & 0xF, b >> 4), dim=-1).reshape(nout // 16, ncols // 64, 8, 4, 2, 2, 2, 4)  # .. parity p
    codes = nib.permute(0, 5, 2, 1, 3, 4, 7, 6).reshape(nout, ncols)  # rb h g c t half p parity
    qweight = codes[:, 0::2] | (codes[:, 1::2] << 4)
    zs = w.zs.reshape(nout // 16, -1, 8, 2, 2).permute(0, 3, 2, 1, 4).reshape(nout, -1, 2)  # [out, groups, 2]
    scales = zs[..., 0].contiguous().view(w.scale_dtype)
    qzeros = (-zs[..., 1].contiguous().view(w.dtype).float() - MAGIC[w.dtype]).round().to(torch.uint8)
    return qweight.contiguous(), scales, qzeros


@dataclass(frozen=True)
class Shape:
    """A launch: U chunks a step, AHEAD steps loaded ahead, KW warps along the input (split in units of `unit`
    chunks), RB warps of F 16-feature blocks each a block of threads, RG blocks of threads splitting the row tiles of
    the same features, and the kernel's step loop (RING). KW and the unit fix the order of the sums (so they come
    from the weight's shape only); U (a divisor of the unit), F, RB, RG, AHEAD, RING and XRING may change with the
    rows."""

    u: int
    ahead: int
    kw: int
    rb: int
    f: int = 1
    unit: int = 4  # chunks of the input split's unit: the largest U the shape allows (fixed by the shape)
    ks: int = 1  # blocks of threads along the input (their partial sums meet in a workspace)
    rg: int = 1  # blocks of threads over the rows, NT / RG row tiles each (at most NT); choose's is NT 8's RG
    ring: bool = False  # the step loop unrolled over its AHEAD + 1 slots, each step's loads kept above its compute
    xring: bool = False  # with `ring`, x in the ring's slots too: each step's x loaded AHEAD steps ahead


def step_fits(unit: int, u: int, group: int) -> bool:
    """Whether steps of U chunks fit a split in units of `unit` chunks (U divides it) and hold whole groups."""
    return unit % u == 0 and (64 * u) % group == 0


def _step_chunks(ncols: int, group: int) -> int:
    """U: the most 64-column chunks a step (4, 2 or 1) that divides the input and holds whole groups."""
    return next(u for u in (4, 2, 1) if step_fits(ncols // 64, u, group))


@lru_cache(maxsize=1024)
def choose(nout: int, ncols: int, group: int, sms: int) -> Shape:
    """The split of the input for a weight's shape, which fixes the order of its sums: into P = KS x KW parts where
    the 16-feature blocks alone give the SMs fewer than AIM_WARPS_PER_SM warps each (at least 3: a warp alone on a
    block leaves its loads' latency uncovered), no part shorter than 3 units, at most 8 warps a block of threads.
    Also the RG that `launch` gives 33-64 rows: ROW_SPLIT where the weight has fewer than ROW_SPLIT_BELOW feature
    blocks an SM."""
    unit = _step_chunks(ncols, group)
    units = ncols // (64 * unit)
    blocks = nout // 16
    parts = max(1, min(max(3, math.ceil(AIM_WARPS_PER_SM * sms / blocks)), units // 3, 24))
    ks = math.ceil(parts / 8)
    rg = ROW_SPLIT if blocks < ROW_SPLIT_BELOW * sms else 1
    return Shape(unit, 1, math.ceil(parts / ks), 1, 1, unit, ks, rg)


# NT -> (F, U, AHEAD) where the unit allows U = 2: what the H200 sweep (tools.bench_quant's products, and the
# variants around them) found fastest at the 27B shapes for 9-16, 17-32 and 33-64 rows. NT 8 with F 2 spills a few
# hundred bytes of registers (ptxas caps a thread at 255) and is still 1.7x faster than F 1, which does not spill.
ROW_LAUNCH = {2: (1, 2, 0), 4: (2, 2, 1), 8: (2, 2, 1)}
# 33-64 rows over a weight of few feature blocks (the 27B's 5,120-output products: 320 blocks on 132 SMs) split its
# row tiles over ROW_SPLIT blocks of threads, each holding a quarter of the sums (no spills, and four times the
# blocks to cover the loads' latency): mlp down 125 -> 99 us, o_proj 53 -> 42 in the H200 sweep (BENCHMARKS.md, "the
# 4-bit product at 64 rows"), while the wide products (896-2,176 blocks) ran 5-25% slower split.
ROW_SPLIT = 4
ROW_SPLIT_BELOW = 4  # feature blocks an SM
# Weight shapes [out, in] -> (U, AHEAD, XRING) of their one-row-tile launches (1 to 8 rows) on the ring loop: the
# step loop unrolled over its ring with each step's loads kept above its compute (the kernel's RING), x in the ring
# too with XRING. On an H100 (BENCHMARKS.md, "x in the ring's slots"), the 27B's o_proj / gdn out_proj (5,120 x
# 6,144) went from 1.49 to 1.34x its floor at one row and 1.72 to 1.35 at 8 at U 2 AHEAD 2. The 27B's gdn in_proj
# qkv+z (16,384 x 5,120) took x in the ring at U 2 AHEAD 1 on an H100 (1.11 -> 1.07, 1.18 -> 1.09); on an H200,
# after the ring's loads waited for their own codes, U 2 AHEAD 2 without it is faster (BENCHMARKS.md, "The 4-bit
# products on the H200 at e08bf8b": 1.40 -> 1.20 at 1 and 8 rows, the same from 16 rows, the int4-head decode step
# 5.55 -> 5.49 ms a replay, twice). mlp down (5,120 x 17,408) takes U 2 AHEAD 2 on its SPLITS split. Attention qkv
# and gate_up (its 1-8 rows store SwiGLU) keep the plain loop, as fast or faster.
RING_LAUNCHES: dict[tuple[int, int], tuple[int, int, bool]] = {
    (5120, 6144): (2, 2, False), (16384, 5120): (2, 2, False), (5120, 17408): (2, 2, False)}
# 4-bit weight shapes [out, in] -> the input split (KS, KW) they take instead of choose's, at every row count (the
# split orders a row's sums, so it cannot change with the rows; tools.bench_quant --splits sets it for a run,
# --ring-ab's items may name one). mlp down on KS 1 x KW 8, its ring launch and its F 2 tiles against choose's KS 2 x
# KW 5, the plain loop and F 1 tiles on an H100 (BENCHMARKS.md, "mlp down on KS 1 x KW 8"; tools.bench_quant
# --shape-ab), PDL on, us: 1 row 19.1 -> 18.0, 8 rows 20.9 -> 18.5, 16 rows 29.5 -> 26.7, 17 rows 42.3 -> 36.0,
# 32 rows 51.6 -> 43.3, 64 rows 86 -> 84; the 27B int4-head decode step 6.58 -> 6.48 ms a replay (twice).
SPLITS: dict[tuple[int, int], tuple[int, int]] = {(5120, 17408): (1, 8)}
# Whether the lanes of the rows past a call's read row 0's x instead of zeros (the kernel's XPAD: the same bits, four
# fewer instructions a chunk). On an H100 (BENCHMARKS.md, "Fewer instructions a chunk") it takes mlp down to 0.90 of
# its windowed time at one row, the time an H200's cold launch tracks, and adds 2-9% to the H100's cold launches (its
# 27B int4-head decode step 6.418 -> 6.575 ms a replay, twice): off until an H200 measures it (tools.bench_quant
# --x-pad row0, and --x-pad-ab for the decode step).
X_PAD_ROW0 = False


def split(nout: int, ncols: int, group: int, sms: int) -> Shape:
    """choose's launch for a 4-bit weight, with the input split SPLITS names for its shape where it names one."""
    base = choose(nout, ncols, group, sms)
    ks_kw = SPLITS.get((nout, ncols))
    return base if ks_kw is None else replace(base, ks=ks_kw[0], kw=ks_kw[1])


def launch(base: Shape, nt: int) -> Shape:
    """`base` (choose's split) with the rest of the launch for NT row tiles: at one tile a feature block a warp, U the
    unit, one step ahead; above, ROW_LAUNCH; fewer feature blocks a warp where the KW warps' partial sums of all NT
    tiles would not fit in 48 KiB of shared memory (so measured, also where RG blocks share the tiles); at NT 8,
    choose's RG."""
    if nt == 1 or base.unit % 2:
        f, u, ahead = 1, base.unit, 1
    else:
        f, u, ahead = ROW_LAUNCH[nt]
    while f > 1 and (base.kw - 1) * f * nt * 512 > SHARED:
        f, u, ahead = f // 2, base.unit, 1
    return replace(base, u=u, f=f, ahead=ahead, rg=base.rg if nt == 8 else 1)


def _function(device: torch.device, nt: int, shape: Shape, gpc: int, dtype: torch.dtype,
              scale_dtype: torch.dtype, early: bool = False, swiglu: bool = False, window: int = 0) -> object:
    from ignis.kernels.nvrtc import load

    defines = (("NT", nt // shape.rg), ("F", shape.f), ("U", shape.u), ("AHEAD", shape.ahead),
               ("KS", shape.ks), ("KW", shape.kw), ("RB", shape.rb), ("RG", shape.rg),
               ("GPC", gpc), ("F16", int(dtype == torch.float16)),
               ("SBF16", int(scale_dtype == torch.bfloat16)), ("SWIGLU", int(swiglu)), ("PDL", int(early)),
               ("TRIGGER", int(early and launches.EARLY_TRIGGER)), ("RING", int(shape.ring)),
               ("XRING", int(shape.xring))) + ((("WINDOW", window),) if window else ()) + (
               (("XPAD", 1),) if X_PAD_ROW0 else ())
    return load(SOURCE, "int4_mma", defines, device)


def ringed(s: Shape, nt: int, nout: int, ncols: int, group: int, swiglu: bool = False) -> Shape:
    """`s` on the ring loop with RING_LAUNCHES's U, AHEAD and XRING for the weight's shape where it names one, at one
    row tile, without the SwiGLU store (what was measured), and where that U divides the unit and holds whole groups;
    else `s`."""
    ring = RING_LAUNCHES.get((nout, ncols))
    if ring is None or nt != 1 or swiglu:
        return s
    u, ahead, xring = ring
    if not step_fits(s.unit, u, group):
        return s
    return replace(s, u=u, ahead=ahead, ring=True, xring=xring)


def row_tiles(rows: int) -> int:
    """NT for `rows` activation rows: the fewest of ROW_TILES tiles of 8 that hold them."""
    return next(n for n in ROW_TILES if rows <= 8 * n)


def swiglu_launch(s: Shape, nt: int) -> Shape | None:
    """The launch `s` with the SwiGLU store: one gate block and its up partner a warp (F 2), or None where the KW
    warps' partial sums of both would not fit in shared memory."""
    s = replace(s, f=2)
    return s if (s.kw - 1) * s.rb * s.f * (nt // min(s.rg, nt)) * 512 <= SHARED else None


def int4_mma(x: torch.Tensor, w: MmaCodes, shape: Shape | None = None, swiglu: bool = False,
             window: int = 0) -> torch.Tensor:
    """x [..., in] (w.dtype, CUDA, at most MAX_ROWS rows) @ W^T -> [..., out] in x.dtype. `shape` overrides `choose`
    (benchmarks; its KW and U change the order of the sums). With `swiglu`, W is an MLP's fused gate | up [2 I, in]
    (I a multiple of 16) and the result is silu(gate) * up [..., I], as the SwiGLU kernel makes it from the product's
    output. Without `shape` or `window`, a call of int4_tile.tile_for's rows runs the tiled kernel, the same sums.
    `window` (benchmarks only: tools.quant_products) makes every feature block read the codes and scales of its
    block modulo `window`, which L2 then holds: this kernel's launch at its own grid and instructions, wrong sums.
    Asynchronous, on torch's current stream; no host read; allocates the output."""
    nout, ncols = w.shape
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    if (x.dtype != w.dtype or x.shape[-1] != ncols or not x.is_cuda or rows.shape[0] > MAX_ROWS
            or w.codes.device != x.device):
        raise ValueError(f"int4_mma takes x [..., {ncols}] in {w.dtype} on the weight's CUDA device, at most "
                         f"{MAX_ROWS} rows; got {tuple(x.shape)} {x.dtype} on {x.device}")
    if rows.stride(-1) != 1 or rows.stride(0) % 8 or rows.data_ptr() % 16:
        rows = rows.contiguous()  # 16-byte loads of x
    nrows = rows.shape[0]
    width = nout // 2 if swiglu else nout
    if swiglu and nout % 32:
        raise ValueError(f"int4_mma's SwiGLU takes a gate | up weight of whole 16-feature blocks a half, got {nout}")
    out = torch.empty((nrows, width), dtype=x.dtype, device=x.device)  # [rows, out] (or [rows, I])
    if nrows == 0:
        return out.reshape(*lead, width)
    nt = row_tiles(nrows)
    early = pdl(x.device)  # programmatic dependent launch (launch.PDL): the codes load while the kernel before ends
    sms = sm_count(x.device)
    base = split(nout, ncols, w.group, sms)  # the input's split: the order of a row's sums, whichever kernel runs
    tile = None if shape is not None or window else int4_tile.tile_for(nrows, nout, ncols, sms, swiglu)
    if tile is not None:  # x staged in shared memory once a block of threads: the same sums
        int4_tile.run(rows, w.codes, w.zs, out, nout=nout, ncols=ncols, group=w.group, ks=base.ks, kw=base.kw,
                      unit=base.unit, nt=-(-nrows // 8), dtype=w.dtype, scale_dtype=w.scale_dtype, swiglu=swiglu,
                      early=early, tile=tile)
        return out.reshape(*lead, width)
    s = shape if shape is not None else ringed(launch(base, nt), nt, nout, ncols, w.group, swiglu)
    if swiglu:
        fused = swiglu_launch(s, nt)
        if fused is None:
            raise ValueError(f"int4_mma's SwiGLU does not fit {s} at {nrows} rows (swiglu_launch)")
        s = fused
    s = replace(s, rg=min(s.rg, nt))  # no block of threads without rows
    if s.rg not in ROW_TILES:
        raise ValueError(f"int4_mma splits the rows over 1, 2, 4 or 8 blocks of threads, got RG {s.rg}")
    fn = _function(x.device, nt, s, w.group // 64, w.dtype, w.scale_dtype, early, swiglu, window)
    grid = (math.ceil(width // 16 / (s.rb * (s.f // 2 if swiglu else s.f))) * s.rg, s.ks, 1)
    if s.ks > 1:
        if grid[0] > SPLIT_COUNTERS:
            raise ValueError(f"{grid[0]} blocks of threads split over the input exceed the {SPLIT_COUNTERS} counters")
        ws = torch.empty((s.ks, nrows, nout), dtype=torch.float32, device=x.device)  # [ks, rows, out] partials
        cnt = split_counters(x.device)  # [SPLIT_COUNTERS] int32, zero between calls
    else:
        ws, cnt = out, out  # not read
    fn(grid, 32 * s.kw * s.rb,  # type: ignore[operator]
       (w.codes, w.zs, rows, out, ws, cnt, nrows, nout, ncols, rows.stride(0), s.unit), early)
    return out.reshape(*lead, width)
