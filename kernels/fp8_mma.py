"""The FP8 GEMV/GEMM with the weight as the tensor cores' 16-row operand: x [rows, in] @ (W * scale)^T for an e4m3 W
[out, in] as stored (one fp32 scale an output feature), for the 1 to 64 rows of decode and verify rounds.

Owns: `fits`, `usable` and `fp8_mma` (the launch on torch's current stream, capturable). Does not own: the format and
its reference (ignis.quant.fp8), the kernel source (ignis.kernels.fp8_mma_kernel), the split of the input and the
rest of the launch shape (ignis.kernels.int4_mma's `choose` and `launch`, which this kernel shares), compiling
(ignis.kernels.nvrtc), or when this kernel runs (ignis.quant.fp8.fp8_linear).

Why: the Triton kernel (ignis.kernels.gemv_triton) widens the codes in shared memory tiles of 16 activation rows; at a
decode's one to eight rows it ran the 27B's decode step at 1.89x its bytes (BENCHMARKS.md). Here each lane loads
the 16 bytes of codes its mma operands need straight into registers, as int4_mma does with its repacked nibbles, so
no repacking: the weight stays the [out, in] codes that prefill's torch._scaled_mm reads.

Numerics: every e4m3 code and every x is an exact bf16/fp16 operand, every product exact and every sum fp32 (the
tensor cores, then the warps' and blocks' partial sums in a fixed order); the feature's scale multiplies its fp32
total and the result is rounded once to x's dtype. A row's result does not depend on how many rows share the call:
the order of the sums comes from the weight's shape alone (int4_mma.choose).
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import lru_cache

import torch

from ignis.kernels import launch as launches
from ignis.kernels.fp8_mma_kernel import SOURCE
from ignis.kernels.int4_mma import ROW_TILES, Shape, choose, launch, row_tiles
from ignis.kernels.launch import SPLIT_COUNTERS, pdl, sm_count, split_counters

MAX_ROWS = 64  # activation rows a call takes: NT tiles of 8, NT <= 8
ACTIVATIONS = (torch.bfloat16, torch.float16)
CHUNK = 64  # input columns a chunk: the split's unit of work, as int4_mma's groups of 64


def fits(nout: int, ncols: int) -> bool:
    """Whether the kernel takes a weight [nout, ncols]: 16-feature blocks, 64-column chunks."""
    return nout > 0 and ncols > 0 and nout % 16 == 0 and ncols % CHUNK == 0


@lru_cache(maxsize=16)
def usable(device: torch.device) -> bool:
    """Whether the kernel runs on `device`: CUDA with e4m3 conversions (sm_89 or newer)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _function(device: torch.device, nt: int, shape: Shape, dtype: torch.dtype, early: bool) -> object:
    from ignis.kernels.nvrtc import load

    return load(SOURCE, "fp8_mma", defines(nt, shape, dtype, early), device)


def defines(nt: int, shape: Shape, dtype: torch.dtype, early: bool = False) -> tuple[tuple[str, int], ...]:
    """The kernel's macros for NT row tiles (a call's, before RG splits them) and the launch `shape`."""
    return (("NT", nt // shape.rg), ("F", shape.f), ("U", shape.u), ("AHEAD", shape.ahead), ("KS", shape.ks),
            ("KW", shape.kw), ("RB", shape.rb), ("RG", shape.rg), ("GPC", 1), ("F16", int(dtype == torch.float16)),
            ("SBF16", 0), ("PDL", int(early)), ("TRIGGER", int(early and launches.EARLY_TRIGGER)))


def fp8_mma(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, shape: Shape | None = None) -> torch.Tensor:
    """x [..., in] (bf16 or fp16, CUDA, at most MAX_ROWS rows) @ (weight * scale[:, None])^T -> [..., out] in x's
    dtype, for weight float8_e4m3fn [out, in] (rows contiguous) and scale float32 [out]. `shape` overrides
    int4_mma's `choose` and `launch` (benchmarks; its KW and unit change the order of the sums). Asynchronous, on
    torch's current stream; no host read; allocates the output."""
    nout, ncols = weight.shape
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    if (x.dtype not in ACTIVATIONS or weight.dtype != torch.float8_e4m3fn or x.shape[-1] != ncols
            or scale.shape != (nout,) or scale.dtype != torch.float32 or not fits(nout, ncols) or not x.is_cuda
            or rows.shape[0] > MAX_ROWS or weight.device != x.device or scale.device != x.device
            or weight.stride(1) != 1 or weight.stride(0) != ncols or weight.data_ptr() % 16):
        raise ValueError(f"fp8_mma takes x [..., in] in bf16 or fp16 on CUDA (at most {MAX_ROWS} rows), an e4m3 "
                         f"weight [out, in] with rows contiguous (out a multiple of 16, in of {CHUNK}) and an fp32 "
                         f"scale [out] on x's device; got x {tuple(x.shape)} {x.dtype} on {x.device}, weight "
                         f"{tuple(weight.shape)} {weight.dtype} strides {weight.stride()}, scale "
                         f"{tuple(scale.shape)} {scale.dtype}")
    if rows.stride(-1) != 1 or rows.stride(0) % 8 or rows.data_ptr() % 16:
        rows = rows.contiguous()  # 16-byte loads of x
    nrows = rows.shape[0]
    out = torch.empty((nrows, nout), dtype=x.dtype, device=x.device)
    if nrows == 0:
        return out.reshape(*lead, nout)
    nt = row_tiles(nrows)
    early = pdl(x.device)
    s = shape if shape is not None else launch(choose(nout, ncols, CHUNK, sm_count(x.device)), nt)
    s = replace(s, rg=min(s.rg, nt))  # no block of threads without rows
    if s.rg not in ROW_TILES:
        raise ValueError(f"fp8_mma splits the rows over 1, 2, 4 or 8 blocks of threads, got RG {s.rg}")
    fn = _function(x.device, nt, s, x.dtype, early)
    grid = (math.ceil(nout // 16 / (s.rb * s.f)) * s.rg, s.ks, 1)
    if s.ks > 1:
        if grid[0] > SPLIT_COUNTERS:
            raise ValueError(f"{grid[0]} blocks of threads split over the input exceed the {SPLIT_COUNTERS} counters")
        ws = torch.empty((s.ks, nrows, nout), dtype=torch.float32, device=x.device)  # [ks, rows, out] partials
        cnt = split_counters(x.device)  # [SPLIT_COUNTERS] int32, zero between calls
    else:
        ws, cnt = out, out  # not read
    fn(grid, 32 * s.kw * s.rb,  # type: ignore[operator]
       (weight, scale, rows, out, ws, cnt, nrows, nout, ncols, rows.stride(0), s.unit), early)
    return out.reshape(*lead, nout)
