"""FP8 weights: the decoder projections in float8 e4m3 with one fp32 scale per output channel, made at load time from
a checkpoint in its own precision (`model.weights = "fp8"`, for Hopper and newer GPUs).

Owns: `Fp8Weight` (what a converted projection's `.weight` is), `Fp8Linear` (the module holding it), `to_fp8` (the
load-time conversion of a model's projections), `fp8_linear` (the one function every product with an fp8 weight goes
through) and its reference, and joining fp8 weights by rows (`fuse_fp8`). Does not own: which projections qualify (the
same set as the 4-bit format, ignis.quant.format.quantized_name) or loading (ignis.model.loader).

The product: on CUDA with bf16 activations and up to 64 rows (decode and verify), a kernel that widens the codes to
bf16 on the way to the tensor cores and applies the row scale to the fp32 sum, x unquantized: the CUDA C++ one that
loads each lane's codes straight into its mma registers (ignis.kernels.fp8_mma, `FP8_KERNEL` "mma", where NVRTC and
an sm_89 GPU are there) or the Triton one (ignis.kernels.gemv_triton.fp8_gemv); for more rows, torch._scaled_mm with
row-wise scales. Each activation row is
scaled into e4m3's range by its own absolute maximum (computed on the device, no host read, so it is capturable), the
weight operand is the [in, out] column-major view of the row-major [out, in] codes, and cuBLAS/CUTLASS sums in fp32 and
applies both scales: y[r, o] = sa[r] * sw[o] * sum_c xq[r, c] * wq[o, c]. _scaled_mm wants the inner and output
dimensions to be multiples of 16 (projections that are not keep their precision) and gets its rows padded to a
multiple of 16. Elsewhere (the CPU, other dtypes) the reference: F.linear on the weight dequantized to x's dtype,
with x unquantized.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ignis.kernels.launch import nvrtc_installed, triton_installed
from ignis.quant.format import quantized_name

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite e4m3fn value; e4m3fn has no infinity, so larger values must be clamped
TINY = 2.0**-60  # the smallest scale: a row of zeros stays zeros
ALIGN = 16  # _scaled_mm's multiple for the inner and output dimensions, and the rows we pad to
FP8_TRITON_ROWS = 64  # the most rows a product takes through the decode kernels below (decode and verify rounds)
# Which kernel takes those rows: "mma" (ignis.kernels.fp8_mma, where it runs and takes the shape) or "triton"
# (ignis.kernels.gemv_triton); benchmarks switch it, before any graph is captured.
FP8_KERNEL = "mma"


@dataclass(frozen=True)
class Fp8Weight:
    """A weight [out, in] as e4m3 codes with a scale per output row: W[o, c] ~= weight[o, c] * scale[o]."""

    weight: torch.Tensor  # [out, in] float8_e4m3fn
    scale: torch.Tensor  # [out] float32

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight.float() * self.scale[:, None]).to(dtype)

    def __getitem__(self, rows: slice) -> Fp8Weight:
        return Fp8Weight(self.weight[rows], self.scale[rows])


def quantize_fp8(weight: torch.Tensor) -> Fp8Weight:
    """weight [out, in] (any float dtype, any device) -> its e4m3 form: each row scaled so its largest magnitude is
    E4M3_MAX, rounded to nearest."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / E4M3_MAX).clamp(min=TINY)  # [out] float32
    return Fp8Weight((w / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8), scale)


def fp8_linear_reference(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """x [..., in] @ W^T -> [..., out] with W dequantized to x's dtype."""
    return F.linear(x, weight.dequantize(x.dtype))


def fp8_scaled_linear(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """x [..., in] bf16 @ W^T -> [..., out] bf16 through torch._scaled_mm with row-wise scales (x quantized per row)."""
    ncols, nout = x.shape[-1], weight.weight.shape[0]
    lead = x.shape[:-1]
    rows = x.reshape(-1, ncols)
    m = rows.shape[0]
    if m % ALIGN:
        rows = F.pad(rows, (0, 0, 0, ALIGN - m % ALIGN))  # zero rows: scale TINY, codes 0
    amax = torch.linalg.vector_norm(rows, float("inf"), dim=-1, keepdim=True, dtype=torch.float32)  # [M, 1] float32
    sa = amax.clamp_(min=TINY * E4M3_MAX).div_(E4M3_MAX)  # [M, 1] float32
    xq = (rows / sa).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8)  # [M, in] e4m3, row-major
    y = torch._scaled_mm(xq, weight.weight.t(), scale_a=sa, scale_b=weight.scale.view(1, nout), out_dtype=x.dtype)
    return y[:m].reshape(*lead, nout)


def fp8_linear(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """x [..., in] @ W^T -> [..., out] for an fp8 W. For bf16 CUDA inputs: up to 64 rows (decode and verify rounds)
    a kernel that reads the codes once with x unquantized (`FP8_KERNEL`'s, else the Triton one where Triton is
    installed), more rows (a prefill) _scaled_mm; the reference otherwise."""
    if x.is_cuda and x.dtype == torch.bfloat16:
        if x.numel() <= FP8_TRITON_ROWS * x.shape[-1]:
            if FP8_KERNEL == "mma" and mma_takes(x, weight):
                from ignis.kernels.fp8_mma import fp8_mma

                return fp8_mma(x, weight.weight, weight.scale)
            if x.shape[-1] % 128 == 0 and triton_installed():
                from ignis.kernels.gemv_triton import fp8_gemv

                return fp8_gemv(x, weight.weight, weight.scale)
        return fp8_scaled_linear(x, weight)
    return fp8_linear_reference(x, weight)


def mma_takes(x: torch.Tensor, weight: Fp8Weight) -> bool:
    """Whether ignis.kernels.fp8_mma runs this product: its shapes, a weight of contiguous rows, NVRTC, sm_89+."""
    from ignis.kernels import fp8_mma

    w = weight.weight
    return (fp8_mma.fits(*w.shape) and w.stride() == (w.shape[1], 1) and w.data_ptr() % 16 == 0
            and nvrtc_installed() and fp8_mma.usable(x.device))


class Fp8Linear(nn.Module):
    """A bias-free linear whose weight is stored in e4m3 with a scale per output row (buffers fp8_weight, fp8_scale)."""

    fp8_weight: torch.Tensor
    fp8_scale: torch.Tensor

    def __init__(self, weight: Fp8Weight) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.weight.shape
        self.register_buffer("fp8_weight", weight.weight)
        self.register_buffer("fp8_scale", weight.scale)

    @property
    def weight(self) -> Fp8Weight:
        return Fp8Weight(self.fp8_weight, self.fp8_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight)


def fp8_eligible(name: str, module: nn.Module) -> bool:
    """Whether the model's module `name` is a projection converted to fp8: one the 4-bit format packs (named as in
    the checkpoint), with both dimensions multiples of ALIGN."""
    if not isinstance(module, nn.Linear) or module.bias is not None:
        return False
    stored = f"{name}.weight" if name.startswith("mtp.") else f"model.{name}.weight"
    return module.out_features % ALIGN == 0 and quantized_name(stored, tuple(module.weight.shape), ALIGN)


def to_fp8(model: nn.Module) -> int:
    """Replace every eligible projection of `model` (unfused) by an Fp8Linear made from its weight, one at a time on
    the weight's device (the dense weight is freed as it goes). Returns how many were converted."""
    done = 0
    for name, module in list(model.named_modules()):
        if fp8_eligible(name, module):
            assert isinstance(module, nn.Linear)
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, Fp8Linear(quantize_fp8(module.weight)))
            done += 1
    return done


def fuse_fp8(linears: tuple[Fp8Linear, ...]) -> Fp8Weight:
    """One fp8 weight holding the rows of `linears`, which keep their buffers as views of it (no extra memory)."""
    joined = Fp8Weight(torch.cat([m.fp8_weight for m in linears]), torch.cat([m.fp8_scale for m in linears]))
    offset = 0
    for m in linears:
        rows = slice(offset, offset + m.out_features)
        m.fp8_weight, m.fp8_scale = joined.weight[rows], joined.scale[rows]
        offset += m.out_features
    return joined
