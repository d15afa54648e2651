"""The Gated DeltaNet recurrence of a decode or a verify as a CUDA C++ kernel (NVRTC): `columns`, `columns_normed`,
`fits`, `fits_normed`.

Owns: the launches of ignis.kernels.gdn_cuda_kernel's `gdn_columns` on torch's current stream (capturable): the
recurrence alone (blocks of 32 state columns), or with the gated output norm applied in the same launch (a block a
whole head), each also with the short conv joined (`step`, `step_normed`, `fits_step`: the kernel built with CONV and
the counters its decodes meet through); their argument checks and which calls they take. Does not own: the source
(ignis.kernels.gdn_cuda_kernel), the numba kernel it stands beside or the torch references all are tested against
(ignis.kernels.gdn, ignis.kernels.fused.gated_norm), or the switch that routes to it
(`ignis.kernels.gdn.CUDA_COLUMNS`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from ignis.kernels.gdn_cuda_kernel import CMAX, SOURCE
from ignis.kernels.launch import gdn_pdl, nvrtc_installed
from ignis.kernels.nvrtc import load

TV = 32  # state columns a block of the recurrence alone (128 threads)
RS = 4  # threads a state column
# The recurrence alone: blocks an SM its registers are bounded for, and whether a thread keeps a column's k in
# registers between the column's two passes. 4 and kept: 105 registers (ptxas for sm_90). Six blocks need at most 85
# registers a thread, which k read again from shared memory gives (80); at 8 lanes x 48 heads x 4 blocks a head that
# is 1,536 blocks in two waves on 132 SMs instead of three: the 8 x 8 verify 32.1 -> 28.9 µs a layer on the H200
# (tools.bench_gdn --kernels cuda4,cuda6), the others within 1%.
BLOCKS = 6
KEEP_K = False
# The joined conv's kernel (`step`): the blocks an SM its registers are bounded for; None: BLOCKS.
STEP_BLOCKS: int | None = None

_lock = threading.Lock()


def defines(dk: int, dv: int, normed: bool = False, dtype: torch.dtype = torch.float32,
            early: bool = False, conv: tuple[torch.dtype, int, int] | None = None) -> tuple[tuple[str, int], ...]:
    """The source's sizes: a block of TV state columns, or the whole head (DV) where it applies the norm too; early:
    launched programmatic-dependent (launch.gdn_pdl); conv: the short conv joined (its inputs' dtype, its taps and
    the launch's columns: a decode's one column builds its own binary, whose staging holds a column's registers)."""
    joined = () if conv is None else (("CONV", 1), ("CBF16", int(conv[0] == torch.bfloat16)), ("KC", conv[1]))
    cmax = 1 if conv is not None and conv[2] == 1 else CMAX
    blocks = STEP_BLOCKS if conv is not None and STEP_BLOCKS is not None else BLOCKS
    return (("DK", dk), ("DV", dv), ("CMAX", cmax), ("TV", dv if normed else TV), ("NORMED", int(normed)),
            ("BF16", int(dtype == torch.bfloat16)), ("MINB", 1 if normed else blocks),
            ("KEEP_K", int(KEEP_K or normed)), ("PDL", int(early))) + joined


def fits(state: torch.Tensor, cols: int, record: torch.Tensor | None) -> bool:
    """The calls the kernel takes: contiguous CUDA fp32 states of key heads of a multiple of 16 channels, at most 128
    wide, 1..CMAX columns and a contiguous record (or none), with NVRTC installed."""
    dk = state.shape[-2]
    return (state.is_cuda and state.dtype == torch.float32 and state.is_contiguous() and 1 <= cols <= CMAX
            and dk % 16 == 0 and dk <= 128 and (record is None or record.is_contiguous()) and nvrtc_installed())


def fits_normed(state: torch.Tensor, cols: int, record: torch.Tensor | None, z: torch.Tensor) -> bool:
    """`fits`, with value heads of a multiple of 8, at most 128 wide (a block of 4 threads a state column holds the
    head), and a bf16 or fp32 gate whose last dimension is contiguous."""
    dv = state.shape[-1]
    return (fits(state, cols, record) and dv % 8 == 0 and dv <= 128 and z.dtype in (torch.bfloat16, torch.float32)
            and z.stride(-1) == 1)


@dataclass(frozen=True)
class Conv:
    """The short conv `step` joins to the recurrence: ignis.kernels.fused.conv's arguments."""

    window: torch.Tensor  # [L, Kc-1, D] model dtype, last dim contiguous
    raw: torch.Tensor  # [B, C, D] model dtype, last dim contiguous
    taps: torch.Tensor  # [D, Kc] float32 contiguous
    ba: torch.Tensor  # [B, C, 2 Hv] model dtype, last dim contiguous: the raw beta and decay projections
    record: torch.Tensor | None  # [L, C', D] model dtype, C' >= C: a verify's inputs; None: move the window


_counts: dict[torch.device, torch.Tensor] = {}
COUNTS = 1 << 16  # the key heads x lanes a step's window counters cover before they grow


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters, one a lane's key head: the blocks of a head's group count themselves in, and the last
    moves the window and sets its counter back to zero. Made once a device (before any graph captures them)."""
    with _lock:
        have = _counts.get(device)
        if have is None or have.numel() < n:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("gdn_cuda.step's counters must be made before a CUDA graph captures the step")
            _counts[device] = have = torch.zeros(max(n, COUNTS), dtype=torch.int32, device=device)
        return have


def _launch(state: torch.Tensor, lanes: torch.Tensor, mixed: torch.Tensor | None, ba: torch.Tensor | None,
            dt_bias: torch.Tensor, rate: torch.Tensor, out: torch.Tensor, record: torch.Tensor | None, key_heads: int,
            write_state: bool, normed: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None,
            conv: Conv | None = None) -> None:
    hv, dk, dv = state.shape[1:]
    if conv is None:
        assert mixed is not None and ba is not None
        b, c, width = mixed.shape
        if not (mixed.is_contiguous() and ba.is_contiguous()) or mixed.dtype != torch.float32:
            raise ValueError(f"gdn_cuda takes contiguous fp32 mixed and ba; got mixed {tuple(mixed.shape)} "
                             f"{mixed.dtype}")
        joined: tuple[torch.Tensor | int | float, ...] = (state,) * 6 + (0,) * 8 + (0.0,)
        conv_key = None
    else:
        b, c, width = conv.raw.shape
        mixed = ba = state  # placeholders: not read
        inputs = conv.record if conv.record is not None else conv.window
        strides = (*conv.window.stride()[:2], *conv.raw.stride()[:2], *inputs.stride()[:2], *conv.ba.stride()[:2])
        if max(strides) >= 2**31:
            raise ValueError(f"gdn_cuda.step takes strides below 2**31 (the kernel's int offsets); got {strides}")
        counts = _counters(state.device, b * key_heads)
        joined = (conv.window, conv.raw, conv.taps, inputs, conv.ba, counts, *strides, float(dk**-0.5))
        conv_key = (conv.raw.dtype, conv.taps.shape[1], c)
    if record is not None and record.shape[1] < c:
        raise ValueError(f"the record holds {record.shape[1]} columns, fewer than {c}")
    rec = record if record is not None else out  # a placeholder of the right type when nothing is recorded
    early = gdn_pdl(state.device)
    if normed is None:
        z = weight = y = out  # placeholders: not read
        z_row, eps, tv = 0, 0.0, TV
        key = defines(dk, dv, early=early, conv=conv_key)
    else:
        z, weight, y, eps = normed
        z_row, tv = z.stride(0), dv
        key = defines(dk, dv, True, z.dtype, early, conv_key)
    kernel = load(SOURCE, "gdn_columns", key, state.device)
    kernel(((dv + tv - 1) // tv, hv, b), tv * RS,  # type: ignore[operator]
           (state, lanes, mixed, ba, dt_bias, rate, out, rec, z, weight, y, c, hv, width, key_heads * dk,
            hv // key_heads, rec.shape[1], int(write_state), int(record is not None), z_row, float(eps), *joined),
           early)


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
    if not fits(state, mixed.shape[1], record):
        raise ValueError(f"gdn_cuda.columns takes contiguous CUDA fp32 states, 1..{CMAX} columns and key heads of a "
                         f"multiple of 16 up to 128 channels; got state {tuple(state.shape)} {state.dtype}, mixed "
                         f"{tuple(mixed.shape)}")
    _launch(state, lanes, mixed, ba, dt_bias, rate, out, record, key_heads, write_state, None)


def columns_normed(
    state: torch.Tensor, lanes: torch.Tensor, mixed: torch.Tensor, ba: torch.Tensor, dt_bias: torch.Tensor,
    rate: torch.Tensor, record: torch.Tensor | None,  # as `columns`
    z: torch.Tensor,  # [B C, Hv dv] bf16 or fp32, last dim contiguous: the gate
    weight: torch.Tensor,  # [dv], z's dtype: the norm's weight
    eps: float,
    *,
    key_heads: int,
    write_state: bool,
) -> torch.Tensor:
    """`columns` and then ignis.kernels.fused.gated_norm of its output, in one launch: y [B C, Hv dv] in z's dtype."""
    b, c = mixed.shape[:2]
    hv, dv = state.shape[1], state.shape[3]
    if not fits_normed(state, c, record, z) or weight.dtype != z.dtype or z.shape != (b * c, hv * dv):
        raise ValueError(f"gdn_cuda.columns_normed takes `fits`'s calls with value heads of a multiple of 8 up to 128 "
                         f"and a gate [B C, Hv dv] of the weight's dtype; got state {tuple(state.shape)}, z "
                         f"{tuple(z.shape)} {z.dtype}, weight {weight.dtype}")
    y = torch.empty((b * c, hv * dv), dtype=z.dtype, device=z.device)
    _launch(state, lanes, mixed, ba, dt_bias, rate, y, record, key_heads, write_state,
            (z, weight.contiguous(), y, eps))
    return y


def fits_step(state: torch.Tensor, conv: Conv, record: torch.Tensor | None, z: torch.Tensor | None = None) -> bool:
    """`fits` (or `fits_normed` given the gate z) for `step`'s calls, whose conv inputs are CUDA bf16 or fp32 with
    contiguous last dimensions (the taps wholly) and whose blocks hold a thread for each key channel."""
    c = conv.raw.shape[1]
    dk, dv = state.shape[-2], state.shape[-1]
    threads = dv * RS if z is not None else TV * RS
    return ((fits_normed(state, c, record, z) if z is not None else fits(state, c, record)) and threads >= dk
            and conv.raw.dtype in (torch.bfloat16, torch.float32) and conv.taps.is_contiguous()
            and conv.taps.dtype == torch.float32 and conv.taps.shape[1] == conv.window.shape[1] + 1
            and all(t.dtype == conv.raw.dtype and t.stride(-1) == 1
                    for t in (conv.window, conv.raw, conv.ba) + ((conv.record,) if conv.record is not None else ())))


def step(state: torch.Tensor, lanes: torch.Tensor, conv: Conv, dt_bias: torch.Tensor, rate: torch.Tensor,
         record: torch.Tensor | None, *, key_heads: int, write_state: bool) -> torch.Tensor:
    """ignis.kernels.fused.conv and then `columns` in one launch: out [B, C, Hv, dv] float32. The conv's window moves
    on (conv.record None) or each column's input is recorded, as fused.conv does; the recurrence's record and state as
    `columns`. A launch's blocks meet through counters of this module's (one a lane's key head), so two launches of it
    must not run at once on two streams."""
    b, c = conv.raw.shape[:2]
    hv, dv = state.shape[1], state.shape[3]
    if not fits_step(state, conv, record):
        raise ValueError(f"gdn_cuda.step takes `fits`'s calls with conv inputs of the raw's dtype; got state "
                         f"{tuple(state.shape)}, raw {tuple(conv.raw.shape)} {conv.raw.dtype}")
    out = torch.empty((b, c, hv, dv), dtype=torch.float32, device=state.device)
    _launch(state, lanes, None, None, dt_bias, rate, out, record, key_heads, write_state, None, conv)
    return out


def step_normed(state: torch.Tensor, lanes: torch.Tensor, conv: Conv, dt_bias: torch.Tensor, rate: torch.Tensor,
                record: torch.Tensor | None, z: torch.Tensor, weight: torch.Tensor, eps: float, *, key_heads: int,
                write_state: bool) -> torch.Tensor:
    """`step` with the gated output norm joined, as `columns_normed`: y [B C, Hv dv] in z's dtype."""
    b, c = conv.raw.shape[:2]
    hv, dv = state.shape[1], state.shape[3]
    if not fits_step(state, conv, record, z) or weight.dtype != z.dtype or z.shape != (b * c, hv * dv):
        raise ValueError(f"gdn_cuda.step_normed takes `fits_step`'s calls and a gate [B C, Hv dv] of the weight's "
                         f"dtype; got state {tuple(state.shape)}, z {tuple(z.shape)} {z.dtype}")
    y = torch.empty((b * c, hv * dv), dtype=z.dtype, device=z.device)
    _launch(state, lanes, None, None, dt_bias, rate, y, record, key_heads, write_state,
            (z, weight.contiguous(), y, eps), conv)
    return y
