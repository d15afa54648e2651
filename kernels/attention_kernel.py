"""The numba-cuda sources of split-context decode attention: `partial` and `combine` (launched from
ignis.kernels.attention).

Owns: the kernel bodies and their block shape. Does not own: argument checks, launches, the split plan or the torch
reference (ignis.kernels.attention). Importing this module imports numba.cuda (or the simulator); nothing here
touches the driver.

`partial`: one block per (context split, KV head, lane). The block's R query rows (the query heads of its KV head x
the round's columns) attend to the split's key slots, 32 at a time: the 32 keys (and later values) are staged in
shared memory, each read from its page (slot s of the lane: page table[lane, s // page], row s % page), every
(row, key) score is one thread's dot product, then an online softmax keeps per row the running max m, sum l and, per
thread, one output dimension o of every row. Rows see slot s iff s <= their column's position.
`combine`: one block per (query head, row of the round): merges the splits' (m, l, o) and applies the output gate,
rounding where the torch path (attention output in the model dtype, then o * sigmoid(gate)) rounds.
Element type as in ignis.kernels.fused_kernel: bf16 as int16 bits, widened by their bits; no warp intrinsics.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import cuda

from ignis.kernels.fused_kernel import _converters

KEYS = 32  # key slots staged in shared memory at a time
THREADS = 256  # threads a block: at least the head width
NEG = np.float32(-1e30)  # the running max before any visible key (finite, so exp(NEG - m) is 0, not NaN)


def make_kernels(half: bool, rows: int, hd: int, threads: int = THREADS) -> dict[str, Any]:
    """Kernels for bf16 (`half`) or fp32 elements, R = `rows` query rows a block, head width hd, and blocks of
    `threads` >= max(hd, R) threads."""
    load, store = _converters(half)
    elt = np.int16 if half else np.float32
    width = hd + 2  # padded row of the staged tile: consecutive keys fall in different shared-memory banks

    @cuda.jit(cache=True)
    def partial(q, kc, vc, table, lanes, positions, opart, mpart, lpart, scale, per_split):
        # q [B, nkv, R, hd] element: row r is column r % C of query head group r // C; kc, vc [pages, page, nkv, hd];
        # table [L, width]: the page of each lane's slots; lanes [B]; positions [B, C];
        # opart [B, nkv, NS, R, hd] f32 (unnormalised); mpart, lpart [B, nkv, NS, R];
        # grid (NS, nkv, B), `threads` threads; split s covers slots s * per_split .. (s + 1) * per_split - 1
        t = cuda.threadIdx.x
        sp, kv, b = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        lane = lanes[b]
        page = kc.shape[1]
        cols = positions.shape[1]
        tile = cuda.shared.array((KEYS, width), elt)
        sc = cuda.shared.array((rows, KEYS), np.float32)
        m_s = cuda.shared.array(rows, np.float32)
        l_s = cuda.shared.array(rows, np.float32)
        corr = cuda.shared.array(rows, np.float32)
        o = cuda.local.array(rows, np.float32)
        for r in range(rows):
            o[r] = np.float32(0.0)
        if t < rows:
            m_s[t] = NEG
            l_s[t] = np.float32(0.0)
        start = sp * per_split
        end = min(start + per_split, positions[b, cols - 1] + 1)  # no row sees past the last column's position
        k0 = start
        while k0 < end:
            n = min(KEYS, end - k0)
            cuda.syncthreads()  # the last tile's values are read
            i = t
            while i < n * hd:
                slot = k0 + i // hd
                tile[i // hd, i % hd] = kc[table[lane, slot // page], slot % page, kv, i % hd]
                i += threads
            cuda.syncthreads()
            p = t
            while p < rows * KEYS:
                r, key = p // KEYS, p % KEYS
                s = NEG
                if key < n and k0 + key <= positions[b, r % cols]:
                    acc = np.float32(0.0)
                    for d in range(hd):
                        acc += load(q[b, kv, r, d]) * load(tile[key, d])
                    s = acc * np.float32(scale)
                sc[r, key] = s
                p += threads
            cuda.syncthreads()
            if t < rows:
                m_old = m_s[t]
                m_new = m_old
                for key in range(KEYS):
                    m_new = max(m_new, sc[t, key])
                c = math.exp(m_old - m_new)
                total = np.float32(0.0)
                for key in range(KEYS):
                    e = sc[t, key]
                    w = math.exp(e - m_new) if e > NEG else np.float32(0.0)
                    sc[t, key] = w
                    total += w
                l_s[t] = l_s[t] * c + total
                m_s[t] = m_new
                corr[t] = c
            i = t
            while i < n * hd:  # the scores are read from sc now: the tile can take the values
                slot = k0 + i // hd
                tile[i // hd, i % hd] = vc[table[lane, slot // page], slot % page, kv, i % hd]
                i += threads
            cuda.syncthreads()
            if t < hd:
                for r in range(rows):
                    acc = o[r] * corr[r]
                    for key in range(n):
                        acc += sc[r, key] * load(tile[key, t])
                    o[r] = acc
            k0 += KEYS
        cuda.syncthreads()
        if t < hd:
            for r in range(rows):
                opart[b, kv, sp, r, t] = o[r]
        if t < rows:
            mpart[b, kv, sp, t] = m_s[t]
            lpart[b, kv, sp, t] = l_s[t]

    @cuda.jit(cache=True)
    def combine(opart, mpart, lpart, qkv, y, nh):
        # opart [B, nkv, NS, R, hd], mpart, lpart [B, nkv, NS, R] f32; qkv [T, ...]: query head h's gate is
        # qkv[row, h * 2 hd + hd :][:hd]; y [T, nh * hd] = attention * sigmoid(gate); grid (nh, T), block >= hd
        t = cuda.threadIdx.x
        h, row = cuda.blockIdx.x, cuda.blockIdx.y
        nkv = opart.shape[1]
        group = nh // nkv
        cols = opart.shape[3] // group
        b = row // cols
        kv, r = h // group, (h % group) * cols + row % cols
        if t >= hd:
            return
        big = NEG
        for s in range(opart.shape[2]):
            big = max(big, mpart[b, kv, s, r])
        num = np.float32(0.0)
        den = np.float32(0.0)
        for s in range(opart.shape[2]):
            w = math.exp(mpart[b, kv, s, r] - big)
            num += w * opart[b, kv, s, r, t]
            den += w * lpart[b, kv, s, r]
        att = load(store(num / den))
        g = load(qkv[row, h * 2 * hd + hd + t])
        gate = load(store(np.float32(1.0) / (np.float32(1.0) + math.exp(-g))))
        y[row, h * hd + t] = store(att * gate)

    return {"partial": partial, "combine": combine}
