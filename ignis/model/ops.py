"""Numerical building blocks of the hybrid model, with an `exact` mode whose per-row results never depend on the batch.

Owns: the linear projection, the activations, the two RMSNorm flavours (and `RMSNorm`, the module), RoPE tables
and rotation, and `Step` (what every layer needs to know about one forward). Does not own: layers
(ignis.model.attention, ignis.model.gdn) or state (ignis.model.cache).

Why `exact` exists: on CPU, MKL's GEMM gives a row a different rounding depending on how many rows share the call
(measured: M in {1,2,3,5,6,7,9,10,11} differ, M = 4, 8 and every M >= 12 agree), so exact linears pad to 16 rows.
ATen's sigmoid, silu and softplus run the scalar libm path on the tail of a buffer and the vector path elsewhere, so
an element's rounding depends on where it sits; exact mode composes them from exp, log1p and division, whose CPU
kernels use the vector path everywhere. Elementwise arithmetic and last-dim reductions are row-invariant as they are.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeAlias

import torch
import torch.nn.functional as F
from torch import nn

from ignis.kernels.int4_mma import MmaCodes
from ignis.kernels.launch import triton_installed
from ignis.model.batch import Segment
from ignis.quant.fp8 import Fp8Linear, Fp8Weight, fp8_linear, fuse_fp8
from ignis.quant.linear import (
    PACKED,
    PackedWeight,
    Permuted,
    QuantLinear,
    fuse_packed,
    packed_linear,
    packed_swiglu,
)

EXACT_MIN_ROWS = 16
LT_MIN_ROWS = 17  # a CUDA round of at least this many rows runs its dense products through cuBLASLt (`products_for`)
STREAM_ROWS = 16  # the most rows of a dense product `streamed` may send to the Triton weight-streaming kernel
# Whether `linear` sends the products `streamed` picks to that kernel: off until a whole round measures it faster
# (tools.bench_round --stream off,on); set once, before the engine captures its graphs.
STREAMING = False
# a projection's weight: dense, 4-bit packed (the format's order or the mma kernel's) or fp8 (ignis.quant)
Weight: TypeAlias = torch.Tensor | PackedWeight | MmaCodes | Permuted | Fp8Weight


def linear(x: torch.Tensor, weight: Weight, exact: bool) -> torch.Tensor:
    """x [..., in] @ weight[out, in]^T -> [..., out]; in exact mode each row's bits do not depend on the row count.
    Packed weights go through `packed_linear` (the 4-bit kernel's seam) and fp8 weights through `fp8_linear`."""
    if isinstance(weight, PACKED):
        if exact:  # the dequantized weight is the same for any row count, so padding keeps rows exact as for dense
            return linear(x, weight.dequantize(), True)
        return packed_linear(x, weight)
    if isinstance(weight, Fp8Weight):
        if exact:
            return linear(x, weight.dequantize(x.dtype), True)
        return fp8_linear(x, weight)
    if not exact:
        if STREAMING and streamed(x, weight):
            from ignis.kernels.gemv_triton import dense_gemv

            return dense_gemv(x, weight)
        return F.linear(x, weight)
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    if m < EXACT_MIN_ROWS:
        rows = torch.cat([rows, rows.new_zeros(EXACT_MIN_ROWS - m, rows.shape[1])])
    else:
        rows = rows.contiguous()
    return F.linear(rows, weight)[:m].reshape(*lead, weight.shape[0])


def stream_shape(rows: int, nout: int, ncols: int) -> bool:
    """The dense products that ran faster through ignis.kernels.gemv_triton.dense_gemv than through cuBLAS on the H200
    (tools.bench_gemv, the 27B shapes at 1 and 8 rows, the kernel's own launch): at most STREAM_ROWS rows of a weight
    whose input is at least three times its output (the MLP's down projection, 17,408 -> 5,120: 47.3 against 49.6 µs
    at one row, 49.3 against 51.9 at eight) or of at least 65,536 output rows (an output head, 248,320 x 5,120: 573
    against 616 µs, 578 against 622). The others ran as fast or faster through cuBLAS (o_proj 20.3 against 17.8 µs,
    in_proj 45.6 against 40.9)."""
    return rows <= STREAM_ROWS and ncols % 128 == 0 and (ncols >= 3 * nout or nout >= 65536)


@functools.cache
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def streamed(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x @ weight^T is one of `stream_shape`'s products, in bf16 on an sm_90 GPU (where it was measured) with
    Triton installed."""
    ncols = x.shape[-1]
    return (x.is_cuda and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
            and stream_shape(x.numel() // max(ncols, 1), weight.shape[0], ncols) and triton_installed()
            and _sm90(x.device.index if x.device.index is not None else torch.cuda.current_device()))


@contextmanager
def products_for(rows: int, device: torch.device) -> Iterator[None]:
    """torch's BLAS library for the dense products of a round of `rows` rows on `device`: cuBLASLt from LT_MIN_ROWS
    rows on CUDA, else what it was. Set while a round runs or is captured, so its graph keeps the kernels chosen.
    On the H200 at the 27B shape (64 rows: 8 lanes x 8 columns), cuBLASLt runs mlp down in 45.3 µs against cuBLAS's
    52.2 plus its split-K reduction, and o_proj as fast without one; at 1 and 8 rows the two tie or cuBLAS wins (a
    1 x 8 verify: 15.61 ms a round under cuBLAS, 15.90 under cuBLASLt)."""
    if device.type != "cuda" or rows < LT_MIN_ROWS:
        yield
        return
    with blas_library("cublaslt"):
        yield


@contextmanager
def blas_library(name: str) -> Iterator[None]:
    """torch's preferred BLAS library set to `name` ("cublas", "cublaslt") inside the block, and put back after."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def dense(weight: Weight, dtype: torch.dtype) -> torch.Tensor:
    """The weight as a dense [out, in] tensor of `dtype`: a packed or fp8 one dequantized (a copy), a dense one cast."""
    if isinstance(weight, PACKED):
        return weight.dequantize().to(dtype)
    if isinstance(weight, Fp8Weight):
        return weight.dequantize(dtype)
    return weight.to(dtype)


def sigmoid(x: torch.Tensor, exact: bool) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x)) if exact else torch.sigmoid(x)


def silu(x: torch.Tensor, exact: bool) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x)) if exact else F.silu(x)


def softplus(x: torch.Tensor, exact: bool) -> torch.Tensor:
    if not exact:
        return F.softplus(x)
    # Same threshold as F.softplus (beta=1, threshold=20): linear above it.
    return torch.where(x > 20.0, x, torch.log1p(torch.exp(x)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm: x / rms(x) * (1 + w), in fp32, cast back (HF Qwen3_5RMSNorm)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm as a module, so its weight carries the checkpoint's name (`input_layernorm.weight`).

    After `fuse` (models not in exact mode) it runs as torch's own rms_norm with the weight 1 + w made once."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))
        self.scale: torch.Tensor | None = None  # [dim] float32: 1 + weight, once fused

    def fuse(self) -> None:
        self.scale = 1.0 + self.weight.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is not None:
            return F.rms_norm(x.float(), (x.shape[-1],), self.scale, self.eps).to(x.dtype)
        return rms_norm(x, self.weight, self.eps)


def fuse_weights(*linears: nn.Module) -> Weight | None:
    """`fuse_rows` for projections that may be packed or fp8 (ignis.quant): packed (fp8) linears join into one packed
    (fp8) weight; None (left unfused) when dense and packed are mixed, as in a quantized Gated DeltaNet, whose small
    gate projections keep their precision and so cannot share the packed matrix."""
    dense = [m for m in linears if isinstance(m, nn.Linear)]
    packed = [m for m in linears if isinstance(m, QuantLinear)]
    fp8 = [m for m in linears if isinstance(m, Fp8Linear)]
    if len(dense) == len(linears):
        return fuse_rows(*dense)
    if len(packed) == len(linears):
        return fuse_packed(tuple(packed))
    if len(fp8) == len(linears):
        return fuse_fp8(tuple(fp8))
    return None


def swiglu_linear(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """silu(gate) * up [..., I] of x @ weight^T for an MLP's fused gate | up weight [2 I, in]: one launch where a
    repacked 4-bit weight takes it (ignis.quant.linear.packed_swiglu), else the product and the SwiGLU kernel."""
    if isinstance(weight, MmaCodes):
        y = packed_swiglu(x, weight)
        if y is not None:
            return y
    from ignis.kernels import fused

    return fused.swiglu(linear(x, weight, False))


GATE_ROWS = 64  # the most activation rows `gate_linear` sends to the Triton kernel (decode and verify rounds)


def gate_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T for a dense weight of few output rows beside quantized projections (a quantized Gated DeltaNet's
    gates b | a): on CUDA at decode and verify rows one Triton launch (ignis.kernels.gemv_triton.dense_gemv), where
    cuBLAS runs a split-K GEMM and a reduction; F.linear elsewhere."""
    if (x.is_cuda and x.numel() <= GATE_ROWS * x.shape[-1] and x.shape[-1] % 128 == 0 and x.dtype == weight.dtype
            and triton_installed()):
        from ignis.kernels.gemv_triton import dense_gemv

        return dense_gemv(x, weight)
    return F.linear(x, weight)


def fuse_rows(*linears: nn.Linear, out: torch.Tensor | None = None) -> torch.Tensor:
    """One weight [sum(out), in] holding the rows of `linears`, which keep their parameters as views of it: the
    projections that read the same input become one matrix product, with no extra memory. With `out` (that shape),
    the rows are held there, say one slice of a larger buffer."""
    weight = torch.cat([m.weight.detach() for m in linears], out=out)
    offset = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(weight[offset : offset + n], requires_grad=False)
        offset += n
    return weight


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, exact: bool) -> torch.Tensor:
    """GDN output norm: w * (x / rms(x)) * silu(gate); plain w (not 1 + w), norm before gate, as HF's
    Qwen3_5RMSNormGated."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(x.dtype)
    return (h * silu(gate.float(), exact)).to(x.dtype)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


class Rope:
    """Partial rotate-half RoPE over the first `rotary_dim` dims of each head. Qwen3.5's interleaved M-RoPE reduces to
    this for text, where the temporal, height and width positions are equal."""

    def __init__(self, rotary_dim: int, theta: float) -> None:
        # Built on the CPU explicitly: models are constructed under torch.device("meta") by the loader.
        steps = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device="cpu") / rotary_dim
        self._inv_freq = 1.0 / (theta**steps)  # [rotary_dim / 2] float32, cpu
        self._on: dict[torch.device, torch.Tensor] = {}
        self._table: torch.Tensor | None = None  # [2, n, rotary_dim]: cos then sin of each position, once precomputed

    def precompute(self, n: int, device: torch.device, dtype: torch.dtype) -> None:
        """Tabulate positions 0..n-1 once: `tables` then looks rows up (one launch instead of seven). The caller
        promises that no position asked for afterwards reaches n (a lookup cannot check without a device read)."""
        self._table = None
        self._table = torch.stack(self.tables(torch.arange(n, device=device), dtype))

    def precomputed(self, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The (cos, sin) [n, rotary_dim] tables `precompute` made, if it made them in this dtype on this device: a
        kernel can read a position's row itself instead of a gathered copy."""
        table = self._held(dtype, device)
        return None if table is None else (table[0], table[1])

    def _held(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """The stacked [2, n, rotary_dim] table `precompute` made, if in this dtype on this device."""
        table = self._table
        return table if table is not None and table.dtype == dtype and table.device == device else None

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> (cos, sin) [T, rotary_dim] in dtype, computed in fp32 like HF."""
        table = self._held(dtype, positions.device)
        if table is not None:
            both = table.index_select(1, positions)  # [2, T, rotary_dim]: both rows of every position, one gather
            return both[0], both[1]
        inv = self._on.get(positions.device)
        if inv is None:
            inv = self._on[positions.device] = self._inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * inv[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, hd]; cos/sin [T, rd] -> x with its first rd dims rotated."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    turned = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    out = rot * cos[:, None, :] + turned * sin[:, None, :]
    return torch.cat([out, rest], dim=-1)


@dataclass(frozen=True)
class RecurrentGroup:
    """Segments run through the per-token recurrent form together (one segment each in exact mode)."""

    segments: tuple[Segment, ...]
    lanes: torch.Tensor  # [n] int64, device
    rows: torch.Tensor  # [n, L] int64, device: batch row of column j of segment i
    record: bool


@dataclass(frozen=True)
class Step:
    """What every layer of one forward needs besides its input rows and its own state."""

    segments: tuple[Segment, ...]
    cos: torch.Tensor  # [T, rotary_dim] model dtype, device
    sin: torch.Tensor  # [T, rotary_dim] model dtype, device
    exact: bool
    recurrent: tuple[RecurrentGroup, ...]  # decode and verify segments: per-token recurrence
    chunked: tuple[Segment, ...]  # prefill segments: chunked delta rule

    @staticmethod
    def build(
        segments: tuple[Segment, ...], positions: torch.Tensor, rope: Rope, dtype: torch.dtype, exact: bool
    ) -> Step:
        cos, sin = rope.tables(positions, dtype)
        device = positions.device
        # Exact mode keeps every segment alone so a lane's arithmetic never sees how many lanes share the batch;
        # otherwise equal-length segments share one batched recurrence.
        buckets: dict[tuple, list[Segment]] = {}
        chunked: list[Segment] = []
        for i, seg in enumerate(segments):
            if not seg.prefill:
                key = (i,) if exact else (seg.length, seg.record)
                buckets.setdefault(key, []).append(seg)
            else:
                chunked.append(seg)
        groups = []
        for segs in buckets.values():
            length = segs[0].length
            lanes = torch.tensor([s.lane for s in segs], dtype=torch.int64, device=device)
            rows = torch.tensor([[s.offset + j for j in range(length)] for s in segs], dtype=torch.int64, device=device)
            groups.append(RecurrentGroup(tuple(segs), lanes, rows, segs[0].record))
        return Step(tuple(segments), cos, sin, exact, tuple(groups), tuple(chunked))
