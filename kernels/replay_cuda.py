"""The commit's replay of a verify's kept columns as a CUDA C++ kernel (NVRTC): `replay`, `fits`, `defines`.

Owns: the launch of ignis.kernels.replay_cuda_kernel's `gdn_replay` on torch's current stream (capturable), its block
shape, its argument checks and which calls it takes. Does not own: the source (replay_cuda_kernel), the numba kernel
it stands beside or the torch reference both are tested against (ignis.kernels.gdn: `replay`, `replay_reference`), or
the switch that routes to it (`ignis.kernels.gdn.CUDA_REPLAY`).
"""

from __future__ import annotations

import torch

from ignis.kernels.launch import nvrtc_installed
from ignis.kernels.nvrtc import load
from ignis.kernels.replay_cuda_kernel import SOURCE

# State rows a block, at most (fewer for narrower key heads). On the H200, 48 layers' commit of 8 kept columns
# (tools.bench_gdn --replays numba,cuda16,cuda32,cuda64,cuda128), µs at 1 / 8 lanes: numba 138 / 1,037, 16 rows 127 /
# 971, 32 114 / 874, 64 94 / 656 (1.05-1.09x the state's bytes at the copy bandwidth), 128 102 / 699.
ROWS = 64


def _rows(dk: int) -> int:
    return min(ROWS, dk)


def defines(dk: int, dv: int, cols: int) -> tuple[tuple[str, int], ...]:
    """The source's sizes for heads of dk x dv and records of `cols` columns."""
    return (("DK", dk), ("DV", dv), ("CMAX", cols), ("RB", _rows(dk)))


def fits(state: torch.Tensor, record: torch.Tensor) -> bool:
    """The calls the kernel takes: contiguous CUDA fp32 states [G, L, Hv, dk, dv] and records, key heads a multiple of
    4 channels that split into blocks of ROWS rows (or fewer than ROWS), value heads a multiple of 4 up to 512, records
    whose columns' k and delta fit the 48 KiB of static shared memory, with NVRTC installed."""
    dk, dv = state.shape[-2], state.shape[-1]
    return (state.is_cuda and state.dtype == torch.float32 and record.dtype == torch.float32 and state.dim() == 5
            and state.is_contiguous() and record.is_contiguous() and dk % 4 == 0 and dk % _rows(dk) == 0
            and dv % 4 == 0 and dv <= 512 and 4 * record.shape[2] * (_rows(dk) + dv + 1) <= 48 * 1024
            and nvrtc_installed())


def replay(state: torch.Tensor, lanes: torch.Tensor, record: torch.Tensor, last: torch.Tensor) -> None:
    """ignis.kernels.gdn.replay for `fits`'s calls: state [G, L, Hv, dk, dv], record [G, L, C, Hv, dk + dv + 2]; lanes,
    last [B] int64 on the device."""
    if not fits(state, record):
        raise ValueError(f"replay_cuda.replay takes contiguous CUDA fp32 states [G, L, Hv, dk, dv] and records; got "
                         f"state {tuple(state.shape)} {state.dtype}, record {tuple(record.shape)}")
    g, nl, hv, dk, dv = state.shape
    b = lanes.shape[0]
    kernel = load(SOURCE, "gdn_replay", defines(dk, dv, record.shape[2]), state.device)
    kernel((dk // _rows(dk), hv, g * b), dv,  # type: ignore[operator]  # dv / 4 float4s a row, four row lanes
           (state, lanes.contiguous(), record, last.contiguous(), b, nl, hv, record.shape[2]))
