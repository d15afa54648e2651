"""A verify's Gated DeltaNet recurrence in chunk form, as a CUDA C++ kernel (NVRTC): `columns`, `fits`, `defines`,
`step` and `fits_step` (the verify's short conv in the same launch), and `chunk_reference`, the same algebra in torch.

Owns: the launch of ignis.kernels.gdn_chunk_kernel's `gdn_chunk` on torch's current stream (capturable), its block
shape, its argument checks and which calls it takes. Does not own: the source and its algebra (gdn_chunk_kernel), the
column-by-column kernels it stands beside (ignis.kernels.gdn_cuda, gdn_kernel), the torch reference every recurrence
kernel is tested against (ignis.kernels.gdn.columns_reference), or the switch that routes a verify to it
(`ignis.kernels.gdn.CHUNK_VERIFY`).
"""

from __future__ import annotations

import torch

from ignis.kernels.gdn_chunk_kernel import CMAX, SOURCE
from ignis.kernels.gdn_cuda import Conv
from ignis.kernels.launch import gdn_pdl, nvrtc_installed
from ignis.kernels.nvrtc import load

TVC = 32  # a warp's state columns of a row, at most (fewer for narrower heads)
# A block's shape: (state columns a thread, row slices a block (TVC x slices threads; a block holds TVC x columns
# state columns, columns <= slices), blocks an SM the registers are bounded for), for a verify of more than FEW_LANES
# lanes (SHAPE) or of at most that many (FEW). On the H200 at the 27B shape (tools.bench_gdn --kernels
# chunk1,chunk2,chunk2x8), µs a layer: 1 x 8 8.1 / 8.0 / 7.3, 8 x 8 27.8 / 25.1 / 26.3 (the column-by-column kernel:
# 9.0 and 29.3). Spread over more blocks a few lanes' heads finish sooner; at 8 lanes fewer, shorter blocks win.
SHAPE = (2, 4, 4)
FEW = (2, 8, 2)
FEW_LANES = 2


def _tvc(dv: int) -> int:
    return min(TVC, dv)


def shape_for(lanes: int) -> tuple[int, int, int]:
    """The block shape of a verify of `lanes` lanes: FEW or SHAPE."""
    return FEW if lanes <= FEW_LANES else SHAPE


def _takes(dk: int, dv: int, shape: tuple[int, int, int]) -> bool:
    columns, slices, _ = shape
    tvc = _tvc(dv)
    return dk % (4 * slices) == 0 and dv % (tvc * columns) == 0 and (tvc * slices) % 32 == 0 and columns <= slices


def defines(dk: int, dv: int, shape: tuple[int, int, int], early: bool = False) -> tuple[tuple[str, int], ...]:
    """The source's sizes for heads of dk x dv in a block `shape`; early: launched programmatic-dependent
    (launch.gdn_pdl)."""
    columns, slices, blocks = shape
    return (("DK", dk), ("DV", dv), ("CMAX", CMAX), ("TVC", _tvc(dv)), ("SL", slices), ("NCOL", columns),
            ("MINB", blocks), ("PDL", int(early)))


def fits(state: torch.Tensor, cols: int, record: torch.Tensor | None) -> bool:
    """The calls the kernel takes: a verify (2..CMAX columns, each recorded in a contiguous record) over contiguous
    CUDA fp32 states whose key heads are a multiple of 16 channels up to 128 and split into both shapes' slices, and
    whose value heads split into both shapes' blocks of whole warps, with NVRTC installed."""
    dk, dv = state.shape[-2], state.shape[-1]
    return (state.is_cuda and state.dtype == torch.float32 and state.is_contiguous() and 2 <= cols <= CMAX
            and record is not None and record.is_contiguous() and dk % 16 == 0 and dk <= 128
            and _takes(dk, dv, SHAPE) and _takes(dk, dv, FEW) and nvrtc_installed())


def columns(
    state: torch.Tensor,  # [L, Hv, dk, dv] float32: read only
    lanes: torch.Tensor,  # [B] int64
    mixed: torch.Tensor,  # [B, C, 2 Hk dk + Hv dv] float32 contiguous: q | k | v, q and k normalised (q scaled)
    ba: torch.Tensor,  # [B, C, 2 Hv] float32 contiguous
    dt_bias: torch.Tensor,  # [Hv] float32
    rate: torch.Tensor,  # [Hv] float32
    out: torch.Tensor,  # [B, C, Hv, dv] float32: every column's output
    record: torch.Tensor,  # [L, C', Hv, dk + dv + 2] float32, C' >= C
    *,
    key_heads: int,
) -> None:
    """ignis.kernels.gdn.columns' work for a verify (`fits`'s calls): writes `out` and each column's record, leaves the
    state alone."""
    b, c, width = mixed.shape
    hv, dk, dv = state.shape[1:]
    if not fits(state, c, record):
        raise ValueError(f"gdn_chunk.columns takes a verify of 2..{CMAX} recorded columns over contiguous CUDA fp32 "
                         f"states with key heads of a multiple of 16 up to 128 channels; got state "
                         f"{tuple(state.shape)} {state.dtype}, mixed {tuple(mixed.shape)}")
    if not (mixed.is_contiguous() and ba.is_contiguous()) or mixed.dtype != torch.float32:
        raise ValueError(f"gdn_chunk takes contiguous fp32 mixed and ba; got mixed {tuple(mixed.shape)} {mixed.dtype}")
    if record.shape[1] < c:
        raise ValueError(f"the record holds {record.shape[1]} columns, fewer than {c}")
    _launch(state, lanes, mixed, ba, dt_bias, rate, out, record, key_heads, None)


def _launch(state: torch.Tensor, lanes: torch.Tensor, mixed: torch.Tensor, ba: torch.Tensor, dt_bias: torch.Tensor,
            rate: torch.Tensor, out: torch.Tensor, record: torch.Tensor, key_heads: int, conv: Conv | None) -> None:
    hv, dk, dv = state.shape[1:]
    b, c, width = (mixed if conv is None else conv.raw).shape
    early = gdn_pdl(state.device)
    tvc, shape = _tvc(dv), shape_for(b)
    key = defines(dk, dv, shape, early)
    if conv is None:
        joined: tuple[torch.Tensor | int | float, ...] = (state,) * 5 + (0,) * 8 + (0.0,)
    else:
        assert conv.record is not None
        strides = (*conv.window.stride()[:2], *conv.raw.stride()[:2], *conv.record.stride()[:2],
                   *conv.ba.stride()[:2])
        if max(strides) >= 2**31:
            raise ValueError(f"gdn_chunk.step takes strides below 2**31 (the kernel's int offsets); got {strides}")
        joined = (conv.window, conv.raw, conv.taps, conv.record, conv.ba, *strides, float(dk**-0.5))
        key += (("CONV", 1), ("CBF16", int(conv.raw.dtype == torch.bfloat16)), ("KC", conv.taps.shape[1]))
    kernel = load(SOURCE, "gdn_chunk", key, state.device)
    kernel((dv // (tvc * shape[0]), hv, b), tvc * shape[1],  # type: ignore[operator]
           (state, lanes, mixed, ba, dt_bias, rate, out, record, c, hv, width, key_heads * dk, hv // key_heads,
            record.shape[1], *joined), early)


def fits_step(state: torch.Tensor, conv: Conv, record: torch.Tensor | None) -> bool:
    """`fits`, for `step`'s calls: a verify's conv inputs (recorded) of CUDA bf16 or fp32 with contiguous last
    dimensions (the taps wholly), over key heads of a multiple of 32 channels (a warp's channels all q or all k)."""
    return (fits(state, conv.raw.shape[1], record) and state.shape[-2] % 32 == 0 and conv.record is not None
            and conv.raw.dtype in (torch.bfloat16, torch.float32) and conv.taps.is_contiguous()
            and conv.taps.dtype == torch.float32 and conv.taps.shape[1] == conv.window.shape[1] + 1
            and all(x.dtype == conv.raw.dtype and x.stride(-1) == 1
                    for x in (conv.window, conv.raw, conv.ba, conv.record)))


def step(state: torch.Tensor, lanes: torch.Tensor, conv: Conv, dt_bias: torch.Tensor, rate: torch.Tensor,
         record: torch.Tensor, *, key_heads: int) -> torch.Tensor:
    """ignis.kernels.fused.conv of a verify's columns (each column's input recorded, the window left alone), then
    `columns`, in one launch: out [B, C, Hv, dv] float32. Every block of a key head's group convolves the head's q
    and k channels itself, and its own v channels."""
    b, c = conv.raw.shape[:2]
    hv, dv = state.shape[1], state.shape[3]
    if not fits_step(state, conv, record):
        raise ValueError(f"gdn_chunk.step takes `fits`'s calls with key heads of a multiple of 32 channels and conv "
                         f"inputs of the raw's dtype; got state {tuple(state.shape)}, raw {tuple(conv.raw.shape)} "
                         f"{conv.raw.dtype}")
    out = torch.empty((b, c, hv, dv), dtype=torch.float32, device=state.device)
    _launch(state, lanes, state, state, dt_bias, rate, out, record, key_heads, conv)  # mixed, ba: not read
    return out


def chunk_reference(state: torch.Tensor, lanes: torch.Tensor, mixed: torch.Tensor, ba: torch.Tensor,
                    dt_bias: torch.Tensor, rate: torch.Tensor, record: torch.Tensor | None, *,
                    key_heads: int) -> torch.Tensor:
    """The kernel's algebra in torch, for a verify of normalised columns (as ignis.kernels.gdn.columns_reference with
    normalised=True, write_state=False): out [B, C, Hv, dv] float32, each column's record stored where given."""
    from ignis.kernels.gdn import _heads, _split, gates

    hv, dk, dv = state.shape[1], state.shape[2], state.shape[3]
    qs, ks, v = _split(mixed, key_heads, hv, dk, dv)
    b, c = mixed.shape[:2]
    qh = torch.stack([_heads(qs[:, j], hv) for j in range(c)], dim=1)  # [B, C, Hv, dk]
    kh = torch.stack([_heads(ks[:, j], hv) for j in range(c)], dim=1)
    g, beta = gates(ba, dt_bias, rate)  # [B, C, Hv]
    e = torch.exp(g)
    st = state.index_select(0, lanes)  # [B, Hv, dk, dv]
    a = torch.einsum("bhkv,bchk->bchv", st, kh)  # S^T k_j
    bq = torch.einsum("bhkv,bchk->bchv", st, qh)  # S^T q_j
    kk = torch.einsum("bihk,bjhk->bhij", kh, kh)
    kq = torch.einsum("bihk,bjhk->bhij", kh, qh)
    ones = torch.ones_like(e[:, :1])
    # r(i, j) = e_(i+1) .. e_j as products (i <= j), G_j = e_0 .. e_j
    r = torch.zeros(b, hv, c, c, dtype=e.dtype)
    for i in range(c):
        w = ones[:, 0]
        for j in range(i, c):
            if j > i:
                w = w * e[:, j]
            r[:, :, i, j] = w
    gam = torch.cumprod(e, dim=1)  # [B, C, Hv]
    deltas: list[torch.Tensor] = []
    outs = []
    for j in range(c):
        mem = gam[:, j, :, None] * a[:, j]
        for i in range(j):
            mem = mem + (r[:, :, i, j] * kk[:, :, i, j])[..., None] * deltas[i]
        delta = beta[:, j, :, None] * (v[:, j] - mem)
        deltas.append(delta)
        o = gam[:, j, :, None] * bq[:, j]
        for i in range(j + 1):
            o = o + (r[:, :, i, j] * kq[:, :, i, j])[..., None] * deltas[i]
        outs.append(o)
        if record is not None:
            row = torch.cat([kh[:, j], delta, g[:, j, :, None], beta[:, j, :, None]], dim=-1)
            record[:, j].index_copy_(0, lanes, row)
    return torch.stack(outs, dim=1)
