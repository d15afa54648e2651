"""The numba-cuda sources of the decode round's fused layer kernels (launched from ignis.kernels.fused).

Owns: the kernel bodies and their block sizes. Does not own: argument checks, launches or the torch references
(ignis.kernels.fused). Importing this module imports numba.cuda (or, with NUMBA_ENABLE_CUDASIM=1, the simulator);
nothing here touches the driver.

Element type: the model's bf16 tensors arrive as int16 views (torch exports no bf16 to numba) and are widened to fp32
by their bits; results are rounded back to bf16 to nearest even, as torch rounds. So each kernel does what the torch
ops it replaces do, op for op: every op that torch runs in bf16 (compute in fp32, round) is rounded here at the same
point. A float32 model passes float32 arrays and nothing is rounded. Block reductions are warp shuffles, then one
barrier (the simulator runs the shuffles through the test suite's warp shim).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import cuda
from numba.cuda import libdevice

NORM_THREADS = 1024  # add_rms_norm: threads a row
FULL = 0xFFFFFFFF  # the full-warp mask: every block here is whole warps
EPS = 1e-6  # l2norm's epsilon (ignis.model.ops.l2norm)
EW_THREADS = 256  # swiglu: elements a block


def _converters(half: bool) -> tuple[Any, Any]:
    """(load, store): element -> fp32, fp32 -> element (bf16 bits in int16, or fp32 as it is)."""
    if half:

        @cuda.jit(device=True, inline=True)
        def load(h: Any) -> Any:
            return libdevice.int_as_float(np.int32(np.int64(h) << 16))

        @cuda.jit(device=True, inline=True)
        def store(f: Any) -> Any:
            u = np.int64(libdevice.float_as_int(np.float32(f)))
            return np.int16((u + 0x7FFF + ((u >> 16) & 1)) >> 16)

    else:

        @cuda.jit(device=True, inline=True)
        def load(h: Any) -> Any:
            return np.float32(h)

        @cuda.jit(device=True, inline=True)
        def store(f: Any) -> Any:
            return np.float32(f)

    return load, store


@cuda.jit(device=True, inline=True)
def block_sum(part, t, value, n):  # numba device function: typed by numba, not annotated
    """The sum of every thread's `value` over a block of n threads (a multiple of 32): each warp sums by shuffles,
    then every thread adds the warps' sums from the shared array `part` (one barrier). The caller syncs before it
    writes `part` again."""
    v = value
    off = 16
    while off > 0:
        v += cuda.shfl_xor_sync(FULL, v, off)
        off //= 2
    if t % 32 == 0:
        part[t // 32] = v
    cuda.syncthreads()
    total = np.float32(0.0)
    for w in range(n // 32):
        total += part[w]
    return total


def make_kernels(half: bool, head_threads: int, per: int = 1, norm_threads: int = NORM_THREADS,
                 taps: int = 4) -> dict[str, Any]:
    """The kernels for bf16 (`half`) or fp32 elements; `head_threads` (a power of two) is the block of the per-head
    kernels, at least the head width it serves; `norm_threads` (a power of two) the block of add_rms_norm, whose rows
    are at most per * norm_threads wide; `taps` the GDN conv's width, fixed so that its loop over them unrolls and a
    column's loads issue together."""
    load, store = _converters(half)
    nt = norm_threads
    kc1 = taps - 1  # the conv inputs a lane's window keeps

    @cuda.jit(cache=True)
    def add_rms_norm(x, d, scale, resid, normed, eps, add):
        # x, d [T, H]: the residual and what the last block added to it; scale [H] f32 (1 + w); grid (T,)
        # resid = x + d (rounded), normed = rms_norm(resid) * scale (rounded); add=False: resid is x.
        # Each thread holds its `per` elements in registers: every load is issued before any store, so one row
        # costs about one memory latency, not one per element.
        t = cuda.threadIdx.x
        row = cuda.blockIdx.x
        n = x.shape[1]
        part = cuda.shared.array(nt, np.float32)
        vals = cuda.local.array(per, np.float32)
        acc = np.float32(0.0)
        for k in range(per):
            i = t + k * nt
            v = np.float32(0.0)
            if i < n:
                v = load(x[row, i])
                if add:
                    v = load(store(v + load(d[row, i])))
            vals[k] = v
            acc += v * v
        r = np.float32(1.0) / math.sqrt(block_sum(part, t, acc, nt) / np.float32(n) + np.float32(eps))
        for k in range(per):
            i = t + k * nt
            if i < n:
                if add:
                    resid[row, i] = store(vals[k])
                normed[row, i] = store(vals[k] * r * scale[i])

    ht = head_threads

    @cuda.jit(cache=True)
    def conv(window, lanes, raw, weight, mixed, record, ba, ba_out, do_record, dk, qk_heads, qscale, tile):
        # window [L, Kc-1, D] (element); lanes [B] i64; raw [B, C, D] element: this round's conv inputs;
        # weight [D, Kc] f32; mixed [B, C, D] f32 out: silu(conv), the first qk_heads heads of dk channels (q then k)
        # l2-normalised and q scaled by qscale; record [L, C', D] element; ba [B, C, 2 Hv] element -> ba_out f32;
        # grid (ceil(D / dk), B, ceil(C / tile)), block >= dk: one head of channels and `tile` columns a block.
        # Where the window moves (do_record false), only blocks z = 0 read it (tile >= Kc - 1: later columns' taps
        # are all in raw), and they alone write it, after their reads: no block reads a window slot another block
        # writes. A verify (do_record) leaves it alone, so its blocks may take any tile.
        t = cuda.threadIdx.x
        head = cuda.blockIdx.x
        ch = head * dk + t
        b = cuda.blockIdx.y
        z = cuda.blockIdx.z
        lane = lanes[b]
        cols = raw.shape[1]
        active = t < dk and ch < raw.shape[2]
        part = cuda.shared.array(ht, np.float32)
        if head == 0 and z == 0:
            i = t
            nba = ba.shape[2]
            while i < cols * nba:
                ba_out[b, i // nba, i % nba] = load(ba[b, i // nba, i % nba])
                i += ht
        for j in range(z * tile, min(cols, (z + 1) * tile)):
            acc = np.float32(0.0)
            if active:
                for tap in range(taps):
                    src = j + tap
                    v = load(window[lane, src, ch]) if src < kc1 else load(raw[b, src - kc1, ch])
                    acc += v * weight[ch, tap]
                acc = acc / (np.float32(1.0) + math.exp(-acc))
            if head < qk_heads:  # the same for the whole block
                acc = acc * (np.float32(1.0) / math.sqrt(block_sum(part, t, acc * acc, ht) + np.float32(EPS)))
                if head < qk_heads // 2:
                    acc = acc * np.float32(qscale)
                cuda.syncthreads()
            if active:
                mixed[b, j, ch] = acc
                if do_record:
                    record[lane, j, ch] = raw[b, j, ch]
        if active and not do_record and z == 0:
            for i in range(kc1):  # the window after the round: slot i takes input cols + i (never a slot < i + 1)
                src = cols + i
                window[lane, i, ch] = window[lane, src, ch] if src < kc1 else raw[b, src - kc1, ch]

    @cuda.jit(cache=True)
    def gated_norm(out, z, weight, y, eps):
        # out [T, Hv, dv] f32 (the recurrence); z [T, Hv * dv] element (the gate); weight [dv] element;
        # y [T, Hv * dv] element = w * rms_norm(out) * silu(z); grid (Hv, T), block >= dv
        t = cuda.threadIdx.x
        h, row = cuda.blockIdx.x, cuda.blockIdx.y
        dv = out.shape[2]
        part = cuda.shared.array(ht, np.float32)
        o, w, g = np.float32(0.0), np.float32(0.0), np.float32(0.0)
        if t < dv:  # every load before the barrier: one memory latency a block
            o = load(store(out[row, h, t]))
            w = load(weight[t])
            g = load(z[row, h * dv + t])
        total = block_sum(part, t, o * o, ht)
        if t < dv:
            r = np.float32(1.0) / math.sqrt(total / np.float32(dv) + np.float32(eps))
            wh = load(store(w * load(store(o * r))))
            y[row, h * dv + t] = store(wh * (g / (np.float32(1.0) + math.exp(-g))))

    @cuda.jit(cache=True)
    def swiglu(gu, y):
        # gu [T, 2 I] element: gate | up; y [T, I] = silu(gate) * up, each rounded; grid (ceil(I / EW_THREADS), T)
        i = cuda.blockIdx.x * EW_THREADS + cuda.threadIdx.x
        row = cuda.blockIdx.y
        inner = y.shape[1]
        if i < inner:
            g = load(gu[row, i])
            s = load(store(g / (np.float32(1.0) + math.exp(-g))))
            y[row, i] = store(s * load(gu[row, inner + i]))

    @cuda.jit(cache=True)
    def qk_rope_write(qkv, qscale, kscale, cos, sin, kc, vc, table, lanes, positions, qh, eps, nh, nkv):
        # qkv [T, (2 nh + 2 nkv) hd] element: per query head [q | gate], then k, then v; qscale, kscale [hd] f32;
        # cos, sin [T, rd] element; kc, vc [pages, page, nkv, hd]; table [L, width]: the page of each lane's
        # positions; lanes [B]; positions [B, C];
        # qh [B, nkv, group * C, hd] out: normed, rotated queries, the heads of a KV head together; grid (nh + 2 nkv, T)
        t = cuda.threadIdx.x
        hh, row = cuda.blockIdx.x, cuda.blockIdx.y
        hd = qh.shape[3]
        cols = positions.shape[1]
        b, c = row // cols, row % cols
        pos = positions[b, c]
        pg, slot = table[lanes[b], pos // kc.shape[1]], pos % kc.shape[1]  # the column's page and row in it
        rd = cos.shape[1]
        half_rd = rd // 2
        part = cuda.shared.array(ht, np.float32)
        nrm = cuda.shared.array(ht, np.float32)
        if hh < nh:
            src = hh * 2 * hd
        else:
            src = 2 * nh * hd + (hh - nh) * hd
        v = np.float32(0.0)
        if t < hd:
            v = load(qkv[row, src + t])
        if hh >= nh + nkv:  # a value head: stored as it is
            if t < hd:
                vc[pg, slot, hh - nh - nkv, t] = qkv[row, src + t]
            return
        sc, cs, sn = np.float32(0.0), np.float32(0.0), np.float32(0.0)
        if t < hd:  # every load before the first barrier: one memory latency a block
            sc = qscale[t] if hh < nh else kscale[t]
            if t < rd:
                cs, sn = load(cos[row, t]), load(sin[row, t])
        r = np.float32(1.0) / math.sqrt(block_sum(part, t, v * v, ht) / np.float32(hd) + np.float32(eps))
        if t < hd:
            nrm[t] = load(store(v * r * sc))
        cuda.syncthreads()
        if t < hd:
            e = nrm[t]
            if t < rd:
                turned = -nrm[t + half_rd] if t < half_rd else nrm[t - half_rd]
                e = load(store(load(store(e * cs)) + load(store(turned * sn))))
            if hh < nh:
                group = nh // nkv
                qh[b, hh // group, (hh % group) * cols + c, t] = store(e)
            else:
                kc[pg, slot, hh - nh, t] = store(e)

    @cuda.jit(cache=True)
    def grouped_conv(x, base, dyn, y, group):
        # x [n, R, H] element; base [Kt, H] element; dyn [n, R, Kt, H / group] element; grid (ceil(H / EW), n * R)
        # y[i, t, c] = sum over taps j <= t of (base[j, c] + dyn[i, t, j, c // group]) * x[i, t - j, c], every
        # product and partial sum rounded (DFlash2's grouped dynamic conv, taps added in order)
        c = cuda.blockIdx.x * EW_THREADS + cuda.threadIdx.x
        rows = x.shape[1]
        i, t = cuda.blockIdx.y // rows, cuda.blockIdx.y % rows
        if c >= x.shape[2]:
            return
        acc = np.float32(0.0)
        for tap in range(min(base.shape[0], rows)):
            coef = load(store(load(base[tap, c]) + load(dyn[i, t, tap, c // group])))
            xv = load(x[i, t - tap, c]) if t >= tap else np.float32(0.0)
            term = load(store(coef * xv))
            acc = term if tap == 0 else load(store(acc + term))
        y[i, t, c] = store(acc)

    return {"add_rms_norm": add_rms_norm, "grouped_conv": grouped_conv, "conv": conv, "gated_norm": gated_norm,
            "swiglu": swiglu,
            "qk_rope_write": qk_rope_write}
