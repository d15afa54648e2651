"""The Gated DeltaNet recurrence over C columns of B lanes in one launch, and the commit that replays kept columns.

Owns: `columns`, `columns_normed` (with the gated output norm after), `conv_columns_normed` (the short conv
before them, joined to a decode's launch: `STEP`) and `replay` (numba-cuda kernels on CUDA tensors; a decode's or
verify's columns optionally through ignis.kernels.gdn_cuda's CUDA C++ kernel, `CUDA_COLUMNS`, and a verify's through
ignis.kernels.gdn_chunk's chunk form, `CHUNK_VERIFY`; the replay through ignis.kernels.replay_cuda, `CUDA_REPLAY`;
launched on torch's current stream, so a CUDA graph captures them), their torch references `columns_reference` /
`replay_reference` (what runs on the CPU, and what the kernels are tested against) and `record_width`.
Does not own: the projections, conv and gates around the recurrence (ignis.model.gdn) or where the state lives
(ignis.model.cache). docs/adr/0004-gdn-kernel.md has the why.

The record: a verify does not store the state after every column (3 MiB per column, lane and layer at the 27B
shape); it stores each column's normalised k, its delta = beta (v - (exp(g) S)^T k), g and beta ([dk + dv + 2] floats
per head), and the commit replays columns 0..last from the lane's state, which the verify left untouched, as
S <- exp(g) S + k delta^T: the same operations, in the same order, as the column's own step.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.nn.functional as F

from ignis.kernels.launch import gdn_pdl, launch
from ignis.model.ops import l2norm


def record_width(dk: int, dv: int) -> int:
    return dk + dv + 2


def _step(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
          beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """state [B, Hv, dk, dv]; k [B, Hv, dk] (normalised); v [B, Hv, dv]; g, beta [B, Hv] -> (the state after, the
    column's delta [B, Hv, dv])."""
    state = state * torch.exp(g)[..., None, None]
    memory = (k[..., None, :] @ state)[..., 0, :]
    delta = (v - memory) * beta[..., None]
    return _apply(state, k, delta), delta


def _apply(decayed: torch.Tensor, k: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    return decayed + k[..., :, None] * delta[..., None, :]


def _heads(x: torch.Tensor, hv: int) -> torch.Tensor:
    """[B, Hk, d] -> [B, Hv, d]: value head h reads key head h // (Hv / Hk)."""
    return x.repeat_interleave(hv // x.shape[1], dim=1)


def _split(mixed: torch.Tensor, hk: int, hv: int, dk: int, dv: int) -> tuple[torch.Tensor, ...]:
    b, c = mixed.shape[:2]
    q, k, v = torch.split(mixed, [hk * dk, hk * dk, hv * dv], dim=-1)
    return q.reshape(b, c, hk, dk), k.reshape(b, c, hk, dk), v.reshape(b, c, hv, dv)


def normalise_qk(mixed: torch.Tensor, key_heads: int, dk: int) -> torch.Tensor:
    """mixed [B, C, 2 Hk dk + Hv dv] f32 (q | k | v) -> the same with q and k l2-normalised per head and q scaled by
    dk^-0.5: the form `columns(normalised=True)` reads (ignis.kernels.fused.conv produces it)."""
    b, c = mixed.shape[:2]
    key_dim = key_heads * dk
    q = l2norm(mixed[..., :key_dim].reshape(b, c, key_heads, dk)) * dk**-0.5
    k = l2norm(mixed[..., key_dim : 2 * key_dim].reshape(b, c, key_heads, dk))
    return torch.cat([q.flatten(2), k.flatten(2), mixed[..., 2 * key_dim :]], dim=-1)


def gates(ba: torch.Tensor, dt_bias: torch.Tensor, rate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) [B, C, Hv] float32 from the raw projections ba [B, C, 2 Hv]: beta = sigmoid(b), g = rate *
    softplus(a + dt_bias), as the layer computes them (ignis.model.gdn)."""
    hv = ba.shape[-1] // 2
    return rate * F.softplus(ba[..., hv:] + dt_bias), torch.sigmoid(ba[..., :hv])


def columns_reference(
    state: torch.Tensor, lanes: torch.Tensor, mixed: torch.Tensor, ba: torch.Tensor, dt_bias: torch.Tensor,
    rate: torch.Tensor, record: torch.Tensor | None, *, key_heads: int, write_state: bool, normalised: bool = False,
) -> torch.Tensor:
    """`columns` in torch (same arguments); returns out [B, C, Hv, dv] float32."""
    hv, dk, dv = state.shape[1], state.shape[2], state.shape[3]
    q, k, v = _split(mixed, key_heads, hv, dk, dv)
    g, beta = gates(ba, dt_bias, rate)
    st = state.index_select(0, lanes)
    outs = []
    for j in range(q.shape[1]):
        kj = _heads(k[:, j] if normalised else l2norm(k[:, j]), hv)
        qj = _heads(q[:, j] if normalised else l2norm(q[:, j]) * dk**-0.5, hv)
        st, delta = _step(st, kj, v[:, j], g[:, j], beta[:, j])
        outs.append((qj[..., None, :] @ st)[..., 0, :])
        if record is not None:
            row = torch.cat([kj, delta, g[:, j, :, None], beta[:, j, :, None]], dim=-1)  # [B, Hv, width]
            record[:, j].index_copy_(0, lanes, row)
    if write_state:
        state.index_copy_(0, lanes, st)
    return torch.stack(outs, dim=1)


def replay_reference(state: torch.Tensor, lanes: torch.Tensor, record: torch.Tensor, last: torch.Tensor) -> None:
    """`replay` in torch: apply recorded columns 0..last[b] to each lane's state."""
    dk, dv = state.shape[2], state.shape[3]
    rec = record.index_select(0, lanes)  # [B, C, Hv, width]
    st = state.index_select(0, lanes)
    for j in range(rec.shape[1]):
        r = rec[:, j]
        after = _apply(st * torch.exp(r[..., dk + dv])[..., None, None], r[..., :dk], r[..., dk : dk + dv])
        st = torch.where((j <= last)[:, None, None, None], after, st)
    state.index_copy_(0, lanes, st)


def window_reference(conv: torch.Tensor, inputs: torch.Tensor, lanes: torch.Tensor, last: torch.Tensor,
                     taps: torch.Tensor) -> None:
    """`window` in torch; taps [Kc-1] int64 = 1..Kc-1 on the device."""
    # Rows of [old window | column inputs]: the window ending at column `last` is rows last+1..last+Kc-1.
    both = torch.cat([conv.index_select(0, lanes), inputs.index_select(0, lanes)], dim=1)
    rows = (last[:, None] + taps)[:, :, None].expand(-1, -1, both.shape[-1])
    conv.index_copy_(0, lanes, both.gather(1, rows))


_lock = threading.Lock()
_kernels: dict[tuple[int, int, int], Any] = {}
VERIFY_TILE = 8  # the staging tile of a verify (at most 8 columns: spec.draft_tokens + 1) and of a short prefill piece
# Whether a decode's or a verify's columns (up to 8) run the CUDA C++ kernel of ignis.kernels.gdn_cuda instead of the
# numba one, and where they do, whether `columns_normed` runs its whole-head kernel with the gated output norm joined
# (one block of 512 threads a head, CUDA_NORMED) or the recurrence alone (blocks of 32 state columns, six of them an
# SM: gdn_cuda.BLOCKS) followed by the norm's own launch. On the H200 at the 27B shape (tools.bench_gdn, µs a layer,
# numba / the whole head / the recurrence alone at six blocks): decode 1 x 1 5.8 / 5.4 / 5.4, verify 1 x 8 9.6 / 8.9
# / 9.1, decode 8 x 1 20.3 / 19.5 / 19.6, verify 8 x 8 33.0 / 32.0 / 28.9; the 8 x 8 verify round 0.2 ms faster
# (tools.bench_round --gdn numba,cuda6), the others within their spread. CUDA_NORMED None (the default): the whole
# head where the round launches the GDN's kernels programmatic-dependent (ignis.kernels.launch.gdn_pdl), so the
# product after it loads its weight while the recurrence ends (the 4-bit decode step 5.93 -> 5.76 ms); the
# recurrence alone elsewhere. Set once, before the engine captures its graphs.
CUDA_COLUMNS = True
CUDA_NORMED: bool | None = None
# Whether `conv_columns_normed` joins a decode's short conv (one column) to the recurrence's launch where
# CUDA_COLUMNS routes it to the CUDA C++ kernel (ignis.kernels.gdn_cuda.step: a block convolves the channels it reads
# itself), or runs ignis.kernels.fused.conv's launch before it. On the H200 at the 27B shape (tools.bench_round --gdn
# apart,step): the 1 x 1 decode's replay 14.50-14.57 ms joined against 14.64-14.68 apart, the 8 x 1 the same (15.91
# against 15.90). A verify's conv stays apart: joined, every block of a key head's group convolves the head's 8
# columns, and the 1 x 8 verify's replay took 15.47 ms against 15.31, the 8 x 8 18.46 against 17.81. Set once, before
# the engine captures its graphs.
STEP = True
# Whether a verify's recurrence (its columns recorded, the state left alone) runs in chunk form where
# ignis.kernels.gdn_chunk takes it: the state read once into every column's sums, the columns' deltas and outputs
# solved per value column after (gdn_chunk_kernel has the algebra), instead of column by column. On the H200 at the
# 27B shape a layer's 8 x 8 verify 29.3 -> 25.1 µs, the 1 x 8 9.0 -> 7.3 (docs/adr/0016). Set once, before the engine
# captures its graphs.
CHUNK_VERIFY = True
# Whether the commit's replay runs ignis.kernels.replay_cuda's CUDA C++ kernel (whole rows of the state a warp, as
# 16-byte vectors; a lane that keeps nothing untouched) where it takes the call, instead of the numba one: 48 layers'
# commit of 8 columns at 8 lanes 1,037 -> 656 µs on the H200 (docs/adr/0016). Set once, before the engine captures
# its graphs.
CUDA_REPLAY = True
# The most lanes at which a verify's short conv joins the chunk form's launch (ignis.kernels.gdn_chunk.step: every
# block of a key head's group convolves the head's q and k channels itself) instead of ignis.kernels.fused.conv's
# launch before it; 0: never. Set once, before the engine captures its graphs.
CHUNK_CONV_LANES = 2


def _compiled(dk: int, dv: int, cols: int) -> Any:
    """ignis.kernels.gdn_kernel.Kernels for heads of dk x dv staging `cols` columns at a time."""
    with _lock:
        if (dk, dv, cols) not in _kernels:
            from ignis.kernels.gdn_kernel import make_kernels

            _kernels[dk, dv, cols] = make_kernels(dk, dv, cols)
        return _kernels[dk, dv, cols]


def _tile(dk: int, dv: int, cols: int) -> int:
    """The staging tile a launch over `cols` columns compiles with: one column for a decode, VERIFY_TILE for a verify or
    a short prefill piece, else the largest tile that fits: three compiled kernels serve every column count."""
    from ignis.kernels.gdn_kernel import column_tile

    if cols == 1:
        return 1
    return VERIFY_TILE if cols <= VERIFY_TILE else column_tile(dk, dv)


def _launch(kernel: Any, dv: int, hv: int, b: int, dk: int, args: tuple[Any, ...], device: torch.device) -> None:
    from ignis.kernels.gdn_kernel import block_shape

    tv, threads = block_shape(dk, dv)
    launch(kernel, ((dv + tv - 1) // tv, hv, b), threads, args, device)


def _chunked(state: torch.Tensor, cols: int, record: torch.Tensor | None, write_state: bool) -> bool:
    """Whether CHUNK_VERIFY routes these columns to ignis.kernels.gdn_chunk: a verify it takes."""
    if not (CUDA_COLUMNS and CHUNK_VERIFY and state.is_cuda and record is not None and not write_state):
        return False
    from ignis.kernels import gdn_chunk

    return gdn_chunk.fits(state, cols, record)


def columns(
    state: torch.Tensor,  # [L, Hv, dk, dv] float32, device
    lanes: torch.Tensor,  # [B] int64, device
    mixed: torch.Tensor,  # [B, C, 2 Hk dk + Hv dv] float32: q | k | v (as `normalise_qk` leaves them if normalised)
    ba: torch.Tensor,  # [B, C, 2 Hv] float32: the raw beta and decay projections
    dt_bias: torch.Tensor,  # [Hv] float32
    rate: torch.Tensor,  # [Hv] float32: -exp(A_log)
    record: torch.Tensor | None,  # [L, max_cols, Hv, dk + dv + 2] float32 or None
    *,
    key_heads: int,
    write_state: bool,
    normalised: bool = False,
) -> torch.Tensor:
    """out [B, C, Hv, dv] float32: every column's output. write_state: keep the state after the last column (decode);
    record: store each column for `replay` (verify); normalised: q and k in `mixed` are l2-normalised already (and q
    scaled), as ignis.kernels.fused.conv leaves them. CUDA tensors go to the kernel, others to the reference."""
    if not state.is_cuda:
        return columns_reference(state, lanes, mixed, ba, dt_bias, rate, record, key_heads=key_heads,
                                 write_state=write_state, normalised=normalised)
    b, c = mixed.shape[:2]
    hv, dk, dv = state.shape[1], state.shape[2], state.shape[3]
    if not normalised:  # the kernel reads q and k as the fused conv leaves them
        mixed = normalise_qk(mixed, key_heads, dk)
    mixed, ba = mixed.contiguous(), ba.contiguous()
    out = torch.empty((b, c, hv, dv), dtype=torch.float32, device=mixed.device)
    if _chunked(state, c, record, write_state):
        from ignis.kernels import gdn_chunk

        assert record is not None
        gdn_chunk.columns(state, lanes, mixed, ba, dt_bias, rate, out, record, key_heads=key_heads)
        return out
    if CUDA_COLUMNS:
        from ignis.kernels import gdn_cuda

        if gdn_cuda.fits(state, c, record):
            gdn_cuda.columns(state, lanes, mixed, ba, dt_bias, rate, out, record, key_heads=key_heads,
                             write_state=write_state)
            return out
    rec = record if record is not None else out  # a placeholder of the right type when nothing is recorded
    kernels = _compiled(dk, dv, _tile(dk, dv, c))
    args = (state, lanes, mixed, ba, dt_bias, rate, out, rec, hv // key_heads, key_heads * dk)
    _launch(kernels.columns, dv, hv, b, dk, (*args, write_state, record is not None), mixed.device)
    return out


def columns_normed(
    state: torch.Tensor, lanes: torch.Tensor, mixed: torch.Tensor, ba: torch.Tensor, dt_bias: torch.Tensor,
    rate: torch.Tensor, record: torch.Tensor | None,  # as `columns`
    z: torch.Tensor,  # [B C, Hv dv] model dtype: the output gate
    weight: torch.Tensor,  # [dv] model dtype: the output norm's weight
    eps: float,
    *,
    key_heads: int,
    write_state: bool,
    normalised: bool = False,
) -> torch.Tensor:
    """`columns`, then the gated output norm of its outputs (ignis.kernels.fused.gated_norm): y [B C, Hv dv] in z's
    dtype. One launch where CUDA_COLUMNS routes a decode or a verify to ignis.kernels.gdn_cuda, whose blocks then hold
    a whole head; `columns` and `gated_norm` elsewhere (the CPU among it)."""
    from ignis.kernels import fused

    b, c = mixed.shape[:2]
    hv, dk, dv = state.shape[1], state.shape[2], state.shape[3]
    if (CUDA_COLUMNS and state.is_cuda and (CUDA_NORMED if CUDA_NORMED is not None else gdn_pdl(state.device))
            and not _chunked(state, c, record, write_state)):
        from ignis.kernels import gdn_cuda

        if gdn_cuda.fits_normed(state, c, record, z):
            if not normalised:
                mixed = normalise_qk(mixed, key_heads, dk)
            return gdn_cuda.columns_normed(state, lanes, mixed.contiguous(), ba.contiguous(), dt_bias, rate, record,
                                           z, weight, eps, key_heads=key_heads, write_state=write_state)
    out = columns(state, lanes, mixed, ba, dt_bias, rate, record, key_heads=key_heads, write_state=write_state,
                  normalised=normalised)
    return fused.gated_norm(out.view(b * c, hv, dv), z, weight, eps)


def conv_columns_normed(
    window: torch.Tensor, raw: torch.Tensor, taps: torch.Tensor, ba: torch.Tensor,
    inputs: torch.Tensor | None,  # ignis.kernels.fused.conv's window, raw, weight, ba and record
    state: torch.Tensor, lanes: torch.Tensor, dt_bias: torch.Tensor, rate: torch.Tensor,
    record: torch.Tensor | None, z: torch.Tensor, weight: torch.Tensor, eps: float,  # as `columns_normed`
    *,
    key_heads: int,
    write_state: bool,
) -> torch.Tensor:
    """ignis.kernels.fused.conv of a decode's or a verify's columns, then `columns_normed` of its output: y [B C, Hv dv]
    in z's dtype, the conv's window moved on (inputs None) or its inputs recorded. Where STEP and CUDA_COLUMNS route
    a decode's call to ignis.kernels.gdn_cuda, or CHUNK_CONV_LANES a verify's to ignis.kernels.gdn_chunk, the conv
    joins the recurrence's launch; two launches or three elsewhere."""
    from ignis.kernels import fused

    dk = state.shape[2]
    if STEP and CUDA_COLUMNS and state.is_cuda and raw.shape[1] == 1:
        from ignis.kernels import gdn_cuda

        conv = gdn_cuda.Conv(window, raw, taps, ba, inputs)
        if CUDA_NORMED if CUDA_NORMED is not None else gdn_pdl(state.device):
            if gdn_cuda.fits_step(state, conv, record, z):
                return gdn_cuda.step_normed(state, lanes, conv, dt_bias, rate, record, z, weight, eps,
                                            key_heads=key_heads, write_state=write_state)
        elif gdn_cuda.fits_step(state, conv, record):
            out = gdn_cuda.step(state, lanes, conv, dt_bias, rate, record, key_heads=key_heads,
                                write_state=write_state)
            b, c = raw.shape[:2]
            return fused.gated_norm(out.view(b * c, state.shape[1], state.shape[3]), z, weight, eps)
    b, c = raw.shape[:2]
    if inputs is not None and b <= CHUNK_CONV_LANES and _chunked(state, c, record, write_state):
        from ignis.kernels import gdn_chunk, gdn_cuda

        assert record is not None
        joined = gdn_cuda.Conv(window, raw, taps, ba, inputs)
        if gdn_chunk.fits_step(state, joined, record):
            out = gdn_chunk.step(state, lanes, joined, dt_bias, rate, record, key_heads=key_heads)
            return fused.gated_norm(out.view(b * c, state.shape[1], state.shape[3]), z, weight, eps)
    mixed, ba32 = fused.conv(window, lanes, raw, taps, ba, inputs, key_heads=key_heads, dk=dk)
    return columns_normed(state, lanes, mixed, ba32, dt_bias, rate, record, z, weight, eps, key_heads=key_heads,
                          write_state=write_state, normalised=True)


def replay(state: torch.Tensor, lanes: torch.Tensor, record: torch.Tensor, last: torch.Tensor) -> None:
    """Apply recorded columns 0..last[b] (last [B] int64, device) to each lane's state, in place: one layer's (state
    [L, Hv, dk, dv], record [L, C, Hv, dk + dv + 2]) or G layers' at once (state [G, L, ...], record [G, L, ...]),
    one launch either way."""
    if state.dim() == 4:
        state, record = state[None], record[None]
    if not state.is_cuda:
        for st, rec in zip(state, record):
            replay_reference(st, lanes, rec, last)
        return
    if CUDA_REPLAY:
        from ignis.kernels import replay_cuda

        if replay_cuda.fits(state, record):
            replay_cuda.replay(state, lanes, record, last)
            return
    dk, dv, hv = state.shape[3], state.shape[4], state.shape[2]
    rep = _compiled(dk, dv, _tile(dk, dv, record.shape[2])).replay
    _launch(rep, dv, hv, state.shape[0] * lanes.shape[0], dk, (state, lanes, record, last, dv), state.device)


_window_kernel: list[Any] = []


def window(conv: torch.Tensor, inputs: torch.Tensor, lanes: torch.Tensor, last: torch.Tensor,
           taps: torch.Tensor) -> None:
    """After a verify: move each lane's conv window (conv [L, Kc-1, D]) to end at column last[b] of the inputs the
    verify recorded (inputs [L, C, D], same dtype), in place; taps [Kc-1] = 1..Kc-1 (the reference's). G layers' at
    once take conv [G, L, Kc-1, D] and inputs [G, L, C, D]: one launch either way."""
    if conv.dim() == 3:
        conv, inputs = conv[None], inputs[None]
    if not conv.is_cuda:
        for cv, inp in zip(conv, inputs):
            window_reference(cv, inp, lanes, last, taps)
        return
    from ignis.kernels.gdn_kernel import WINDOW_THREADS, make_window_kernel

    with _lock:
        if not _window_kernel:
            _window_kernel.append(make_window_kernel())
    grid = ((conv.shape[3] + WINDOW_THREADS - 1) // WINDOW_THREADS, conv.shape[0] * lanes.shape[0])
    launch(_window_kernel[0], grid, WINDOW_THREADS, (conv, inputs, lanes, last), conv.device)
