"""The 4-bit GEMV/GEMM on tensor cores, in Triton: x [rows, in] @ W^T for a packed ignis-int4 W, in one pass over the
weight, for the 1 to 64 rows of decode and verify rounds.

Owns: `int4_triton` (the launch, on torch's current stream), the kernel body, its launch shape `Config`, the tuning
table (`TABLE`, `choose`) and each device's split-K counters. Does not own: the format (ignis.quant.format), the
reference `int4_gemv_reference` (ignis.kernels.int4_gemv), or when this kernel runs
(ignis.quant.linear.packed_linear). docs/adr/0005-int4-gemv.md has the why.

Importing this module imports triton, not CUDA; ignis.quant.linear imports it only when the Triton kernel is chosen.
A kernel variant is compiled on its first call (Triton's on-disk cache keeps it), which must therefore come before a
CUDA graph captures it, as must a device's first split call (it allocates the counters); the engine's warm-up does.

A program owns BLOCK_M activation rows (rows past the call's are masked to zero, so tl.dot always sees at least 16),
BLOCK_N output rows and one K split. A step reads a [BLOCK_N, BLOCK_K / 2] tile of packed bytes and the matching
[BLOCK_M, BLOCK_K] tile of x (both pipelined through shared memory by Triton). Low nibbles are the even columns and
high ones the odd columns, so rather than interleave the codes, x's tile is split into its even and odd columns and
the step is two dots, x_even @ lo^T + x_odd @ hi^T, with x the left operand (mma.sync at 16 and 32 rows; the weight as
the left operand compiled to a third more instructions a code). A step never crosses a group (BLOCK_K
divides it), so a row's zero point and scale are one number a step: the codes become q - z before the dot, and the
scale multiplies the step's fp32 dot. On a GPU, 16-bit activations get q - z from a few lines of PTX on four packed
bytes at a time (`_codes_asm`), since the dequantization, not the tensor cores, is what competes with the weight's
bytes for time; fp32 and Triton's interpreter use Triton's own arithmetic for the same values.

Numerics: q - z (-15..15) and x are exact operands, their products exact, and every sum is fp32 (tensor cores for
bf16 and fp16, `input_precision="ieee"` for fp32); the output is rounded once to x's dtype. The result differs from
the fp32 reference `int4_gemv_reference` only by the order (and, on tensor cores, the internal alignment) of fp32
additions.

Split K, deterministic: where the output tiles alone cannot fill the device, the input dimension is split. Every split
stores its fp32 partial sums in a workspace and bumps its tile's counter (release/acquire, GPU scope); the last one
to arrive adds the splits' partials in split order, writes the output and resets the counter, all in one launch (a
second, finishing launch would cost more than the product's own tail at these sizes; ignis.kernels.split_k_triton). The sum's order never depends
on which split finishes last, and BLOCK_K and the split come from the weight's shape alone (`choose`), so a row's
result does not depend on how many rows share the call: row tiles are 16 or 32 rows, on mma.sync, because a 64-row
tile's wgmma adds a product's terms differently (tests/test_quant_gpu.py checks it bitwise; 64 rows cost two tiles'
dequantization). The counters are one static array a device: products on one device run one
at a time (one stream's order), as the engine's do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from ignis.kernels.launch import SPLIT_COUNTERS, sm_count, split_counters
from ignis.kernels.split_k_triton import store_split

# The table's rows buckets: BLOCK_M, the activation rows a program. No 64: there the dot is wgmma, which rounds
# differently from the mma.sync of 16 and 32 rows (seen on the H200: a row's result changed with 33 rows in the call),
# and a row's result must not depend on how many rows share the call.
ROWS_BUCKETS = (16, 32)
SPLIT_TILE = 128  # output rows a tile when choosing the K split (fixed, so the split depends on the shape only)
PROGRAMS_PER_SM = 2  # what the K split aims at
MIN_SPLIT_STEPS = 4  # K steps a split reads at least
MAX_SPLITS = 16
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Config:
    """A launch shape. block_k and split_k fix the order of the sums, so they depend on the weight's shape only (see
    `choose`); the others may change with the rows."""

    block_m: int  # activation rows a program (>= 16, a power of two); rows past the call's are masked
    block_n: int  # output rows a program (>= 16, a power of two)
    block_k: int  # input columns a step (>= 32, a power of two dividing the group)
    split_k: int  # programs along the input dimension (1: no split); divides the steps
    warps: int
    stages: int  # Triton's software pipeline depth (cp.async stages of the weight and x tiles)


# rows bucket (BLOCK_M) -> (block_n, warps, stages). Chosen from the compiled sm_90 code (instructions a code, no
# spills), not yet from timings: tools.bench_quant --sweep-triton times the alternatives at the 27B shapes, and this
# table is what it picks. At 16 and 32 rows the dot is mma.sync (x the left operand).
TABLE: dict[int, tuple[int, int, int]] = {16: (128, 4, 4), 32: (128, 4, 4)}
BLOCK_K = 128  # input columns a step, at most the group


_programs_per_sm = PROGRAMS_PER_SM  # what `split_k` reads: PROGRAMS_PER_SM unless `tune` changed it


def tune(entries: dict[int, tuple[int, int, int]], programs_per_sm: int) -> None:
    """Replace table entries (rows bucket -> (block_n, warps, stages)) and the split's target, for the process: what
    tools.bench_quant --policies times. The split fixes the order of the sums, so the engine never calls this; a
    policy worth keeping goes into TABLE and PROGRAMS_PER_SM."""
    global _programs_per_sm
    if not set(entries) <= set(ROWS_BUCKETS) or programs_per_sm < 1:
        raise ValueError(f"tune takes rows buckets among {ROWS_BUCKETS} and programs_per_sm >= 1; got "
                         f"{sorted(entries)}, {programs_per_sm}")
    TABLE.update(entries)
    _programs_per_sm = programs_per_sm
    choose.cache_clear()


def bucket(rows: int) -> int:
    """The table's BLOCK_M for `rows` activation rows; more than 32 rows take several row tiles of 32."""
    return next((b for b in ROWS_BUCKETS if rows <= b), ROWS_BUCKETS[-1])


def split_k(nout: int, ncols: int, block_k: int, sms: int) -> int:
    """K splits for a weight [nout, ncols]: a divisor of the steps (every split the same length), the least one
    giving each SM PROGRAMS_PER_SM programs when the output tiles alone do not, at most MAX_SPLITS and no split shorter
    than MIN_SPLIT_STEPS steps. Depends on the shape (and the device) only."""
    tiles = math.ceil(nout / SPLIT_TILE)
    steps = ncols // block_k
    want = math.ceil(_programs_per_sm * sms / tiles)
    fits = [d for d in range(1, min(MAX_SPLITS, steps // MIN_SPLIT_STEPS) + 1) if steps % d == 0] or [1]
    return next((d for d in fits if d >= want), fits[-1])


@lru_cache(maxsize=1024)
def choose(rows: int, nout: int, ncols: int, group: int, sms: int) -> Config:
    """The table's launch shape for a call: the rows pick BLOCK_M, BLOCK_N, warps and stages; the shape alone picks
    BLOCK_K and the split."""
    bm = bucket(rows)
    bn, warps, stages = TABLE[bm]
    bk = min(BLOCK_K, group)
    return Config(bm, bn, bk, split_k(nout, ncols, bk, sms), warps, stages)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check(config: Config, ncols: int, group: int) -> None:
    """Raises ValueError for a launch shape that tl.dot, the group or the input dimension cannot take."""
    c = config
    ok = (all(_pow2(v) for v in (c.block_m, c.block_n, c.block_k, c.warps)) and c.block_m >= 16 and c.block_n >= 16
          and c.block_k >= 32 and group % c.block_k == 0 and c.split_k >= 1 and c.stages >= 1
          and ncols % (c.block_k * c.split_k) == 0)
    if not ok:
        raise ValueError(f"bad int4 Triton config {config} for {ncols} columns in groups of {group}: blocks are powers "
                         f"of two, block_m and block_n >= 16, block_k >= 32 dividing the group, split_k dividing the "
                         f"steps")


def _codes_asm(kind: str, magic: int, one: int) -> str:
    """PTX turning four packed bytes ($4) into their eight codes minus the zero point, as `kind` (bf16 or f16) pairs:
    the low nibbles of bytes 0-1 and 2-3 ($0, $1) and the high ones ($2, $3); $5 and $6 hold -(magic + z) for bytes 0-1
    and 2-3. A byte pair is spread into the two 16-bit halves of a register (prmt), a nibble is masked into the
    mantissa of `magic` (lop3 0xEA: (a & b) | c, the float magic + q, exact), and one fma by 1.0 adds -(magic + z):
    q - z, exact. Six instructions for four codes: the loop went from 7.8 instructions a code with Triton's own int8
    arithmetic to 3.1 (sm_90, docs/adr/0005-int4-gemv.md)."""
    return f"""{{
.reg .b32 t0, t1, s0, s1, m0, m1, m2, m3, one;
mov.b32 one, {one:#010x};
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
shr.b32 s0, t0, 4;
shr.b32 s1, t1, 4;
lop3.b32 m0, t0, 0x000F000F, {magic:#010x}, 0xEA;
lop3.b32 m1, t1, 0x000F000F, {magic:#010x}, 0xEA;
lop3.b32 m2, s0, 0x000F000F, {magic:#010x}, 0xEA;
lop3.b32 m3, s1, 0x000F000F, {magic:#010x}, 0xEA;
fma.rn.{kind}x2 $0, m0, one, $5;
fma.rn.{kind}x2 $1, m1, one, $6;
fma.rn.{kind}x2 $2, m2, one, $5;
fma.rn.{kind}x2 $3, m3, one, $6;
}}"""


# (asm, magic value) by activation dtype: bf16 128 (0x4300: 7 mantissa bits hold a nibble), fp16 1024 (0x6400)
_ASM = {torch.bfloat16: (_codes_asm("bf16", 0x43004300, 0x3F803F80), 128.0),
        torch.float16: (_codes_asm("f16", 0x64006400, 0x3C003C00), 1024.0)}


@triton.jit
def _int4_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr,  # see int4_triton for shapes and dtypes
    M, N, stride_xm, stride_qn, stride_qk, stride_sn, stride_zn,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    STEPS: tl.constexpr, SPLIT_K: tl.constexpr, ASM: tl.constexpr, MAGIC: tl.constexpr, PRECISION: tl.constexpr,
):
    HALF: tl.constexpr = BLOCK_K // 2
    pid_m = tl.program_id(0)  # fastest: the row tiles of one output tile run together and share its weight in L2
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    first = pid_k * STEPS  # every split has STEPS steps (a constant trip count for the pipeliner)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (first * BLOCK_K + tl.arange(0, BLOCK_K))[None, :]
    # a step's bytes of row n: stride_qk apart from one step to the next (HALF in the row-major layout, N * HALF in
    # the k-blocked one, where a step's BLOCK_N rows are one contiguous run)
    q_ptrs = qw_ptr + offs_n[:, None] * stride_qn + first * stride_qk + tl.arange(0, HALF)[None, :]
    xdt = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    g = first * BLOCK_K // GROUP
    s_next = tl.load(s_ptr + offs_n * stride_sn + g, mask=mask_n, other=0.0).to(tl.float32)  # [BLOCK_N]
    z_next = tl.load(z_ptr + offs_n * stride_zn + g, mask=mask_n, other=0).to(tl.float32)  # [BLOCK_N]
    for i in range(STEPS):
        x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)  # [BLOCK_M, BLOCK_K]
        xe, xo = tl.split(tl.reshape(x, (BLOCK_M, HALF, 2)))  # even and odd columns, [BLOCK_M, HALF] each
        b = tl.load(q_ptrs, mask=mask_n[:, None], other=0)  # [BLOCK_N, HALF] uint8
        # this step's scales and zero points were loaded a step ahead; load the next step's now, so their scattered
        # 2-byte loads (one a row) wait behind this step's work instead of heading its chain (9-22% on the H200)
        s, z = s_next, z_next
        more = i + 1 < STEPS
        g = (first + i + 1) * BLOCK_K // GROUP
        s_next = tl.load(s_ptr + offs_n * stride_sn + g, mask=mask_n & more, other=0.0).to(tl.float32)  # [BLOCK_N]
        z_next = tl.load(z_ptr + offs_n * stride_zn + g, mask=mask_n & more, other=0).to(tl.float32)  # [BLOCK_N]
        if ASM == "":  # fp32 activations, and Triton's interpreter
            lo = ((b & 0xF).to(tl.float32) - z[:, None]).to(xdt)
            hi = ((b >> 4).to(tl.float32) - z[:, None]).to(xdt)
        else:
            zm = (-(z + MAGIC)).to(xdt)[:, None]
            lo, hi = tl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,r,r,r", [b, zm], (xdt, xdt), True, 4)
        part = tl.dot(xe, tl.trans(lo), input_precision=PRECISION)
        part = tl.dot(xo, tl.trans(hi), part, input_precision=PRECISION)
        acc += part * s[None, :]
        x_ptrs += BLOCK_K
        q_ptrs += stride_qk
    offs = offs_m[:, None] * N + offs_n[None, :]  # the output [M, N] and each split's partials [M, N]
    mask = mask_m[:, None] & mask_n[None, :]
    store_split(acc, out_ptr, ws_ptr, cnt_ptr + pid_n * tl.num_programs(0) + pid_m, offs, mask, pid_k, M, N, SPLIT_K)


def k_blocked(qweight: torch.Tensor, block_k: int) -> torch.Tensor:
    """qweight uint8 [out, in/2] (the format's row-major codes) -> [in/block_k, out, block_k/2], contiguous: the same
    bytes with each K step's codes of every output row in one run, so a program's step reads BLOCK_N x block_k/2
    contiguous bytes instead of BLOCK_N runs of block_k/2 bytes a row apart. `int4_triton` takes either layout."""
    out, half = qweight.shape
    if block_k % 2 or (2 * half) % block_k:
        raise ValueError(f"k_blocked: {2 * half} input columns are not a multiple of block_k = {block_k}")
    return qweight.reshape(out, 2 * half // block_k, block_k // 2).transpose(0, 1).contiguous()


def int4_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
                config: Config | None = None) -> torch.Tensor:
    """x [..., in] (bf16, fp16 or fp32) @ W^T -> [..., out] in x.dtype, for W given as qweight uint8 [out, in/2]
    (or the same codes `k_blocked`: [in/block_k, out, block_k/2], block_k the launch's), scales [out, in/group]
    (fp16, bf16 or fp32) and qzeros uint8 [out, in/group], all on x's device (CUDA, or the CPU under Triton's
    interpreter). `config` overrides the table (benchmarks); its block_k and split_k change the order of the sums.
    Asynchronous, on torch's current stream; no host read; allocates the output and, when split, the partial sums."""
    ncols = x.shape[-1]
    blocked = qweight.dim() == 3
    nout = qweight.shape[1] if blocked else qweight.shape[0]
    lead = x.shape[:-1]
    groups = scales.shape[-1]
    if (x.dtype not in _DTYPES or qweight.dtype != torch.uint8 or qweight.shape[0 if blocked else 1] * 2
            * (qweight.shape[2] if blocked else 1) != ncols or groups == 0 or ncols % groups
            or qzeros.shape != scales.shape or scales.shape[0] != nout):
        raise ValueError(f"int4_triton takes x [..., in] in bf16, fp16 or fp32 and a packed weight of in columns; got "
                         f"x {tuple(x.shape)} {x.dtype}, qweight {tuple(qweight.shape)} {qweight.dtype}, scales "
                         f"{tuple(scales.shape)}, qzeros {tuple(qzeros.shape)}")
    group = ncols // groups
    rows = x.reshape(-1, ncols)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    nrows = rows.shape[0]
    out = torch.empty((nrows, nout), dtype=x.dtype, device=x.device)  # [rows, out] x.dtype
    if nrows == 0 or nout == 0:
        return out.reshape(*lead, nout)
    cfg = config if config is not None else choose(nrows, nout, ncols, group, sm_count(x.device))
    check(cfg, ncols, group)
    if blocked and qweight.shape[2] * 2 != cfg.block_k:
        raise ValueError(f"a k-blocked weight of steps of {qweight.shape[2] * 2} columns needs block_k = that; the "
                         f"launch has {cfg.block_k}")
    qweight, scales, qzeros = (t if t.stride(-1) == 1 else t.contiguous() for t in (qweight, scales, qzeros))
    # bytes between output rows, and between one K step of a row and the next
    stride_qn, stride_qk = (qweight.stride(1), qweight.stride(0)) if blocked else (qweight.stride(0), cfg.block_k // 2)
    # the PTX dequantization on a GPU for 16-bit activations; Triton's own arithmetic for fp32 and in the interpreter
    asm, magic = _ASM.get(x.dtype, ("", 0.0)) if x.is_cuda else ("", 0.0)
    grid = (math.ceil(nrows / cfg.block_m), math.ceil(nout / cfg.block_n), cfg.split_k)
    if cfg.split_k > 1:
        if grid[0] * grid[1] > SPLIT_COUNTERS:
            raise ValueError(f"{grid[0] * grid[1]} tiles split over K exceed the {SPLIT_COUNTERS} counters")
        ws = torch.empty((cfg.split_k, nrows, nout), dtype=torch.float32, device=x.device)  # [splits, rows, out]
        counters = split_counters(x.device)  # [SPLIT_COUNTERS] int32
    else:
        ws = counters = out  # not read: the unsplit variant has no workspace
    _int4_kernel[grid](
        rows, qweight, scales, qzeros, out, ws, counters,
        nrows, nout, rows.stride(0), stride_qn, stride_qk, scales.stride(0), qzeros.stride(0),
        GROUP=group, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        STEPS=ncols // (cfg.block_k * cfg.split_k), SPLIT_K=cfg.split_k,
        ASM=asm, MAGIC=magic, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.warps, num_stages=cfg.stages,
    )
    return out.reshape(*lead, nout)
