"""The numba-cuda body of the 4-bit GEMV/GEMM: y[r, o] = sum_c x[r, c] * (q[o, c] - z[o, g]) * s[o, g], g = c // group.

Owns: the kernel source for each (activation dtype, scale dtype, row tile, output rows a warp, warps a block) and
its numba signature. Does not own: the grid plan, the workspace, the stream or argument checks
(ignis.kernels.int4_gemv). Importing this module imports numba.cuda (or, with NUMBA_ENABLE_CUDASIM=1, the
simulator); nothing here touches the driver.
docs/adr/0005-int4-gemv.md has the why.

Grid (row tiles, output tiles, K splits), 32 * warps threads. Warp w of output tile t owns output rows
t * bo + w * ot .. + ot - 1 (bo = warps * ot) and the rt activation rows of its row tile; lane l reads 64-bit words
l, l + 32, ... of its K split of each of those weight rows, so a warp's loads are 256 contiguous bytes of one row
(coalesced), and each weight word is read by one lane of one warp for all the rows of the tile (more rows are other
blocks of the same output tile, adjacent in launch order, so their reads of the weight meet in L2). A word is 16
codes of one group; each code becomes a float with the exponent trick (bits 0x4B000000 | q are the float 2^23 + q,
exact, with the nibble masked where it lies: see quad_step) and (q - z) is one subtraction; the products with the
rt activation rows are summed in fp32 per word and scaled by the group's scale once a word. Lanes' sums are added in
shared memory in a fixed order. With one split the warp writes the outputs; otherwise each block stores its partial
sums in the workspace, and the last block of a (row tile, output tile) to finish (threadfence + atomic counter) adds
the splits in order, writes the outputs and zeroes its counter, so the next launch or CUDA-graph replay starts
clean. Rows and outputs past the end are masked, so any row count and any output count run.

Dtypes: activations and outputs in bf16 (read as 64-bit words of four, converted by shifts), fp16 or fp32; scales in
bf16, fp16 or fp32. No warp intrinsics, so the same source runs in numba's simulator (flat numpy arrays in place
of the pointers).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import config, cuda
from numba import float32, int64  # noqa: F401 - used inside kernels

MAGIC = 0x4B000000  # float bits of 2^23: OR-ing a code 0..15 into the mantissa gives 2^23 + q exactly
TWO23 = np.float32(2.0**23)
# 16^-i and 16^i as fp32 constants (globals are frozen into the kernel; no pow at run time)
S1, S2, S3, S4 = np.float32(2.0**-4), np.float32(2.0**-8), np.float32(2.0**-12), np.float32(2.0**-16)
P1, P2, P3, P4 = np.float32(16.0), np.float32(256.0), np.float32(4096.0), np.float32(65536.0)
KINDS = ("f32", "f16", "bf16")

if getattr(config, "ENABLE_CUDASIM", 0):  # the simulator runs kernels as Python: bit casts through numpy

    def _as_float(bits):  # type: ignore[no-untyped-def]
        return np.array(int(bits) & 0xFFFFFFFF, dtype=np.uint32).view(np.float32)[()]

    def _as_int(v):  # type: ignore[no-untyped-def]
        return int(np.array(v, dtype=np.float32).view(np.int32)[()])

    as_float = cuda.jit(device=True)(_as_float)
    as_int = cuda.jit(device=True)(_as_int)
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline="always")
    def as_float(bits):  # type: ignore[no-untyped-def]
        return libdevice.int_as_float(np.int32(bits))

    @cuda.jit(device=True, inline="always")
    def as_int(v):  # type: ignore[no-untyped-def]
        return np.int64(libdevice.float_as_int(v))


@cuda.jit(device=True, inline="always")
def _quad_bf16(x, base):
    # Elements base .. base + 3 (base a multiple of 4) of a bf16 tensor read as int64 words: one load, four shifts.
    v = x[base >> 2]
    lo = v & 0xFFFFFFFF
    hi = (v >> 32) & 0xFFFFFFFF
    return as_float(lo << 16), as_float(lo & 0xFFFF0000), as_float(hi << 16), as_float(hi & 0xFFFF0000)


@cuda.jit(device=True, inline="always")
def _quad_float(x, base):
    return float32(x[base]), float32(x[base + 1]), float32(x[base + 2]), float32(x[base + 3])


@cuda.jit(device=True, inline="always")
def _scalar_bf16(a, i):
    return as_float((int64(a[i]) & 0xFFFF) << 16)


@cuda.jit(device=True, inline="always")
def _scalar_float(a, i):
    return float32(a[i])


@cuda.jit(device=True, inline="always")
def _store_bf16(out, i, v):
    # fp32 -> bf16 bits, round to nearest even (NaN stays NaN), stored as int16.
    b = as_int(v)
    if (b & 0x7FFFFFFF) > 0x7F800000:
        r = 0x7FC0
    else:
        r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
    out[i] = r - 0x10000 if r >= 0x8000 else r


@cuda.jit(device=True, inline="always")
def _store_float(out, i, v):
    out[i] = v


def signature(xkind: str, skind: str) -> tuple[Any, ...]:
    """numba argument types of the kernel for activations/outputs of `xkind` and scales of `skind`."""
    from numba.cuda import types as numba_types

    t: Any = numba_types
    elem = {"f32": t.float32, "f16": t.float16, "bf16": t.int16}
    xtype = t.int64 if xkind == "bf16" else elem[xkind]
    return (
        t.CPointer(t.int64),  # qw: codes as 64-bit words [out * in / 16]
        t.CPointer(elem[skind]),  # scales [out * groups]
        t.CPointer(t.uint8),  # zero points [out * groups]
        t.CPointer(xtype),  # x [rows * in] (bf16: [rows * in / 4] words)
        t.CPointer(elem[xkind]),  # out [rows * out]
        t.CPointer(t.float32),  # workspace [splits * rows * out]
        t.int32[::1],  # counters [row tiles * output tiles]
        t.int64, t.int64, t.int64, t.int64, t.int64, t.int64,  # rows, outs, in, group, split words, splits
    )


def make_kernel(xkind: str, skind: str, rt: int, ot: int, warps: int) -> Any:
    """The kernel (a plain function, for cuda.jit) for row tiles of `rt` rows, `ot` output rows a warp and `warps`
    warps a block."""
    OT = ot  # noqa: N806 - compile-time constants of the kernel
    BO = warps * ot  # noqa: N806
    THREADS = 32 * warps  # noqa: N806
    quad = _quad_bf16 if xkind == "bf16" else _quad_float
    scale_of = _scalar_bf16 if skind == "bf16" else _scalar_float
    store = _store_bf16 if xkind == "bf16" else _store_float
    pairs = OT * rt  # (output row, activation row) sums a warp holds, added up across lanes one pair a lane
    xn = 4 * rt  # activation values of one quad of columns, all rows of the tile
    nh = 4 * ot  # per output row: low half of the word, low >> 20, high half, high >> 20
    nz = 5 * ot  # per output row: 2^23 + z * 16^i, i = 0..4

    @cuda.jit(device=True, inline="always")
    def quad_step(x, xbase, col, halves, zfs, xs, part, h, second):
        # Codes 4 * second .. + 3 of half h (0: the word's low 32 bits, 1: its high) of each weight word, against
        # activation columns col .. col + 3. A code at nibble i <= 4 of a 32-bit value v is masked in place:
        # (v & 0xF << 4i) | MAGIC is the float 2^23 + q * 16^i, exact; minus 2^23 + z * 16^i it is (q - z) * 16^i,
        # and the activation comes scaled by 16^-i, so the product is (q - z) * x exactly as without the trick.
        # Codes 5..7 of a half are nibbles 0..2 of the half shifted right by 20 (one shift for three codes).
        for r in range(rt):
            a0, a1, a2, a3 = quad(x, xbase[r] + col)
            if second:
                xs[4 * r] = a0 * S4
                xs[4 * r + 1] = a1
                xs[4 * r + 2] = a2 * S1
                xs[4 * r + 3] = a3 * S2
            else:
                xs[4 * r] = a0
                xs[4 * r + 1] = a1 * S1
                xs[4 * r + 2] = a2 * S2
                xs[4 * r + 3] = a3 * S3
        for o in range(OT):
            v = halves[4 * o + 2 * h]  # the half
            u = halves[4 * o + 2 * h + 1]  # the half >> 20
            for c in range(4):
                if second:
                    i = 4 if c == 0 else c - 1
                    bits = (v & 0xF0000) if c == 0 else (u & (0xF << (4 * (c - 1))))
                else:
                    i = c
                    bits = v & (0xF << (4 * c))
                d = as_float(bits | MAGIC) - zfs[5 * o + i]
                for r in range(rt):
                    part[o * rt + r] += d * xs[4 * r + c]

    def int4_gemv(qw, sc, zp, x, out, ws, counters, nrows, nout, ncols, group, split_words, nsplit):
        t = cuda.threadIdx.x
        lane = t % 32
        warp = t // 32
        r0 = cuda.blockIdx.x * rt
        tile = cuda.blockIdx.y
        sp = cuda.blockIdx.z
        o0 = tile * BO + warp * OT
        kwords = ncols // 16
        groups = ncols // group
        gwords = group // 16
        k_end = min(kwords, (sp + 1) * split_words)
        acc = cuda.local.array(pairs, float32)
        part = cuda.local.array(pairs, float32)
        xs = cuda.local.array(xn, float32)
        halves = cuda.local.array(nh, int64)
        zfs = cuda.local.array(nz, float32)
        wbase = cuda.local.array(OT, int64)
        gbase = cuda.local.array(OT, int64)
        xbase = cuda.local.array(rt, int64)
        for o in range(OT):
            oo = min(o0 + o, nout - 1)  # past the end: a valid row whose sums are never stored
            wbase[o] = oo * kwords
            gbase[o] = oo * groups
        for r in range(rt):
            xbase[r] = min(r0 + r, nrows - 1) * ncols
        for p in range(pairs):
            acc[p] = float32(0.0)
        kw = sp * split_words + lane
        while kw < k_end:
            g = kw // gwords
            for o in range(OT):
                w = qw[wbase[o] + kw]
                lo = w & 0xFFFFFFFF
                hi = (w >> 32) & 0xFFFFFFFF
                halves[4 * o] = lo
                halves[4 * o + 1] = lo >> 20
                halves[4 * o + 2] = hi
                halves[4 * o + 3] = hi >> 20
            for o in range(OT):
                z = float32(zp[gbase[o] + g])
                zfs[5 * o] = TWO23 + z
                zfs[5 * o + 1] = TWO23 + z * P1
                zfs[5 * o + 2] = TWO23 + z * P2
                zfs[5 * o + 3] = TWO23 + z * P3
                zfs[5 * o + 4] = TWO23 + z * P4
            for p in range(pairs):
                part[p] = float32(0.0)
            col = 16 * kw
            quad_step(x, xbase, col, halves, zfs, xs, part, 0, 0)
            quad_step(x, xbase, col + 4, halves, zfs, xs, part, 0, 1)
            quad_step(x, xbase, col + 8, halves, zfs, xs, part, 1, 0)
            quad_step(x, xbase, col + 12, halves, zfs, xs, part, 1, 1)
            for o in range(OT):
                s = scale_of(sc, gbase[o] + g)
                for r in range(rt):
                    acc[o * rt + r] += part[o * rt + r] * s
            kw += 32

        # Lanes' sums -> one per (output row, activation row), added in lane order.
        red = cuda.shared.array((warps, pairs, 33), float32)
        for p in range(pairs):
            red[warp, p, lane] = acc[p]
        cuda.syncthreads()
        p = lane
        while p < pairs:
            v = float32(0.0)
            for j in range(32):
                v += red[warp, p, j]
            oo = o0 + p // rt
            rr = r0 + p % rt
            if oo < nout and rr < nrows:
                if nsplit == 1:
                    store(out, rr * nout + oo, v)
                else:
                    ws[(sp * nrows + rr) * nout + oo] = v
            p += 32
        if nsplit == 1:
            return

        # Split K: the last block of this (row tile, output tile) adds the splits' partial sums.
        last = cuda.shared.array(1, np.int32)
        cuda.threadfence()
        cuda.syncthreads()
        counter = cuda.blockIdx.x * cuda.gridDim.y + tile
        if t == 0:
            done = cuda.atomic.add(counters, counter, 1)
            last[0] = 1 if done == nsplit - 1 else 0
        cuda.syncthreads()
        if last[0] == 0:
            return
        cuda.threadfence()
        e = t
        while e < BO * rt:
            oo = tile * BO + e // rt
            rr = r0 + e % rt
            if oo < nout and rr < nrows:
                v = float32(0.0)
                for s2 in range(nsplit):
                    v += ws[(s2 * nrows + rr) * nout + oo]
                store(out, rr * nout + oo, v)
            e += THREADS
        if t == 0:
            counters[counter] = 0

    return int4_gemv
