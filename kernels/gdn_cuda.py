"""The Gated DeltaNet recurrence of a decode or a verify as a CUDA C++ kernel (NVRTC): `columns`, `fits`.

Owns: the launch of ignis.kernels.gdn_cuda_kernel's `gdn_columns` on torch's current stream (capturable), its
argument checks, and which calls it takes (`fits`). Does not own: the source (ignis.kernels.gdn_cuda_kernel), the
numba kernel it stands beside or the torch reference both are tested against (ignis.kernels.gdn), or the switch that
routes to it (`ignis.kernels.gdn.CUDA_COLUMNS`).
"""

from __future__ import annotations

import threading

import torch

from ignis.kernels.gdn_cuda_kernel import CMAX, SOURCE
from ignis.kernels.launch import nvrtc_installed

TV, THREADS = 32, 128  # state columns a block, threads a block (the source's)

_lock = threading.Lock()
_functions: dict[tuple[int, int, torch.device], object] = {}


def defines(dk: int, dv: int) -> tuple[tuple[str, int], ...]:
    return (("DK", dk), ("DV", dv), ("CMAX", CMAX))


def fits(state: torch.Tensor, cols: int) -> bool:
    """The calls the kernel takes: CUDA fp32 states of key heads of a multiple of 16 channels, at most THREADS wide,
    and 1..CMAX columns, with NVRTC installed."""
    dk = state.shape[-2]
    return (state.is_cuda and state.dtype == torch.float32 and 1 <= cols <= CMAX and dk % 16 == 0 and dk <= THREADS
            and nvrtc_installed())


def _function(dk: int, dv: int, device: torch.device) -> object:
    from ignis.kernels.nvrtc import Function, arch_of, compile_cubin

    key = (dk, dv, device)
    with _lock:
        if key not in _functions:
            cubin = compile_cubin(SOURCE, "gdn_columns", arch_of(device), defines(dk, dv))
            _functions[key] = Function(cubin, "gdn_columns", device)
        return _functions[key]


def columns(
    state: torch.Tensor,  # [L, Hv, dk, dv] float32: read, and written where write_state
    lanes: torch.Tensor,  # [B] int64
    mixed: torch.Tensor,  # [B, C, 2 Hk dk + Hv dv] float32 contiguous: q | k | v, q and k normalised (q scaled)
    ba: torch.Tensor,  # [B, C, 2 Hv] float32 contiguous
    dt_bias: torch.Tensor,  # [Hv] float32
    rate: torch.Tensor,  # [Hv] float32
    out: torch.Tensor,  # [B, C, Hv, dv] float32: every column's output
    record: torch.Tensor | None,  # [L, C', Hv, dk + dv + 2] float32, C' >= C, or None
    *,
    key_heads: int,
    write_state: bool,
) -> None:
    """ignis.kernels.gdn.columns' work for `fits`'s calls, writing `out` (and the state or the record)."""
    b, c, width = mixed.shape
    hv, dk, dv = state.shape[1:]
    if not fits(state, c) or not (mixed.is_contiguous() and ba.is_contiguous() and state.is_contiguous()):
        raise ValueError(f"gdn_cuda.columns takes contiguous CUDA fp32 tensors, 1..{CMAX} columns and key heads of a "
                         f"multiple of 16 up to {THREADS} channels; got state {tuple(state.shape)} {state.dtype}, "
                         f"mixed {tuple(mixed.shape)}")
    if record is not None and (record.shape[1] < c or not record.is_contiguous()):
        raise ValueError(f"the record holds {record.shape[1]} columns, fewer than {c}, or is not contiguous")
    rec = record if record is not None else out
    kernel = _function(dk, dv, state.device)
    kernel(((dv + TV - 1) // TV, hv, b), THREADS,  # type: ignore[operator]
           (state, lanes, mixed, ba, dt_bias, rate, out, rec, c, hv, width, key_heads * dk, hv // key_heads,
            rec.shape[1], int(write_state), int(record is not None)))
