"""The Gated DeltaNet recurrence of a verify's few columns in chunk form: `verify`, a numba-cuda kernel.

Owns: the kernel source and the table of column products it computes. Does not own: the layout, staging and state
access it shares with the column loop (ignis.kernels.gdn_kernel), the launch (ignis.kernels.gdn) or the reference
(ignis.kernels.gdn.columns_reference, which this kernel matches up to the order of fp32 sums).

Why: the column loop runs a column's S^T k (a sum across a state column's four threads), then its update, then the
next column's sum, so a verify of C columns is C dependent chains back to back. Here every sum over the state reads
the state as it arrived, and the columns' interactions come from C x C products of the staged k and q, so the sums of
all columns are independent and only a C-step substitution per state column is sequential.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import cuda, float32, uint64

from ignis.kernels.gdn_kernel import FULL, RS, Layout, gates, quad_sum

PAIR_LANES = 8  # lanes of a warp that share one product of two staged columns
VERIFY_COLUMNS = 8  # the most columns `verify` compiles for: its shared memory grows as cmax x (dk + 3 x threads)


def verify_pairs(cmax: int) -> np.ndarray:
    """The products of staged columns `verify` needs, each coded w * cmax^2 + j * cmax + i: k_i . q_j for i <= j
    (w = 1) and k_i . k_j for i < j (w = 0); cmax^2 of them."""
    codes = [cmax * cmax + j * cmax + i for j in range(cmax) for i in range(j + 1)]
    codes += [j * cmax + i for j in range(cmax) for i in range(j)]
    return np.array(codes, dtype=np.int64)


def make_verify(dk: int, cmax: int, lay: Layout, slot: Any, load_state: Any) -> Any:
    """`verify` for key heads of dk channels and at most cmax columns (None past VERIFY_COLUMNS), in the layout and
    with the state access (`slot`, `load_state`: ignis.kernels.gdn_kernel.state_io) of the kernels built beside it."""
    if cmax > VERIFY_COLUMNS:
        return None
    tv, threads, rows, vec, align, batch, vcount, bounds = lay
    group = min(4, cmax)  # columns whose sums over the state one pass takes (cmax is a power of two)
    pairs = verify_pairs(cmax)
    npairs = len(pairs)
    pair_rounds = -(-npairs // (threads // PAIR_LANES))
    pair_run = dk // PAIR_LANES  # channels a lane takes of one product
    pair_vec = 4 if pair_run % 4 == 0 else (2 if pair_run % 2 == 0 else 1)  # of them in one shared load

    @cuda.jit(cache=True, **bounds)
    def verify(state, lanes, mixed, ba, dt_bias, rate, out, record, ratio, key_dim):
        # `columns` for a verify of C <= cmax columns (the arguments less its two flags): outputs and record, the state
        # read once and left alone, in chunk form. With D_j = g_0 + .. + g_j, the state after column j is
        #     S_j = exp(D_j) S + sum_{i <= j} exp(D_j - D_i) k_i delta_i^T,   so with a_j = S^T k_j, b_j = S^T q_j:
        #     delta_j = beta_j (v_j - exp(D_j) a_j - sum_{i < j} exp(D_j - D_i) (k_i . k_j) delta_i)
        #     o_j = exp(D_j) b_j + sum_{i <= j} exp(D_j - D_i) (k_i . q_j) delta_i.
        # a_j and b_j are 2C sums over a thread's rows of the state as it arrived, none waiting on another (the
        # sequential form waits on each column's sum before its update); the products k_i . k_j and k_i . q_j are
        # the block's, once; then each state column runs C small steps of substitution.
        t = cuda.threadIdx.x
        cl, s = t // RS, t % RS
        c = cuda.blockIdx.x * tv + cl
        h, b = uint64(cuda.blockIdx.y), uint64(cuda.blockIdx.z)
        lane = uint64(lanes[b])
        hk = h // ratio
        nv = out.shape[3]
        hv = out.shape[2]
        nt = mixed.shape[1]
        voff = 2 * key_dim + h * nv
        keeper = cuda.blockIdx.x == 0  # one block of a head records its k and gates
        # [0]: k, [1]: q, rows in `slot` order, zeros past nt (one array, so a product can pick q or k by index)
        kq = cuda.shared.array((2, cmax, dk), float32, alignment=align)
        gs = cuda.shared.array(cmax, float32)  # g
        bs = cuda.shared.array(cmax, float32)  # beta
        sv = cuda.shared.array((cmax, tv), float32)  # v at the block's state columns
        dots = cuda.shared.array((2, cmax, cmax), float32)  # exp(D_j - D_i) times [0, j, i]: k_i . k_j; [1]: k_i . q_j
        st = cuda.local.array(rows, float32)
        qb = cuda.local.array(batch, float32)
        kb = cuda.local.array(batch, float32)
        vb = cuda.local.array(vcount, float32)
        ka = cuda.local.array(cmax, float32)  # a_j of this thread's state column, then its delta_j
        qa = cuda.local.array(cmax, float32)  # b_j
        pk = cuda.local.array(pair_run, float32)
        base = uint64(s * vec)
        load_state(st, state, lane, h, s, c, nv)
        e = t
        while e < dk:  # every staged column, zeros past nt: the sums and products below run whole groups
            at = slot(uint64(e % RS * vec), e // RS)
            qi, ki = uint64(hk * dk + e), uint64(key_dim + hk * dk + e)
            for jb in range(0, cmax, batch):
                for n in range(batch):  # every load of the batch before its first store: see `batch`
                    qb[n], kb[n] = float32(0.0), float32(0.0)
                    if jb + n < nt:
                        qb[n] = mixed[b, uint64(jb + n), qi]
                        kb[n] = mixed[b, uint64(jb + n), ki]
                for n in range(batch):
                    kq[0, uint64(jb + n), at] = kb[n]
                    kq[1, uint64(jb + n), at] = qb[n]
                    if keeper and jb + n < nt:
                        record[lane, uint64(jb + n), h, uint64(e)] = kb[n]
            e += threads
        for n in range(vcount):
            j = s + n * RS
            if j < nt:
                vb[n] = mixed[b, uint64(j), uint64(voff + c)] if c < nv else float32(0.0)
        j = t
        while j < nt:
            g, beta = gates(ba, b, j, h, hv, dt_bias, rate)
            gs[j] = g
            bs[j] = beta
            if keeper:
                record[lane, j, h, dk + nv] = g
                record[lane, j, h, dk + nv + 1] = beta
            j += threads
        for n in range(vcount):
            j = s + n * RS
            if j < nt:
                sv[uint64(j), cl] = vb[n]
        cuda.syncthreads()
        # The block's products of staged columns: runs of PAIR_LANES lanes take one pair each, a lane a strided share
        # of the dk channels (a run reads 128 contiguous bytes a load: no bank conflict), summed by shuffles.
        r, u = uint64(t // PAIR_LANES), uint64(t % PAIR_LANES)
        for n in range(pair_rounds):
            p = r + uint64(n * (threads // PAIR_LANES))
            code = pairs[p] if p < npairs else 0
            w, jt, ji = code // (cmax * cmax), code // cmax % cmax, code % cmax
            part = float32(0.0)
            for m in range(pair_run):
                at = uint64(m // pair_vec * (PAIR_LANES * pair_vec) + u * pair_vec + m % pair_vec)
                pk[m] = kq[0, ji, at]
            for m in range(pair_run):
                at = uint64(m // pair_vec * (PAIR_LANES * pair_vec) + u * pair_vec + m % pair_vec)
                part += pk[m] * kq[w, jt, at]  # w = 1: q_jt, 0: k_jt
            part += cuda.shfl_xor_sync(FULL, part, 1)
            part += cuda.shfl_xor_sync(FULL, part, 2)
            part += cuda.shfl_xor_sync(FULL, part, 4)
            if u == 0 and p < npairs:
                span = float32(0.0)  # D_jt - D_ji (gs holds nothing past nt: nor is a pair past it read)
                for m in range(1, cmax):  # constant bounds: unrolled, no loop on the pair's own indices
                    if ji < m <= jt < nt:
                        span += gs[m]
                dots[w, jt, ji] = math.exp(span) * part
        # a_j and b_j: `group` columns a pass, 2 * group independent running sums, kept in registers (every loop
        # below has constant bounds, so each index is a constant once the loops unroll)
        for j0 in range(0, cmax, group):
            if j0 < nt:
                for n in range(group):
                    ka[j0 + n], qa[j0 + n] = float32(0.0), float32(0.0)
                for i in range(rows):
                    for n in range(group):
                        ka[j0 + n] += kq[0, j0 + n, slot(base, i)] * st[i]
                        qa[j0 + n] += kq[1, j0 + n, slot(base, i)] * st[i]
                for n in range(group):
                    ka[j0 + n] = quad_sum(ka[j0 + n])
                    qa[j0 + n] = quad_sum(qa[j0 + n])
        cuda.syncthreads()  # the products in `dots`
        dsum = float32(0.0)  # D_j
        for j in range(cmax):
            if j < nt:
                dsum += gs[j]
                decay = math.exp(dsum)
                x = sv[j, cl] - decay * ka[j]
                for i in range(j):
                    x -= dots[0, j, i] * ka[i]  # ka[i] holds delta_i by now
                delta = bs[j] * x
                o = decay * qa[j]
                for i in range(j):
                    o += dots[1, j, i] * ka[i]
                o += dots[1, j, j] * delta
                ka[j] = delta
                if c < nv:
                    if s == 0:
                        out[b, uint64(j), h, uint64(c)] = o
                    elif s == 1:
                        record[lane, uint64(j), h, uint64(dk + c)] = delta

    return verify
