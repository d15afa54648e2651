"""Weight-streaming GEMV/GEMM in Triton for the 1 to 64 rows of decode and verify rounds: x [rows, in] @ W^T in one
pass over W, for an FP8 W (e4m3 codes, one scale per output row: `fp8_gemv`) or a dense W of few output rows (a
quantized Gated DeltaNet's gates: `dense_gemv`).

Owns: the launches (on torch's current stream), the kernel body and its launch shape (`Config`, `choose`). Does not
own: the fp8 format and its reference (ignis.quant.fp8: `quantize_fp8`, `fp8_linear_reference`), when these run
(ignis.quant.fp8.fp8_linear up to its FP8_TRITON_ROWS rows; ignis.model.ops.gate_linear) or the split-K epilogue
(ignis.kernels.split_k_triton).

Why: torch._scaled_mm, which fp8 weights went through, quantizes each activation row to e4m3 (an abs-max reduction, a
division, a clamp and a cast: four launches beside the product) and its cuBLAS kernels tile rows by 128, so at a
decode's few rows it read the weight at a third of the bandwidth: the 27B-shape decode step was 0.64-0.71x as fast as
bf16 (BENCHMARKS.md). And cuBLAS runs a 96-row dense product (the gates) as a split-K GEMM plus a reduction kernel,
6 µs a layer for 1 MB. Here a program owns BLOCK_M rows (masked to at least 16, so tl.dot runs mma.sync), BLOCK_N output
rows and one K split; a step loads a [BLOCK_N, BLOCK_K] tile of W, widens fp8 codes to x's dtype (exact: every e4m3
value is a bf16 value) and adds x @ W^T in fp32 on tensor cores; an fp8 row scale multiplies the fp32 sum once at the
end and the output is rounded once. So the result is the float64 product up to the order of fp32 additions and one
rounding (`fp8_linear_reference`, the CPU's, rounds each dequantized weight to x's dtype first).

BLOCK_K and the split come from the weight's shape alone, and row tiles are 16 rows on mma.sync, so a row's result
does not depend on how many rows share the call. A launch of wider row tiles (`Config.block_m`: 32 or 64, for a
verify's 64 rows, where 16-row tiles read each weight tile four times) is for benchmarks to weigh: its sums are
ordered differently, so its rows do depend on the batch. With ignis.kernels.launch.PDL on a Hopper GPU a launch may
start while the kernel before it finishes: it loads its first weight tile, waits for that kernel, then reads x, and
lets the next kernel launch before its epilogue (the sums are the same). Importing this module imports triton; its
callers import it only when a product takes this path. Without a GPU, TRITON_INTERPRET=1 runs the kernel on CPU tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from ignis.kernels import launch
from ignis.kernels.launch import SPLIT_COUNTERS, pdl, sm_count, split_counters
from ignis.kernels.split_k_triton import store_split

BLOCK_M = 16  # rows a program by default: mma.sync's tile (a 64-row wgmma tile adds a product's terms differently)
PROGRAMS_PER_SM = 4  # what the K split aims at
MIN_SPLIT_STEPS = 4  # K steps a split reads at least
MAX_SPLITS = 16


@dataclass(frozen=True)
class Config:
    """A launch shape; block_k and split_k fix the order of the sums, so they depend on the weight's shape only."""

    block_n: int  # output rows a program
    block_k: int  # input columns a step
    split_k: int  # programs along the input dimension (1: no split); divides the steps
    warps: int
    stages: int
    block_m: int = BLOCK_M  # rows a program (16, 32 or 64)


def fits(nout: int, ncols: int) -> bool:
    """Shapes the kernel takes: whole steps of 128 input columns."""
    return nout > 0 and ncols > 0 and ncols % 128 == 0


@lru_cache(maxsize=256)
def choose(nout: int, ncols: int, sms: int) -> Config:
    """64 output rows and 128 input columns a step (8 KiB of codes a stage, four stages in flight) and the split
    `plan` gives them: the launch every product takes."""
    return plan(nout, ncols, sms)


def plan(nout: int, ncols: int, sms: int, block_n: int = 64, block_k: int = 128,
         programs_per_sm: int = PROGRAMS_PER_SM, warps: int = 4, stages: int = 4, block_m: int = BLOCK_M) -> Config:
    """A launch of these tiles whose K split is the least divisor of the steps giving every SM `programs_per_sm`
    programs where the output tiles alone do not, at most MAX_SPLITS and none shorter than MIN_SPLIT_STEPS steps
    (`choose` with its defaults; benchmarks try others)."""
    tiles = math.ceil(nout / block_n)
    steps = ncols // block_k
    want = math.ceil(programs_per_sm * sms / tiles)
    divisors = [d for d in range(1, min(MAX_SPLITS, steps // MIN_SPLIT_STEPS) + 1) if steps % d == 0] or [1]
    return Config(block_n, block_k, next((d for d in divisors if d >= want), divisors[-1]), warps, stages, block_m)


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K] bf16/fp16/fp32, rows contiguous
    w_ptr,  # [N, K] float8_e4m3fn codes, or x's dtype; rows contiguous
    s_ptr,  # [N] fp32: each output row's scale (SCALED only)
    out_ptr, ws_ptr, cnt_ptr,  # [M, N] x's dtype; [SPLIT_K, M, N] fp32; split counters int32
    M, N, stride_xm, stride_wn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STEPS: tl.constexpr,
    SPLIT_K: tl.constexpr, SCALED: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = False,
    EARLY: tl.constexpr = False,
):
    pid_m = tl.program_id(0)  # fastest: the row tiles of one output tile run together and share its codes in L2
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    cols = pid_k * STEPS * BLOCK_K + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + cols[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + cols[None, :]
    xdt = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = 0
    if PDL:
        # Launched ahead of the kernel before it (launch.PDL): the weight is not that kernel's output, so the first
        # step's tile loads while it finishes; x only after the wait. The same steps in the same order as unlaunched.
        w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
        if EARLY:  # launch.EARLY_TRIGGER: the next kernel may launch and load its own weight while this one streams
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
        x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w.to(xdt)), acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        first = 1
    for _ in range(first, STEPS):
        x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)  # [BLOCK_N, BLOCK_K] e4m3 or x's dtype
        acc = tl.dot(x, tl.trans(w.to(xdt)), acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may launch; it waits for these stores to read them
    if SCALED:
        acc = acc * tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    offs = offs_m[:, None] * N + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    store_split(acc, out_ptr, ws_ptr, cnt_ptr + pid_n * tl.num_programs(0) + pid_m, offs, mask, pid_k, M, N, SPLIT_K)


_ACTIVATIONS = (torch.bfloat16, torch.float16, torch.float32)


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, config: Config | None = None) -> torch.Tensor:
    """x [..., in] (bf16, fp16 or fp32) @ (weight * scale[:, None])^T -> [..., out] in x's dtype, for weight
    float8_e4m3fn [out, in] and scale fp32 [out], on x's device (CUDA, or the CPU under Triton's interpreter). `config`
    overrides `choose` (benchmarks); its block_k and split_k change the order of the sums. Asynchronous, on torch's
    current stream; no host read; allocates the output and, when split, the partial sums."""
    nout, ncols = weight.shape[0], x.shape[-1]
    if (x.dtype not in _ACTIVATIONS or weight.dtype != torch.float8_e4m3fn or weight.shape[1] != ncols
            or scale.shape != (nout,) or scale.dtype != torch.float32 or not fits(nout, ncols)):
        raise ValueError(f"fp8_gemv takes x [..., in] (in a multiple of 128) in bf16, fp16 or fp32, an e4m3 weight "
                         f"[out, in] and an fp32 scale [out]; got x {tuple(x.shape)} {x.dtype}, "
                         f"weight {tuple(weight.shape)} {weight.dtype}, scale {tuple(scale.shape)} {scale.dtype}")
    return _gemv(x, weight, scale, config)


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, config: Config | None = None) -> torch.Tensor:
    """x [..., in] @ weight^T -> [..., out] for a weight [out, in] in x's dtype (bf16, fp16 or fp32), as `fp8_gemv`
    computes it without the scale."""
    nout, ncols = weight.shape[0], x.shape[-1]
    if x.dtype not in _ACTIVATIONS or weight.dtype != x.dtype or weight.shape[1] != ncols or not fits(nout, ncols):
        raise ValueError(f"dense_gemv takes x [..., in] (in a multiple of 128) in bf16, fp16 or fp32 and a weight "
                         f"[out, in] of x's dtype; got x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} "
                         f"{weight.dtype}")
    return _gemv(x, weight, None, config)


def _gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, config: Config | None) -> torch.Tensor:
    ncols = x.shape[-1]
    nout = weight.shape[0]
    lead = x.shape[:-1]
    rows = x.reshape(-1, ncols)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    nrows = rows.shape[0]
    out = torch.empty((nrows, nout), dtype=x.dtype, device=x.device)
    if nrows == 0:
        return out.reshape(*lead, nout)
    cfg = config if config is not None else choose(nout, ncols, sm_count(x.device))
    steps = ncols // cfg.block_k
    if ncols % cfg.block_k or steps % cfg.split_k or cfg.block_m not in (16, 32, 64):
        raise ValueError(f"gemv config {cfg}: block_k must divide {ncols} columns, split_k the steps, and block_m "
                         f"be 16, 32 or 64")
    grid = (math.ceil(nrows / cfg.block_m), math.ceil(nout / cfg.block_n), cfg.split_k)
    if cfg.split_k > 1:
        if grid[0] * grid[1] > SPLIT_COUNTERS:
            raise ValueError(f"{grid[0] * grid[1]} tiles split over K exceed the {SPLIT_COUNTERS} counters")
        ws = torch.empty((cfg.split_k, nrows, nout), dtype=torch.float32, device=x.device)
        counters = split_counters(x.device)
    else:
        ws = counters = out  # not read: the unsplit variant has no workspace
    early = {"PDL": True, "launch_pdl": True, "EARLY": launch.EARLY_TRIGGER} if pdl(x.device) else {}
    _gemv_kernel[grid](
        rows, weight, weight if scale is None else scale, out, ws, counters, nrows, nout, rows.stride(0),
        weight.stride(0), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, STEPS=steps // cfg.split_k,
        SPLIT_K=cfg.split_k, SCALED=scale is not None, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.warps, num_stages=cfg.stages, **early,
    )
    return out.reshape(*lead, nout)
