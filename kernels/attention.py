"""Decode and verify attention over each lane's key slots in a page pool, split over the context, gated: `attend`.

Owns: `attend` and the choice of how it runs (`use`, `route`): two numba-cuda launches on CUDA tensors, on torch's
current stream so a CUDA graph captures them (the splits' partial softmax-weighted sums, then their merge times
sigmoid(gate)), or the same two steps as Triton kernels on tensor cores (ignis.kernels.attention_triton), or the
torch reference `attend_reference` (what runs on the CPU, and what the kernels are tested against) with its mask
(`visibility`: only the reference builds one); the split plan (`splits`). Does not own: the projections, q/k norms
and the K/V write before it (ignis.kernels.fused.qk_rope_write) or the layer (ignis.model.attention).
docs/adr/0006-fused-layer-kernels.md and 0009-triton-paged-attention.md have the why and the numbers.

Why not SDPA on the GPU: a decode or verify round has few query rows per KV head (query heads of the group x
columns), and the library kernels spread work over (lane, KV head) only, a handful of blocks on 132 SMs, after a
gather of every lane's keys; here a block takes (context split, KV head, lane) and reads the pages in place.

Keys live in pages (ignis.model.pool): slot s of lane l is kc[table[l, s // page], s % page]. The reference gathers
the span's pages of each lane into a contiguous [B, span, nkv, hd] first (static shapes: capturable) and runs SDPA;
the kernel looks each staged key's page up in the table instead.
"""

from __future__ import annotations

import threading
from typing import Any, Literal, get_args

import torch
import torch.nn.functional as F

from ignis.kernels.launch import launch, triton_installed

TARGET_BLOCKS = 264  # about two blocks per SM of an H200 (132 SMs)
# Query rows a block at most for the numba kernel (where triton is missing): each row's scores are one thread's serial
# dot products, which pays against the library kernel for decode (6 rows at the 27B shape: 44 against 66 us a layer
# with the gather, H200) but not for a verify (48 rows: 147 against 62 us).
MAX_ROWS = 16
TRITON_ROWS = 64  # the Triton kernel's one row block: 8 columns x 8 query heads a KV head at most

AttendPath = Literal["auto", "numba", "triton", "reference"]
PATHS: tuple[AttendPath, ...] = get_args(AttendPath)
_path: AttendPath = "auto"  # set by `use`; "auto" is `route`'s choice


def gate_heads_reference(o: torch.Tensor, qkv: torch.Tensor, nh: int) -> torch.Tensor:
    b, nkv, gc, hd = o.shape
    group = nh // nkv
    c, t = gc // group, b * gc // group
    gate = qkv[:, : 2 * nh * hd].reshape(t, nh, 2 * hd)[..., hd:]
    o = o.view(b, nkv, group, c, hd).permute(0, 3, 1, 2, 4).reshape(t, nh * hd)
    return o * torch.sigmoid(gate.reshape(t, -1))


def gather_span(kc: torch.Tensor, table: torch.Tensor, lanes: torch.Tensor, span: int) -> torch.Tensor:
    """kc [pages, page, nkv, hd] read through table [L, width] -> each lane's slots 0..span-1 as [B, span, nkv, hd]."""
    b, page = lanes.shape[0], kc.shape[1]
    pages = table.index_select(0, lanes)[:, : -(-span // page)]  # [B, n] int64
    return kc.index_select(0, pages.reshape(-1)).view(b, -1, *kc.shape[2:])[:, :span]


def visibility(positions: torch.Tensor, span: int, rows: int) -> torch.Tensor:
    """[B, 1, rows, span] bool: query row g * C + c (query head g of a KV head, column c of positions [B, C]) sees key
    slots 0..positions[b, c] of the span: the reference's mask. The kernels read positions instead."""
    b, c = positions.shape
    seen = torch.arange(span, device=positions.device)[None, None, :] <= positions[:, :, None]  # [B, C, span]
    return seen[:, None, None].expand(b, 1, rows // c, c, span).reshape(b, 1, rows, span)


def attend_reference(
    q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, table: torch.Tensor, lanes: torch.Tensor, mask: torch.Tensor,
    scale: float, qkv: torch.Tensor, nh: int,
) -> torch.Tensor:
    span = mask.shape[-1]
    keys = gather_span(kc, table, lanes, span).transpose(1, 2)  # [B, nkv, span, hd]
    vals = gather_span(vc, table, lanes, span).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, scale=scale)
    return gate_heads_reference(o, qkv, nh)


def splits(span: int, lanes: int, kv_heads: int, tile: int | None = None) -> tuple[int, int]:
    """(splits, slots a split): enough blocks to fill the GPU, each a whole number of key tiles of `tile` slots
    (None: the numba kernel's staged tile)."""
    if tile is None:
        from ignis.kernels.attention_kernel import KEYS

        tile = KEYS
    tiles = -(-span // tile)
    want = max(1, min(tiles, -(-TARGET_BLOCKS // (lanes * kv_heads))))
    per = -(-tiles // want) * tile
    return -(-span // per), per


_lock = threading.Lock()
_kernels: dict[tuple[bool, int, int], dict[str, Any]] = {}


def _compiled(dtype: torch.dtype, rows: int, hd: int) -> dict[str, Any]:
    key = (dtype == torch.bfloat16, rows, hd)
    with _lock:
        if key not in _kernels:
            from ignis.kernels.attention_kernel import make_kernels

            _kernels[key] = make_kernels(*key)
        return _kernels[key]


def use(path: AttendPath) -> None:
    """Make every later `attend` take `path` ("auto": `route`'s choice; the others force one, for benchmarks and
    tests, and fail where that path cannot take the tensors)."""
    global _path
    if path not in PATHS:
        raise ValueError(f"attention path {path!r} is not one of {PATHS}")
    _path = path


def route(q: torch.Tensor) -> AttendPath:
    """The path `attend` takes for queries q [B, nkv, R, hd]: the one set by `use`, or under "auto" on CUDA (bf16 or
    fp32) the Triton kernel wherever it fits (1..TRITON_ROWS rows a KV head, a power-of-two head width, triton
    installed), else the numba kernel for at most MAX_ROWS rows, else the reference (the CPU among it). Measured on
    the H200 at the 27B shape (tools/bench_attention.py, ADR 0009), the Triton kernel is 5x the numba kernel's speed
    for one decode lane at a 1,024-key span and 22x at 262,144, and 3 to 45x the reference's for verifies."""
    if _path != "auto":
        return _path
    if not (q.is_cuda and q.dtype in (torch.bfloat16, torch.float32)):
        return "reference"
    if triton_fits(q) and triton_installed():
        return "triton"
    if q.shape[2] <= MAX_ROWS:
        from ignis.kernels.attention_kernel import THREADS

        if q.shape[3] <= THREADS:
            return "numba"
    return "reference"


def triton_fits(q: torch.Tensor) -> bool:
    """The Triton kernel takes bf16/fp32 queries [B, nkv, R, hd] of 1..TRITON_ROWS rows and a power-of-two hd >= 16."""
    rows, hd = q.shape[2], q.shape[3]
    return 1 <= rows <= TRITON_ROWS and hd >= 16 and hd & (hd - 1) == 0 and q.dtype in (torch.bfloat16, torch.float32)


def attend(
    q: torch.Tensor,  # [B, nkv, R, hd] model dtype: rows g * C + c (query head g of the KV head, column c)
    kc: torch.Tensor,  # [pages, page, nkv, hd] model dtype: the K pages
    vc: torch.Tensor,
    table: torch.Tensor,  # [L, width] int64: the page of each lane's slots i*page..(i+1)*page-1
    lanes: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B, C] int64: column c sees key slots 0..positions[b, c]
    span: int,  # key slots each lane's row may read (the round's bound on positions)
    scale: float,
    qkv: torch.Tensor,  # [T, ...]: the projection the gates are read from (as gate_heads_reference reads them)
    nh: int,
) -> torch.Tensor:
    """softmax(q k^T * scale) v over each lane's visible slots, times sigmoid(gate): [T, nh * hd] model dtype."""
    path = route(q)
    if path == "reference":
        return attend_reference(q, kc, vc, table, lanes, visibility(positions, span, q.shape[2]), scale, qkv, nh)
    if path == "triton":
        from ignis.kernels import attention_triton

        return attention_triton.attend(q, kc, vc, table, lanes, positions, span, scale, qkv, nh)
    from ignis.kernels.attention_kernel import THREADS

    if not (q.is_cuda and q.dtype in (torch.bfloat16, torch.float32) and q.shape[-1] <= THREADS):
        raise ValueError(f"the numba attention kernel takes CUDA bf16/fp32 queries of head width <= {THREADS}")

    b, nkv, rows, hd = q.shape
    ns, per = splits(span, b, nkv)
    ks = _compiled(q.dtype, rows, hd)
    opart = torch.empty((b, nkv, ns, rows, hd), dtype=torch.float32, device=q.device)
    mpart = torch.empty((b, nkv, ns, rows), dtype=torch.float32, device=q.device)
    lpart = torch.empty_like(mpart)
    launch(ks["partial"], (ns, nkv, b), THREADS,
           (q, kc, vc, table, lanes, positions, opart, mpart, lpart, float(scale), per), q.device)
    t = b * rows // (nh // nkv)
    y = torch.empty((t, nh * hd), dtype=q.dtype, device=q.device)
    launch(ks["combine"], (nh, t), THREADS, (opart, mpart, lpart, qkv, y, nh), q.device)
    return y
