"""The numba-cuda kernels of the Gated DeltaNet recurrence over C columns of B lanes: `columns` and `replay`, the
layout and state access they share, and the conv window's move after a commit (`window`); `make_kernels` builds the
first two.

Owns: the kernel sources and their block shape. Does not own: argument checks, the torch reference or the launch
on torch's stream (ignis.kernels.gdn). Importing this module imports numba.cuda (or, with NUMBA_ENABLE_CUDASIM=1,
the simulator); nothing here touches the driver.

Block (TV * RS threads) = one value head of one lane, TV columns of its [dk, dv] state; thread (c, s) keeps rows
s, s + RS, s + 2 RS, .. of column c in registers, so the state is read once and every column's update and output are
sums over a thread's own rows plus RS partials combined by warp shuffles (the simulator runs them through the test
suite's warp shim). A staged column of k or q is stored permuted (`slot`): each thread's rows in runs of four, the
four threads' runs side by side, so a thread reads its k and q as 16-byte vectors (ld.shared.v4, one load per four
multiply-adds rather than one per multiply-add; numba emits them for an unsigned index into a 16-byte aligned array)
and the four threads of a state column read four distinct banks (rows in blocks of dk/RS would put all four on one
bank: a four-way conflict on every read). Each thread reads a column's k once. Per column j, with k and q
l2-normalised (q also scaled) by the conv that produced them, beta = sigmoid(b) and g = rate * softplus(a + dt_bias)
from the raw projections:
    S <- exp(g) S;  delta = beta (v - S^T k);  S <- S + k delta^T;  o = S^T q
`columns` runs that loop and writes o for every column and either the final state (decode, a prefill piece) or each
column's record (verify). The record is a column's normalised k, its delta, g and beta; `replay` later applies
columns 0..last to the lane's state as S <- exp(g) S + k delta^T, so the state is read by the verify and read and
written by the commit, never stored per column.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from numba import cuda, float32, uint64
from numba.cuda.core import config

RS = 4  # threads that share one state column (row slices of dk): consecutive lanes of a warp
FULL = 0xFFFFFFFF  # the full-warp mask: every block is whole warps (TV * RS = 128, or 32 in the tests)
EPS = 1e-6  # l2norm's epsilon (ignis.model.ops.l2norm)


def block_shape(dk: int, dv: int) -> tuple[int, int]:
    """(TV, threads): TV columns a block, 8 to 32, a power of two; threads = TV * RS."""
    tv = 32
    while tv > dv and tv > 8:  # at least 8 columns: a block is whole warps (the partial sums are warp shuffles)
        tv //= 2
    return tv, tv * RS


@cuda.jit(device=True, inline=True)
def quad_sum(x):  # numba device function: typed by numba, not annotated
    """The sum of x over the RS = 4 consecutive lanes that share a state column (the same in all four)."""
    x += cuda.shfl_xor_sync(FULL, x, 1)
    return x + cuda.shfl_xor_sync(FULL, x, 2)


def column_tile(dk: int, dv: int) -> int:
    """Columns a block stages at once: as many as fit in 40 KiB of shared memory (static shared memory stops at
    48 KiB), a power of two."""
    tv, _ = block_shape(dk, dv)
    per = 4 * (2 * dk + tv + 2)  # bytes a column: k and q, the block's v, g and beta
    tile = 1
    while 2 * tile * per <= 40 * 1024:
        tile *= 2
    return tile


@cuda.jit(device=True, inline=True)
def gates(ba, b, j, h, hv, dt_bias, rate):  # numba device function: typed by numba, not annotated
    """(g, beta) of head h at column j of lane b from the raw projections: rate * softplus(a + dt_bias), sigmoid(b)."""
    beta = float32(1.0) / (float32(1.0) + math.exp(-ba[b, j, h]))
    a = ba[b, j, hv + h] + dt_bias[h]
    return rate[h] * (a if a > float32(20.0) else math.log1p(math.exp(a))), beta


class Layout(NamedTuple):
    """A kernel's shape of work, fixed when it is built."""

    tv: int  # state columns a block
    threads: int  # TV * RS
    rows: int  # a thread's rows of a state column: dk / RS
    vec: int  # of them one shared load carries: 4 (16 bytes), 2 for tiny heads
    align: int | None  # the staged k and q arrays' alignment (None in the simulator, which has no vector loads)
    batch: int  # columns whose staging loads issue before their stores
    vcount: int  # a thread's share of a tile's v (the four threads of a state column split it)
    bounds: dict[str, Any]  # cuda.jit's launch bounds


def layout(dk: int, dv: int, cmax: int) -> Layout:
    tv, threads = block_shape(dk, dv)
    rows = dk // RS
    if dk % (2 * RS):
        raise ValueError(f"the recurrence kernel takes key heads of a multiple of {2 * RS} channels, got {dk}")
    vec = 4 if rows % 4 == 0 else 2
    # Staging loads a batch of columns into registers before it stores any: numba's loads are generic (LD.E), which
    # may alias shared memory, so ptxas issues no load ahead of an earlier shared store, and a loop of load-then-store
    # waits out one memory latency per column.
    # Four blocks an SM: within 128 registers, which ptxas meets without spilling; unasked it took 132-134 for
    # `columns` (CUDA 13.0's ptxas), which fit three. A state column over 8 threads, at 4 to 6 blocks an SM, was
    # level at a 1-lane verify and slower everywhere else (docs/adr/0004-gdn-kernel.md). The simulator takes no
    # launch bounds.
    return Layout(tv, threads, rows, vec, None if config.ENABLE_CUDASIM else 4 * vec, min(cmax, 8),
                  (cmax + RS - 1) // RS, {} if config.ENABLE_CUDASIM else {"launch_bounds": (threads, 4)})


def state_io(lay: Layout) -> tuple[Any, Any, Any]:
    """The device functions every recurrence kernel of this layout shares: (slot, load_state, store_state)."""
    rows, vec = lay.rows, lay.vec

    @cuda.jit(device=True, inline=True)
    def slot(base, i):  # numba device function: typed by numba, not annotated
        """Where a staged column of k or q keeps a thread's row i (i a constant once the loops unroll), base = s * vec
        its run's start (unsigned, as every index of the column loops: a signed index costs a wrap-around select that
        hides the runs from the vectoriser)."""
        return base + uint64((i // vec) * (RS * vec) + i % vec)

    @cuda.jit(device=True, inline=True)
    def load_state(st, state, lane, h, s, c, nv):  # numba device function: typed by numba, not annotated
        """This thread's rows s, s + RS, .. of state column c (zeros past the last column)."""
        for i in range(rows):
            st[i] = float32(0.0)
        if c < nv:
            for i in range(rows):
                st[i] = state[lane, h, uint64(i * RS + s), uint64(c)]

    @cuda.jit(device=True, inline=True)
    def store_state(st, state, lane, h, s, c, nv):  # numba device function: typed by numba, not annotated
        if c < nv:
            for i in range(rows):
                state[lane, h, uint64(i * RS + s), uint64(c)] = st[i]

    return slot, load_state, store_state


class Kernels(NamedTuple):
    columns: Any  # any column count: a decode, a verify, a prefill piece
    replay: Any  # a commit of every layer's kept columns


def make_kernels(dk: int, dv: int, cmax: int = 1) -> Kernels:
    """The recurrence's kernels for heads of dk x dv, staging `cmax` columns at a time (any column count runs)."""
    lay = layout(dk, dv, cmax)
    tv, threads, rows, vec, align, batch, vcount, bounds = lay
    slot, load_state, store_state = state_io(lay)

    @cuda.jit(device=True, inline=True)
    def decay_memory(st, kr, sk, j, base, decay):  # numba device function: typed by numba, not annotated
        """S <- decay S on this thread's rows, and S^T k of its state column (the RS partials summed), k being staged
        column j; keeps that k in kr for the update. Two running sums: half the dependent chain."""
        mem, mem2 = float32(0.0), float32(0.0)
        for i in range(0, rows, 2):
            kr[i] = sk[j, slot(base, i)]
            kr[i + 1] = sk[j, slot(base, i + 1)]
            st[i] *= decay
            st[i + 1] *= decay
            mem += kr[i] * st[i]
            mem2 += kr[i + 1] * st[i + 1]
        return quad_sum(mem + mem2)

    @cuda.jit(device=True, inline=True)
    def column_delta(st, kr, sk, sv, ds, bs, j, base, cl, c, nv):  # numba device function: typed by numba
        """Column j's delta for this thread's state column c: beta (v - (decayed S)^T k), after decaying the thread's
        rows of S in place (zero past the last column)."""
        mem = decay_memory(st, kr, sk, j, base, ds[j])
        if c >= nv:
            return float32(0.0)
        return bs[j] * (sv[j, cl] - mem)

    @cuda.jit(cache=True, **bounds)
    def columns(state, lanes, mixed, ba, dt_bias, rate, out, record, ratio, key_dim, write_state, do_record):
        # state [L, Hv, dk, dv] f32; lanes [B] i64; mixed [B, C, 2 key_dim + Hv dv] f32: q | k | v, q and k
        # l2-normalised (q scaled); ba [B, C, 2 Hv] f32: the raw beta and decay projections; dt_bias, rate [Hv] f32;
        # out [B, C, Hv, dv]; record [L, C, Hv, dk + dv + 2]; grid (dv / TV, Hv, B).
        # Everything a tile of columns reads (q, k, the decays and betas, the thread's v) is staged, and recorded,
        # before the loop over its columns, so that loop touches no global memory but the outputs, and the four
        # partial sums of a state column meet by warp shuffles: no block barrier inside it. Indices that are never
        # negative go in as uint64, which spares each access numba's wrap-around select.
        t = cuda.threadIdx.x
        cl, s = t // RS, t % RS
        c = cuda.blockIdx.x * tv + cl
        h, b = uint64(cuda.blockIdx.y), uint64(cuda.blockIdx.z)
        lane = uint64(lanes[b])
        hk = h // ratio
        nv = out.shape[3]
        hv = out.shape[2]
        ncols = mixed.shape[1]
        voff = 2 * key_dim + h * nv
        keeper = do_record and cuda.blockIdx.x == 0  # one block of a head records its k and gates
        sk = cuda.shared.array((cmax, dk), float32, alignment=align)  # k, rows in `slot` order
        sq = cuda.shared.array((cmax, dk), float32, alignment=align)  # q, the same
        ds = cuda.shared.array(cmax, float32)  # exp(g)
        bs = cuda.shared.array(cmax, float32)
        sv = cuda.shared.array((cmax, tv), float32)
        st = cuda.local.array(rows, float32)
        kr = cuda.local.array(rows, float32)  # column j's k at this thread's rows (registers: loops unroll)
        qb = cuda.local.array(batch, float32)
        kb = cuda.local.array(batch, float32)
        vb = cuda.local.array(vcount, float32)
        base = uint64(s * vec)
        load_state(st, state, lane, h, s, c, nv)
        j0 = 0
        while j0 < ncols:  # tiles of cmax columns: a prefill runs many more columns than shared memory holds
            nt = min(cmax, ncols - j0)
            cuda.syncthreads()  # every thread is done with the last tile
            e = t
            while e < dk:  # one pass when the block has dk threads (dk = 128)
                at = slot(uint64(e % RS * vec), e // RS)
                qi, ki = uint64(hk * dk + e), uint64(key_dim + hk * dk + e)
                for jb in range(0, nt, batch):
                    for n in range(batch):  # every load of the batch before its first store: see `batch`
                        if jb + n < nt:
                            qb[n] = mixed[b, uint64(j0 + jb + n), qi]
                            kb[n] = mixed[b, uint64(j0 + jb + n), ki]
                    for n in range(batch):
                        if jb + n < nt:
                            sq[uint64(jb + n), at] = qb[n]
                            sk[uint64(jb + n), at] = kb[n]
                            if keeper:
                                record[lane, uint64(j0 + jb + n), h, uint64(e)] = kb[n]
                e += threads
            for n in range(vcount):  # the four threads of a state column share its v
                j = s + n * RS
                if j < nt:
                    vb[n] = mixed[b, uint64(j0 + j), uint64(voff + c)] if c < nv else float32(0.0)
            j = t
            while j < nt:
                g, beta = gates(ba, b, j0 + j, h, hv, dt_bias, rate)
                ds[j] = math.exp(g)
                bs[j] = beta
                if keeper:
                    record[lane, j0 + j, h, dk + nv] = g
                    record[lane, j0 + j, h, dk + nv + 1] = beta
                j += threads
            for n in range(vcount):
                j = s + n * RS
                if j < nt:
                    sv[uint64(j), cl] = vb[n]
            cuda.syncthreads()
            for jj in range(nt):
                j = uint64(jj)
                delta = column_delta(st, kr, sk, sv, ds, bs, j, base, cl, c, nv)
                if do_record and s == 1 and c < nv:
                    record[lane, uint64(j0 + jj), h, uint64(dk + c)] = delta
                o, o2 = float32(0.0), float32(0.0)
                for i in range(0, rows, 2):
                    st[i] += kr[i] * delta
                    st[i + 1] += kr[i + 1] * delta
                    o += sq[j, slot(base, i)] * st[i]
                    o2 += sq[j, slot(base, i + 1)] * st[i + 1]
                o = quad_sum(o + o2)
                if s == 0 and c < nv:
                    out[b, uint64(j0 + jj), h, uint64(c)] = o
            j0 += cmax
        if write_state:
            store_state(st, state, lane, h, s, c, nv)

    @cuda.jit(cache=True, **bounds)
    def replay(states, lanes, records, last, nv):
        # states [G, L, Hv, dk, dv] f32 (G layers' states); lanes, last [B] i64; records [G, L, C, Hv, dk + dv + 2]
        # with C <= cmax; grid (dv / TV, Hv, G * B): one launch commits every layer. Each kept column j is
        # S <- exp(g_j) S + k_j delta_j^T with the delta its verify recorded: the thread's own rows only, no sums
        # across threads, so nothing in the loop waits on another thread.
        t = cuda.threadIdx.x
        cl, s = t // RS, t % RS
        c = cuda.blockIdx.x * tv + cl
        nb = uint64(lanes.shape[0])
        h, b, g = uint64(cuda.blockIdx.y), uint64(cuda.blockIdx.z) % nb, uint64(cuda.blockIdx.z) // nb
        state, record = states[g], records[g]
        lane = uint64(lanes[b])
        kept = last[b] + 1
        sk = cuda.shared.array((cmax, dk), float32, alignment=align)  # k, rows in `slot` order
        ds = cuda.shared.array(cmax, float32)
        sd = cuda.shared.array((cmax, tv), float32)  # each kept column's delta at the block's state columns
        st = cuda.local.array(rows, float32)
        kb = cuda.local.array(batch, float32)
        db = cuda.local.array(vcount, float32)
        base = uint64(s * vec)
        load_state(st, state, lane, h, s, c, nv)
        j0 = 0
        while j0 < kept:  # tiles of cmax columns, as in `columns`
            nt = min(cmax, kept - j0)
            cuda.syncthreads()
            e = t
            while e < dk:
                at = slot(uint64(e % RS * vec), e // RS)
                for jb in range(0, nt, batch):
                    for n in range(batch):  # loads before stores, as in `columns`
                        if jb + n < nt:
                            kb[n] = record[lane, uint64(j0 + jb + n), h, uint64(e)]
                    for n in range(batch):
                        if jb + n < nt:
                            sk[uint64(jb + n), at] = kb[n]
                e += threads
            for n in range(vcount):
                j = s + n * RS
                if j < nt:
                    db[n] = record[lane, uint64(j0 + j), h, uint64(dk + c)] if c < nv else float32(0.0)
            j = t
            while j < nt:
                ds[j] = math.exp(record[lane, j0 + j, h, dk + nv])
                j += threads
            for n in range(vcount):
                j = s + n * RS
                if j < nt:
                    sd[uint64(j), cl] = db[n]
            cuda.syncthreads()
            for jj in range(nt):
                j = uint64(jj)
                decay, delta = ds[j], sd[j, cl]
                for i in range(rows):
                    st[i] = st[i] * decay + sk[j, slot(base, i)] * delta
            j0 += cmax
        store_state(st, state, lane, h, s, c, nv)

    return Kernels(columns, replay)


WINDOW_THREADS = 128  # conv channels a block in `window`


def make_window_kernel() -> Any:
    @cuda.jit(cache=True)
    def window(convs, inputs_, lanes, last):
        # convs [G, L, Kc-1, D]: G layers' conv windows; inputs_ [G, L, C, D]: the verify's raw conv input per column
        # (same element type); lanes, last [B] i64; grid (ceil(D / WINDOW_THREADS), G * B). The window after a commit
        # ends at column last: slot i takes row last + 1 + i of [window | inputs] (always a row > i, so in place is
        # safe).
        ch = cuda.blockIdx.x * WINDOW_THREADS + cuda.threadIdx.x
        nb = lanes.shape[0]
        b, g = cuda.blockIdx.y % nb, cuda.blockIdx.y // nb
        conv, inputs = convs[g], inputs_[g]
        if ch >= conv.shape[2]:
            return
        lane = lanes[b]
        kc1 = conv.shape[1]
        for i in range(kc1):
            src = last[b] + 1 + i
            conv[lane, i, ch] = conv[lane, src, ch] if src < kc1 else inputs[lane, src - kc1, ch]

    return window
