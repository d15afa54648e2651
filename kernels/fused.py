"""Fused kernels of the decode round's layers: each replaces a run of small torch ops with one launch.

Owns: `add_rms_norm`, `rms_norm_pair`, `conv`, `gated_norm`, `swiglu`, `qk_rope_write`, `grouped_conv` (numba-cuda
kernels on CUDA tensors, launched on torch's current stream so a CUDA graph captures them; `add_rms_norm`,
`rms_norm_pair` and `swiglu` run the Triton kernels of ignis.kernels.norm_triton and ignis.kernels.swiglu_triton where
Triton is installed; `rms_norm_pair` has no numba form and takes the reference without Triton) and their torch
references (what runs on the CPU, and what the kernels are tested against). Does not own: the layers that call them
(ignis.model, the dflash2 drafter) or the kernel sources (ignis.kernels.fused_kernel, norm_triton, swiglu_triton). docs/adr/0006-fused-layer-kernels.md has the
why and the numbers.

Each reference is the torch code the layer ran before the kernel existed, so the CPU keeps its arithmetic exactly;
each kernel rounds to bf16 wherever those torch ops did.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.nn.functional as F

from ignis.kernels.launch import gdn_pdl, launch, triton_installed
from ignis.kernels.gdn import normalise_qk
from ignis.model.ops import apply_rope

CONV_TILE = 8  # conv: the most columns a block takes (a prefill piece's columns spread over blocks)
CONV_BLOCKS = 1024  # conv: the fewest blocks worth fewer columns a block (each column's norms wait on a block sync)
# Whether a decode's or a verify's conv (up to 8 columns) runs the CUDA C++ kernel of ignis.kernels.conv_cuda instead
# of the numba one: True or False for every call, None (the default) for those of at least CUDA_CONV_ROWS rows (lanes
# x columns). On the H200 at the 27B shape, in CUDA graphs of 48 layers' calls: 1 x 8 numba 4.6 us, CUDA C++ 5.4;
# 8 x 8 numba 10.3 us, CUDA C++ 7.8, and the 8 x 8 verify round 0.12-0.14 ms faster (tools.bench_round --conv
# numba,cuda); between, unmeasured. Where launch.gdn_pdl holds, every row count (the numba kernel cannot launch
# programmatic-dependent). Set once, before the engine captures its graphs.
CUDA_CONV: bool | None = None
CUDA_CONV_ROWS = 32

# --- references -------------------------------------------------------------------------------------------------


def add_rms_norm_reference(
    x: torch.Tensor, d: torch.Tensor | None, scale: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    resid = x if d is None else x + d
    return resid, F.rms_norm(resid.float(), (x.shape[-1],), scale, eps).to(x.dtype)


def rms_norm_pair_reference(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                            eps: float) -> torch.Tensor:
    halves = (add_rms_norm_reference(x, None, scale, eps)[1] for x, scale in ((a, scale_a), (b, scale_b)))
    return torch.cat(list(halves), dim=-1)


def conv_reference(
    window: torch.Tensor, lanes: torch.Tensor, raw: torch.Tensor, weight: torch.Tensor, ba: torch.Tensor,
    record: torch.Tensor | None, key_heads: int, dk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    b, c = raw.shape[:2]
    win = window.index_select(0, lanes)  # [B, Kc-1, D]
    xs = torch.cat([win, raw], dim=1)  # [B, Kc-1+C, D]: conv inputs, oldest first
    # Column j's taps are xs[j .. j+Kc-1] (delta_rule.short_conv's sum, as one product and one reduction).
    mixed = normalise_qk(F.silu((xs.unfold(1, weight.shape[1], 1).float() * weight).sum(dim=-1)), key_heads, dk)
    if record is not None:
        record[:, :c].index_copy_(0, lanes, raw)
    else:
        window.index_copy_(0, lanes, xs[:, -window.shape[1] :])
    return mixed, ba.float().reshape(b, c, -1)


def gated_norm_reference(out: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    t, hv, dv = out.shape
    h = F.rms_norm(out.to(z.dtype).float(), (dv,), eps=eps).to(z.dtype)
    return (weight * h * F.silu(z.reshape(t, hv, dv).float())).to(z.dtype).reshape(t, hv * dv)


def swiglu_reference(gu: torch.Tensor) -> torch.Tensor:
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up


def qk_rope_write_reference(
    qkv: torch.Tensor, qscale: torch.Tensor, kscale: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
    kc: torch.Tensor, vc: torch.Tensor, table: torch.Tensor, lanes: torch.Tensor, positions: torch.Tensor, nh: int,
    nkv: int,
) -> torch.Tensor:
    b, c = positions.shape
    t, hd, page = b * c, kc.shape[-1], kc.shape[1]
    qg, k, v = torch.split(qkv, [2 * nh * hd, nkv * hd, nkv * hd], dim=-1)
    qg = qg.reshape(t, nh, 2 * hd)
    q = F.rms_norm(qg[..., :hd].float(), (hd,), qscale, eps).to(qkv.dtype)
    k = F.rms_norm(k.reshape(t, nkv, hd).float(), (hd,), kscale, eps).to(qkv.dtype)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    where = (table[lanes[:, None].expand(b, c), positions // page], positions % page)  # (page, row) of each column
    kc.index_put_(where, k.view(b, c, nkv, hd))
    vc.index_put_(where, v.reshape(b, c, nkv, hd))
    group = nh // nkv
    # The query heads of one KV head attend together as group*C rows: no copy of K/V per query head.
    return q.view(b, c, nkv, group, hd).permute(0, 2, 3, 1, 4).reshape(b, nkv, group * c, hd)


def grouped_conv_reference(x: torch.Tensor, base: torch.Tensor, dyn: torch.Tensor, group: int) -> torch.Tensor:
    n, rows, hidden = x.shape
    groups = hidden // group
    blocks = x.view(n, rows, groups, group)
    out = blocks  # replaced by tap 0's term below
    for tap in range(min(base.shape[0], rows)):
        past = blocks if tap == 0 else F.pad(blocks[:, :-tap], (0, 0, 0, 0, tap, 0))
        term = (base[tap].view(1, 1, groups, group) + dyn[:, :, tap, :, None]) * past
        out = term if tap == 0 else out + term
    return out.reshape(n, rows, hidden)


# --- kernels ----------------------------------------------------------------------------------------------------

_lock = threading.Lock()
_kernels: dict[tuple[bool, int, int, int], dict[str, Any]] = {}


def _compiled(dtype: torch.dtype, head: int, per: int = 1, taps: int = 4) -> dict[str, Any]:
    """The kernels for elements of `dtype`, per-head blocks of the next power of two >= head, norm rows of at most
    per * NORM_THREADS and a conv of `taps` (compiled lazily by numba on first launch, per signature)."""
    if dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"fused kernels take bfloat16 or float32 tensors, not {dtype}")
    key = (dtype == torch.bfloat16, _threads(head), per, taps)
    with _lock:
        if key not in _kernels:
            from ignis.kernels.fused_kernel import NORM_THREADS, make_kernels

            half, threads, per, taps = key
            _kernels[key] = make_kernels(half, threads, per, NORM_THREADS, taps)
        return _kernels[key]


def add_rms_norm(
    x: torch.Tensor,  # [T, H] model dtype: the residual stream
    d: torch.Tensor | None,  # [T, H] model dtype: what the last block adds to it (None: nothing)
    scale: torch.Tensor,  # [H] float32: 1 + w
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + d, rms_norm(x + d) * scale), both in the model dtype: the residual add and the next norm, one launch
    (the Triton kernel of ignis.kernels.norm_triton where Triton is installed, else the numba one)."""
    if not x.is_cuda:
        return add_rms_norm_reference(x, d, scale, eps)
    if triton_installed():
        from ignis.kernels import norm_triton

        return norm_triton.add_rms_norm(x.contiguous(), None if d is None else d.contiguous(), scale, eps)
    from ignis.kernels.fused_kernel import NORM_THREADS

    k = _compiled(x.dtype, 32, -(-x.shape[1] // NORM_THREADS))["add_rms_norm"]
    resid = x if d is None else torch.empty_like(x)
    normed = torch.empty_like(x)
    launch(k, (x.shape[0],), NORM_THREADS, (x, x if d is None else d, scale, resid, normed, float(eps), d is not None),
            x.device)
    return resid, normed


def rms_norm_pair(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                  eps: float, ids: torch.Tensor | None = None) -> torch.Tensor:
    """cat([rms_norm(a) * scale_a, rms_norm(b) * scale_b], -1) [T, 2n] in the model dtype, for a and b [T, n] and
    float32 scales [n]: the MTP layer's two input norms and their concatenation, one launch where Triton runs (the
    kernel of ignis.kernels.norm_triton), the reference elsewhere. With `ids` [T] int64, a is the embedding table
    [V, n] and its rows ids are normed (F.embedding's gather, joined to the launch)."""
    if not a.is_cuda or not triton_installed():
        return rms_norm_pair_reference(a if ids is None else F.embedding(ids, a), b, scale_a, scale_b, eps)
    from ignis.kernels import norm_triton

    return norm_triton.rms_norm_pair(a.contiguous(), b.contiguous(), scale_a, scale_b, eps,
                                     None if ids is None else ids.contiguous())


def conv(
    window: torch.Tensor,  # [L, Kc-1, D] model dtype: each lane's last Kc-1 conv inputs
    lanes: torch.Tensor,  # [B] int64
    raw: torch.Tensor,  # [B, C, D] model dtype: this round's conv inputs (a view of the projection is fine)
    weight: torch.Tensor,  # [D, Kc] float32
    ba: torch.Tensor,  # [B, C, 2 Hv] model dtype: raw beta and decay projections
    record: torch.Tensor | None,  # [L, C', D] model dtype: verify keeps each column's input here, window untouched
    *,
    key_heads: int,  # D = [q | k | v], q and k of key_heads heads of dk channels each
    dk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(causal depthwise conv) [B, C, D] float32 with q and k l2-normalised and q scaled by dk^-0.5, as the
    recurrence reads them; ba as float32 [B, C, 2 Hv]); a decode (record None) moves each lane's window on by C
    inputs."""
    if not raw.is_cuda:
        return conv_reference(window, lanes, raw, weight, ba, record, key_heads, dk)
    b, c, dim = raw.shape
    if CUDA_CONV if CUDA_CONV is not None else b * c >= CUDA_CONV_ROWS or gdn_pdl(raw.device):
        from ignis.kernels import conv_cuda

        if conv_cuda.fits(raw, window, record, ba, weight, dk):
            return conv_cuda.conv(window, lanes, raw, weight, ba, record, key_heads=key_heads, dk=dk)
    mixed = torch.empty((b, c, dim), dtype=torch.float32, device=raw.device)
    ba_out = torch.empty(ba.shape, dtype=torch.float32, device=raw.device)
    if weight.shape[1] != window.shape[1] + 1:
        raise ValueError(f"a conv of {weight.shape[1]} taps keeps {weight.shape[1] - 1} inputs a lane, not "
                         f"{window.shape[1]}")
    k = _compiled(raw.dtype, dk, taps=weight.shape[1])["conv"]
    tile = conv_tile(b, c, -(-dim // dk), window.shape[1], verify=record is not None)
    launch(k, ((dim + dk - 1) // dk, b, (c + tile - 1) // tile), _threads(dk),
            (window, lanes, raw, weight, mixed, window if record is None else record, ba, ba_out, record is not None,
             dk, 2 * key_heads, float(dk**-0.5), tile), raw.device)
    return mixed, ba_out


def conv_tile(lanes: int, cols: int, heads: int, window: int, verify: bool = False) -> int:
    """Columns a conv block takes: the most, up to CONV_TILE, that still give CONV_BLOCKS blocks, and never fewer than
    the window's width where the launch moves the window (a decode, a prefill piece), so that only a lane's first
    block reads it; a verify leaves the window alone, so any block may read it and its tiles go down to one column.
    A block's columns run one after another (each waits on its norms' block sum), so a verify's few lanes want short
    tiles: on the H200 at the 27B shape (80 heads of 128 channels), 1 lane x 8 columns took 10.8 us in one tile of 8,
    6.6 in tiles of 3 and, a verify's, 5.4 in tiles of one (7.7 -> 5.4 a layer in a round's profile); 8 x 8 took 15.8
    in tiles of 8 and 14.3 in tiles of 4; decodes (one column) do not change."""
    least = 1 if verify else window
    tile = CONV_TILE
    while tile > least and heads * lanes * -(-cols // tile) < CONV_BLOCKS:
        tile //= 2
    return max(tile, least)


def gated_norm(out: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """out [T, Hv, dv] float32, z [T, Hv * dv] model dtype, weight [dv] model dtype -> w * rms_norm(out) * silu(z)
    [T, Hv * dv] model dtype (the Gated DeltaNet output norm, ops.gated_rms_norm)."""
    if not out.is_cuda:
        return gated_norm_reference(out, z, weight, eps)
    t, hv, dv = out.shape
    ks = _compiled(z.dtype, dv)
    threads = _threads(dv)
    y = torch.empty((t, hv * dv), dtype=z.dtype, device=z.device)
    launch(ks["gated_norm"], (hv, t), threads, (out, z, weight, y, float(eps)), z.device)
    return y


def swiglu(gu: torch.Tensor) -> torch.Tensor:
    """gu [..., 2 I] (gate | up) -> silu(gate) * up [..., I] (the Triton kernel of ignis.kernels.swiglu_triton where
    Triton is installed, else the numba one)."""
    if not gu.is_cuda or torch.is_grad_enabled():
        return swiglu_reference(gu)
    lead, inner = gu.shape[:-1], gu.shape[-1] // 2
    flat = gu.reshape(-1, 2 * inner).contiguous()
    if triton_installed():
        from ignis.kernels import swiglu_triton

        return swiglu_triton.swiglu(flat).reshape(*lead, inner)
    from ignis.kernels.fused_kernel import EW_THREADS

    y = torch.empty((flat.shape[0], inner), dtype=gu.dtype, device=gu.device)
    launch(_compiled(gu.dtype, 32)["swiglu"], ((inner + EW_THREADS - 1) // EW_THREADS, flat.shape[0]), EW_THREADS,
            (flat, y), gu.device)
    return y.reshape(*lead, inner)


def qk_rope_write(
    qkv: torch.Tensor,  # [T, (2 nh + 2 nkv) hd] model dtype: per query head [q | gate], then k, then v
    qscale: torch.Tensor,  # [hd] float32: 1 + q_norm.weight
    kscale: torch.Tensor,  # [hd] float32
    eps: float,
    cos: torch.Tensor,  # [T, rd] model dtype
    sin: torch.Tensor,
    kc: torch.Tensor,  # [pages, page, nkv, hd] model dtype: the K pages
    vc: torch.Tensor,
    table: torch.Tensor,  # [L, width] int64: the page of each lane's positions i*page..(i+1)*page-1
    lanes: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B, C] int64
    nh: int,
    nkv: int,
) -> torch.Tensor:
    """Normalise and rotate q and k, write k and v at each column's position in its lane's pages, and return the
    queries as [B, nkv, group * C, hd] (the heads of one KV head together, as attention reads them)."""
    if not qkv.is_cuda:
        return qk_rope_write_reference(qkv, qscale, kscale, eps, cos, sin, kc, vc, table, lanes, positions, nh, nkv)
    b, c = positions.shape
    hd = kc.shape[-1]
    qh = torch.empty((b, nkv, nh // nkv * c, hd), dtype=qkv.dtype, device=qkv.device)
    launch(_compiled(qkv.dtype, hd)["qk_rope_write"], (nh + 2 * nkv, b * c), _threads(hd),
            (qkv, qscale, kscale, cos, sin, kc, vc, table, lanes, positions, qh, float(eps), nh, nkv), qkv.device)
    return qh


def grouped_conv(x: torch.Tensor, base: torch.Tensor, dyn: torch.Tensor, group: int) -> torch.Tensor:
    """DFlash2's grouped dynamic causal conv over block rows: x [n, R, H], base [taps, H] (x's dtype), dyn
    [n, R, taps, H / group] -> [n, R, H]. The kernel has no backward: training (grad enabled) runs the reference."""
    if not x.is_cuda or torch.is_grad_enabled():
        return grouped_conv_reference(x, base, dyn, group)
    from ignis.kernels.fused_kernel import EW_THREADS

    n, rows, hidden = x.shape
    y = torch.empty_like(x)
    launch(_compiled(x.dtype, 32)["grouped_conv"], ((hidden + EW_THREADS - 1) // EW_THREADS, n * rows), EW_THREADS,
            (x, base, dyn, y, group), x.device)
    return y


def _threads(n: int) -> int:
    threads = 32
    while threads < n:
        threads *= 2
    return threads
