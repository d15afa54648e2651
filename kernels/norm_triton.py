"""The residual add and RMSNorm of the decode round in Triton: `add_rms_norm`, a program a row; and `rms_norm_pair`,
two rows' norms written side by side (the MTP layer's input), a program a row and side.

Owns: the kernel and its launch on torch's current stream (Triton launches there), allocating only the outputs, so a
CUDA graph captures it; and `Conv`, the dflash2 drafter's side-1 grouped conv of d that the kernel can apply
before the add (its rounding is fused.grouped_conv's, so that conv's own launch joins this one). Does not own: the
torch reference (ignis.kernels.fused.add_rms_norm_reference), the numba kernel it replaces where Triton is installed
(ignis.kernels.fused_kernel), or when it runs (ignis.kernels.fused).

Why (docs/adr/0006-fused-layer-kernels.md has the numbers): a decode round runs two of these a layer on rows of a
few thousand values, so a launch is bound by its chain of memory latencies, not by its bytes. Here a row's x, d and
scale are loaded together (three independent loads, one latency) as 16-byte vectors, the sum of squares is one tree
over the program's warps, and the stores follow: one latency each way. The numba kernel it replaces read the scale
only after its reduction, which serialised a third latency, and summed 32 warps' partials in every thread.

With ignis.kernels.launch.PDL on a Hopper GPU it launches programmatic-dependent: the scale loads while the kernel
before finishes, x and d after it.

Arithmetic is the reference's, op for op: x + d in fp32 rounded to the model dtype (torch's bf16 add), the mean of
squares of that in fp32, then value * (1 / sqrt(mean + eps)) * scale rounded once. Only the order of the fp32 sum of
squares differs (a tree here), so results match the reference within one rounding of the output; a row's result
does not depend on the other rows of the call (one program a row).

Importing this module imports triton, not CUDA. Without a GPU, TRITON_INTERPRET=1 runs the kernel in Triton's
interpreter on CPU tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ignis.kernels import launch
from ignis.kernels.launch import pdl

MAX_WIDTH = 65536  # the widest row one program holds (a Qwen3.5 hidden size is at most a few thousand)


@triton.jit
def _add_rms_norm(
    x_ptr, d_ptr, scale_ptr, resid_ptr, normed_ptr,  # x, d, resid, normed [T, n] model dtype; scale [n]
    n, eps,
    ADD: tl.constexpr, ROUND_FIRST: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
    EARLY: tl.constexpr = False,
    base_ptr=None, dyn_ptr=None,  # CONV: base [2, n] model dtype; dyn [T, 2, n / group] model dtype, rows dyn_stride
    dyn_stride=0, group=1, block_rows=1,
    CONV: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    if PDL:  # launched ahead of the kernel before (launch.PDL): the scale (a weight) now, x and d once it has finished
        scale = tl.load(scale_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if EARLY:  # launch.EARLY_TRIGGER: the product after it may launch and stream its weight now
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
        v = tl.load(x_ptr + row * n + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        v = tl.load(x_ptr + row * n + offs, mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(scale_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        if CONV:  # d is first convolved over its block's rows (DFlash2's side-1 grouped conv, two taps)
            d = _grouped_conv_row(d_ptr, base_ptr, dyn_ptr, row, offs, mask, n, dyn_stride, group, block_rows)
        else:
            d = tl.load(d_ptr + row * n + offs, mask=mask, other=0.0).to(tl.float32)
        r = (v + d).to(resid_ptr.dtype.element_ty)  # the residual in the model dtype, as torch's add rounds it
        tl.store(resid_ptr + row * n + offs, r, mask=mask)
        v = r.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / n + eps)
    out = normed_ptr.dtype.element_ty
    if ROUND_FIRST:  # Qwen3's norm: the normalised row rounded, then its product with the weight rounded
        tl.store(normed_ptr + row * n + offs, ((v * inv).to(out).to(tl.float32) * scale).to(out), mask=mask)
    else:
        tl.store(normed_ptr + row * n + offs, (v * inv * scale).to(out), mask=mask)


@triton.jit
def _grouped_conv_row(d_ptr, base_ptr, dyn_ptr, row, offs, mask, n, dyn_stride, group, block_rows):
    """Row `row` of fused.grouped_conv(d, base, dyn, group) over blocks of `block_rows` rows, as float32 holding
    the model dtype's value: y = (base[0] + dyn[row, 0]) * d[row] + (base[1] + dyn[row, 1]) * d[row - 1], the row
    before a block's first taken as zero, every sum and product rounded to the model dtype as that kernel does."""
    elt = d_ptr.dtype.element_ty
    has_before = (row % block_rows) != 0
    dyn_row = dyn_ptr + row * dyn_stride + offs // group
    b0 = tl.load(base_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b1 = tl.load(base_ptr + n + offs, mask=mask, other=0.0).to(tl.float32)
    w0 = tl.load(dyn_row, mask=mask, other=0.0).to(tl.float32)
    w1 = tl.load(dyn_row + n // group, mask=mask, other=0.0).to(tl.float32)
    x0 = tl.load(d_ptr + row * n + offs, mask=mask, other=0.0).to(tl.float32)
    x1 = tl.load(d_ptr + (row - 1) * n + offs, mask=mask & has_before, other=0.0).to(tl.float32)
    term0 = ((b0 + w0).to(elt).to(tl.float32) * x0).to(elt).to(tl.float32)
    term1 = ((b1 + w1).to(elt).to(tl.float32) * x1).to(elt).to(tl.float32)
    return (term0 + term1).to(elt).to(tl.float32)


def warps(width: int) -> int:
    """Warps a program: 8 values a thread at most up to 16 warps (16-byte loads of bf16), so 4,096-8,192 wide rows
    take 16 warps and the built-in model's 384 takes 2."""
    return max(1, min(16, triton.next_power_of_2(width) // 256))


def add_rms_norm(
    x: torch.Tensor,  # [T, n] model dtype, contiguous: the residual stream
    d: torch.Tensor | None,  # [T, n] like x: what the last block adds to it (None: nothing)
    scale: torch.Tensor,  # [n] float32: 1 + w; with round_first, the weight in x's dtype
    eps: float,
    *,
    round_first: bool = False,  # Qwen3's norm: w * (x / rms(x) rounded to x's dtype), rounded again
    conv: Conv | None = None,  # d convolved first: DFlash2's side-1 grouped conv (`Conv`)
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + d, rms_norm(x + d) * scale) in x's dtype, one launch; with d None the residual is x itself. With `conv`,
    d is first replaced by fused.grouped_conv(d, conv.base, conv.dyn, conv.group) over blocks of conv.rows rows,
    bit for bit, so that conv's launch joins this one."""
    t, n = x.shape
    want = x.dtype if round_first else torch.float32
    if (n > MAX_WIDTH or not x.is_contiguous() or (d is not None and (d.shape != x.shape or not d.is_contiguous()))
            or scale.shape != (n,) or scale.dtype != want):
        raise ValueError(f"add_rms_norm takes contiguous x and d [T, n <= {MAX_WIDTH}] and a {want} scale [n]; got x "
                         f"{tuple(x.shape)}, d {None if d is None else tuple(d.shape)}, scale {tuple(scale.shape)} "
                         f"{scale.dtype}")
    extra: dict[str, object] = {}
    if conv is not None:
        if d is None:
            raise ValueError("add_rms_norm's conv convolves d: d is None")
        extra = conv.arguments(t, n, d.dtype)
    resid = x if d is None else torch.empty_like(x)
    normed = torch.empty_like(x)
    if t:
        early = {"PDL": True, "launch_pdl": True, "EARLY": launch.EARLY_TRIGGER} if pdl(x.device) else {}
        _add_rms_norm[(t,)](x, x if d is None else d, scale, resid, normed, n, float(eps), ADD=d is not None,
                            ROUND_FIRST=round_first, BLOCK=triton.next_power_of_2(n), num_warps=warps(n), **early,
                            **extra)
    return resid, normed


@triton.jit
def _rms_norm_pair(
    a_ptr, b_ptr, scale_a_ptr, scale_b_ptr, out_ptr,  # a, b [T, n] model dtype; scales [n] float32; out [T, 2n]
    n, eps, BLOCK: tl.constexpr,
    ids_ptr=None, IDS: tl.constexpr = False,  # IDS: a is a table [V, n] and row t's a its row ids[t] (int64 [T])
):
    row = tl.program_id(0).to(tl.int64)
    side = tl.program_id(1)  # 0: a into out's first half, 1: b into its second
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    if side == 0:
        a_row = tl.load(ids_ptr + row) if IDS else row
        v = tl.load(a_ptr + a_row * n + offs, mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(scale_a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        v = tl.load(b_ptr + row * n + offs, mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(scale_b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / n + eps)
    tl.store(out_ptr + row * 2 * n + side * n + offs, (v * inv * scale).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_pair(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                  eps: float, ids: torch.Tensor | None = None) -> torch.Tensor:
    """cat([rms_norm(a) * scale_a, rms_norm(b) * scale_b], -1) [T, 2n] in a's dtype, one launch: a and b [T, n]
    contiguous, of one dtype; the scales [n] float32. Each half's arithmetic is `add_rms_norm`'s without the add.
    With `ids` (int64 [T], contiguous), a is a table [V, n] and row t's first half is its row ids[t] normed: the
    embedding's gather joined to the launch."""
    t, n = b.shape
    if (n > MAX_WIDTH or (a.shape != b.shape if ids is None else a.shape[1:] != (n,)) or b.dtype != a.dtype
            or not a.is_contiguous() or not b.is_contiguous()
            or (ids is not None and (ids.shape != (t,) or ids.dtype != torch.int64 or not ids.is_contiguous()))
            or any(s.shape != (n,) or s.dtype != torch.float32 for s in (scale_a, scale_b))):
        raise ValueError(f"rms_norm_pair takes contiguous a and b [T, n <= {MAX_WIDTH}] of one dtype (with ids, int64 "
                         f"[T], a table [V, n]) and float32 scales [n]; got a {tuple(a.shape)} {a.dtype}, b "
                         f"{tuple(b.shape)} {b.dtype}, ids {None if ids is None else (tuple(ids.shape), ids.dtype)}, "
                         f"scales {tuple(scale_a.shape)} {scale_a.dtype} and {tuple(scale_b.shape)} {scale_b.dtype}")
    out = torch.empty((t, 2 * n), dtype=a.dtype, device=a.device)
    if t:
        _rms_norm_pair[(t, 2)](a, b, scale_a, scale_b, out, n, float(eps), BLOCK=triton.next_power_of_2(n),
                               ids_ptr=ids, IDS=ids is not None, num_warps=warps(n))
    return out


@dataclass(frozen=True)
class Conv:
    """DFlash2's side-1 grouped dynamic conv of two taps for `add_rms_norm` to apply to d: base [2, n] and dyn
    [T / rows, rows, 2, n / group] (a view whose rows may be strided, as GroupedConv.prepare leaves it), both in d's
    dtype; blocks of `rows` rows, each block's first row seeing no row before it."""

    base: torch.Tensor
    dyn: torch.Tensor
    group: int
    rows: int

    def arguments(self, t: int, n: int, dtype: torch.dtype) -> dict[str, object]:
        """The kernel's CONV arguments for d [t, n] of `dtype`; ValueError where the shapes do not fit."""
        base, dyn = self.base, self.dyn
        groups = n // self.group if self.group > 0 else 0
        if (groups * self.group != n or self.rows < 1 or t % self.rows or base.shape != (2, n) or not
                base.is_contiguous() or dyn.shape != (t // self.rows, self.rows, 2, groups) or dyn.stride(3) != 1
                or dyn.stride(2) != groups or dyn.stride(0) != self.rows * dyn.stride(1)
                or base.dtype != dtype or dyn.dtype != dtype):
            raise ValueError(f"add_rms_norm's conv takes base [2, {n}] and dyn [{t} / rows, rows, 2, {n} / group] "
                             f"in {dtype}, taps then groups contiguous; got base {tuple(base.shape)} {base.dtype}, dyn "
                             f"{tuple(dyn.shape)} {dyn.dtype} strides {dyn.stride()}, group {self.group}, rows "
                             f"{self.rows}")
        return {"base_ptr": base, "dyn_ptr": dyn, "dyn_stride": dyn.stride(1), "group": self.group,
                "block_rows": self.rows, "CONV": True}
