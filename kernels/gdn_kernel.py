"""The numba-cuda kernels of the Gated DeltaNet recurrence over C columns of B lanes: `columns` and `replay`.

Owns: the kernel sources and their block shape. Does not own: argument checks, the torch reference or the launch
on torch's stream (ignis.kernels.gdn). Importing this module imports numba.cuda (or, with NUMBA_ENABLE_CUDASIM=1,
the simulator); nothing here touches the driver.

Block (TV * RS threads) = one value head of one lane, TV columns of its [dk, dv] state; thread (c, s) keeps rows
s, s + RS, s + 2 RS, .. of column c in registers, so the state is read once and every column's update and output are
sums over a thread's own rows plus RS partials combined by warp shuffles (the simulator runs them through the test
suite's warp shim). Interleaved rows put the four threads of a state column on four shared-memory banks when they
read k and q (rows in blocks of dk/RS put all four on one bank: a four-way conflict on every read, which bounded the
verify's and a prefill's column loop on the H200), and each thread reads a column's k once. Per column j, with k and q l2-normalised (q also scaled) by the conv that
produced them, beta = sigmoid(b) and g = rate * softplus(a + dt_bias) from the raw projections:
    S <- exp(g) S;  delta = beta (v - S^T k);  S <- S + k delta^T;  o = S^T q
`columns` writes o for every column and either the final state (decode, one column) or, for a verify, each column's
normalised k, v, g and beta into a record, from which `replay` later applies columns 0..last to the lane's state:
the state is read by the verify and read and written by the commit, never stored per column.
"""

from __future__ import annotations

import math
from typing import Any

from numba import cuda, float32

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


def make_kernels(dk: int, dv: int, cmax: int = 1) -> tuple[Any, Any]:
    """`columns` and `replay` for heads of dk x dv, staging `cmax` columns at a time (any column count runs)."""
    tv, threads = block_shape(dk, dv)
    rows = dk // RS
    if dk % (2 * RS):
        raise ValueError(f"the recurrence kernel takes key heads of a multiple of {2 * RS} channels, got {dk}")

    @cuda.jit(device=True, inline=True)
    def decay_memory(st, kr, sk, j, s, decay):  # numba device function: typed by numba, not annotated
        """S <- decay S on this thread's rows, and S^T k of its state column (the RS partials summed), k being staged
        column j; keeps that k in kr for the update. Two running sums: half the dependent chain."""
        mem, mem2 = float32(0.0), float32(0.0)
        for i in range(0, rows, 2):
            kr[i] = sk[j, i * RS + s]
            kr[i + 1] = sk[j, (i + 1) * RS + s]
            st[i] *= decay
            st[i + 1] *= decay
            mem += kr[i] * st[i]
            mem2 += kr[i + 1] * st[i + 1]
        return quad_sum(mem + mem2)

    @cuda.jit(cache=True)
    def columns(state, lanes, mixed, ba, dt_bias, rate, out, record, ratio, key_dim, write_state, do_record):
        # state [L, Hv, dk, dv] f32; lanes [B] i64; mixed [B, C, 2 key_dim + Hv dv] f32: q | k | v, q and k
        # l2-normalised (q scaled); ba [B, C, 2 Hv] f32: the raw beta and decay projections; dt_bias, rate [Hv] f32;
        # out [B, C, Hv, dv]; record [L, C, Hv, dk + dv + 2]; grid (dv / TV, Hv, B).
        # Everything a tile of columns reads (q, k, the gates, the thread's v) is staged before the loop over its
        # columns, so that loop touches no global memory but its writes, and the four partial sums of a state column
        # meet by warp shuffles: no block barrier inside it.
        t = cuda.threadIdx.x
        cl, s = t // RS, t % RS
        c = cuda.blockIdx.x * tv + cl
        h, b = cuda.blockIdx.y, cuda.blockIdx.z
        lane = lanes[b]
        hk = h // ratio
        nv = out.shape[3]
        hv = out.shape[2]
        ncols = mixed.shape[1]
        voff = 2 * key_dim + h * nv
        sk = cuda.shared.array((cmax, dk), float32)
        sq = cuda.shared.array((cmax, dk), float32)
        gs = cuda.shared.array(cmax, float32)
        bs = cuda.shared.array(cmax, float32)
        sv = cuda.shared.array((cmax, tv), float32)
        st = cuda.local.array(rows, float32)
        kr = cuda.local.array(rows, float32)  # column j's k at this thread's rows (registers: loops unroll)
        for i in range(rows):
            st[i] = state[lane, h, i * RS + s, c] if c < nv else float32(0.0)
        j0 = 0
        while j0 < ncols:  # tiles of cmax columns: a prefill runs many more columns than shared memory holds
            nt = min(cmax, ncols - j0)
            cuda.syncthreads()  # every thread is done with the last tile
            i = t
            while i < nt * dk:
                j, e = i // dk, i % dk
                sq[j, e] = mixed[b, j0 + j, hk * dk + e]
                sk[j, e] = mixed[b, j0 + j, key_dim + hk * dk + e]
                i += threads
            if t < nt:
                bs[t] = float32(1.0) / (float32(1.0) + math.exp(-ba[b, j0 + t, h]))
                a = ba[b, j0 + t, hv + h] + dt_bias[h]
                gs[t] = rate[h] * (a if a > float32(20.0) else math.log1p(math.exp(a)))  # rate * softplus
            if s == 0:
                for j in range(nt):
                    sv[j, cl] = mixed[b, j0 + j, voff + c] if c < nv else float32(0.0)
            cuda.syncthreads()
            for j in range(nt):
                mem = decay_memory(st, kr, sk, j, s, math.exp(gs[j]))
                delta = bs[j] * (sv[j, cl] - mem)
                if c >= nv:
                    delta = float32(0.0)
                o, o2 = float32(0.0), float32(0.0)
                for i in range(0, rows, 2):
                    st[i] += kr[i] * delta
                    st[i + 1] += kr[i + 1] * delta
                    o += sq[j, i * RS + s] * st[i]
                    o2 += sq[j, (i + 1) * RS + s] * st[i + 1]
                o = quad_sum(o + o2)
                if s == 0 and c < nv:
                    out[b, j0 + j, h, c] = o
                if do_record:
                    if cuda.blockIdx.x == 0:
                        i = t
                        while i < dk:
                            record[lane, j0 + j, h, i] = sk[j, i]
                            i += threads
                        if t == 0:
                            record[lane, j0 + j, h, dk + nv] = gs[j]
                            record[lane, j0 + j, h, dk + nv + 1] = bs[j]
                    if s == 0 and c < nv:
                        record[lane, j0 + j, h, dk + c] = sv[j, cl]
            j0 += cmax
        if write_state and c < nv:
            for i in range(rows):
                state[lane, h, i * RS + s, c] = st[i]

    @cuda.jit(cache=True)
    def replay(state, lanes, record, last, nv):
        # state [L, Hv, dk, dv] f32; lanes, last [B] i64; record [L, C, Hv, dk + dv + 2] with C <= cmax;
        # grid (dv / TV, Hv, B). The kept columns' k are staged once; no block barrier inside the loop.
        t = cuda.threadIdx.x
        cl, s = t // RS, t % RS
        c = cuda.blockIdx.x * tv + cl
        h, b = cuda.blockIdx.y, cuda.blockIdx.z
        lane = lanes[b]
        kept = last[b] + 1
        sk = cuda.shared.array((cmax, dk), float32)
        st = cuda.local.array(rows, float32)
        kr = cuda.local.array(rows, float32)  # column j's k at this thread's rows (registers: loops unroll)
        for i in range(rows):
            st[i] = state[lane, h, i * RS + s, c] if c < nv else float32(0.0)
        j0 = 0
        while j0 < kept:  # tiles of cmax columns, as in `columns`
            nt = min(cmax, kept - j0)
            cuda.syncthreads()
            i = t
            while i < nt * dk:
                sk[i // dk, i % dk] = record[lane, j0 + i // dk, h, i % dk]
                i += threads
            cuda.syncthreads()
            for j in range(nt):
                bt = record[lane, j0 + j, h, dk + nv + 1]
                mem = decay_memory(st, kr, sk, j, s, math.exp(record[lane, j0 + j, h, dk + nv]))
                delta = float32(0.0)
                if c < nv:
                    delta = bt * (record[lane, j0 + j, h, dk + c] - mem)
                for i in range(rows):
                    st[i] += kr[i] * delta
            j0 += cmax
        if c < nv:
            for i in range(rows):
                state[lane, h, i * RS + s, c] = st[i]

    return columns, replay


WINDOW_THREADS = 128  # conv channels a block in `window`


def make_window_kernel() -> Any:
    @cuda.jit(cache=True)
    def window(conv, inputs, lanes, last):
        # conv [L, Kc-1, D]: each lane's conv window; inputs [L, C, D]: the verify's raw conv input per column (same
        # element type); lanes, last [B] i64; grid (ceil(D / WINDOW_THREADS), B). The window after a commit ends at
        # column last: slot i takes row last + 1 + i of [window | inputs] (always a row > i, so in place is safe).
        ch = cuda.blockIdx.x * WINDOW_THREADS + cuda.threadIdx.x
        b = cuda.blockIdx.y
        if ch >= conv.shape[2]:
            return
        lane = lanes[b]
        kc1 = conv.shape[1]
        for i in range(kc1):
            src = last[b] + 1 + i
            conv[lane, i, ch] = conv[lane, src, ch] if src < kc1 else inputs[lane, src - kc1, ch]

    return window
