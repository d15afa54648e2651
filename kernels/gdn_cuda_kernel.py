"""The CUDA C++ source of the Gated DeltaNet recurrence over the columns of a decode or a verify (compiled by
ignis.kernels.nvrtc, launched from ignis.kernels.gdn_cuda).

Owns: `SOURCE` and its compile-time sizes (DK, DV: the head's key and value widths; CMAX: the most columns a launch
takes; TV: state columns a block; MINB: the blocks an SM the registers are bounded for; KEEP_K: whether a thread
holds its rows of a column's k in registers between the column's two passes, or reads them from shared memory again
(fewer registers, so more blocks an SM); NORMED: whether the block, then holding the whole head, also applies the gated
output norm and writes its result; BF16: the element type of the gate, the norm's weight and that result; PDL: launched
programmatic-dependent, ignis.kernels.launch.gdn_pdl: the state loads before the kernel waits for the conv; CONV: the
short conv joined, CBF16 its inputs' element type and KC its taps). Does not own: the launch, its checks or when it
runs (ignis.kernels.gdn_cuda, ignis.kernels.gdn).

Built with CONV, the kernel reads the in projection's raw output and the conv window instead of the conv kernel's
float32 result (ignis.kernels.conv_cuda_kernel, whose arithmetic it repeats to the bit): every block of a key head's
group convolves that head's q and k channels itself, and its own state columns' v channels, so no launch or round
trip through memory stands between the projection and the recurrence. A decode moves the window on: a block its own
v channels, and the last block of a key head's group to count itself in (a counter a lane's key head, set back to zero
by that block) the head's q and k channels, which the others have read by then.

The same work as the numba kernel `columns` of ignis.kernels.gdn_kernel (its docstring has the layout), but for the
order of the fp32 sums: a block is one value head of one lane and TV = 32 columns of its [dk, dv] state; thread
(c, s) keeps rows s, s + 4, s + 8, .. of column c in registers, and a sum over a column meets the four threads' parts
by two warp shuffles. A staged column of k or q is stored so that a thread reads its rows as float4 (rows 4i + s for
i = 4m .. 4m + 3 side by side at 16 (m) + 4 s), which the four threads of a column read from four distinct banks.
Against the numba kernel, whose column loop compiles to about the same instructions (PTX: 107 and 104 a column
against numba's 108 and 105), it changes two things: a thread's two sums over its rows run as four running sums
(a dependent chain of 8 multiply-adds, not 16), and, built with NORMED, the gated output norm joins the launch.
"""

from __future__ import annotations

CMAX = 8  # the most columns a launch takes: a verify of up to 7 drafts, or a decode's one

# The joined conv's element type and one channel's conv (the including source defines CBF16, KC, KC1, SEQ, CMAX and
# DK): ignis.kernels.gdn_chunk_kernel's joined conv is built from the same text, so both repeat gdn_conv's arithmetic.
CONV_CHANNEL = r"""#if CBF16  // the conv's inputs, window and record (CONV)
typedef unsigned short celem;
__device__ __forceinline__ float cload(celem h) { return __uint_as_float(((unsigned)h) << 16); }
#else
typedef float celem;
__device__ __forceinline__ float cload(celem h) { return h; }
#endif
#define QKW ((DK + 31) / 32)  // warps holding a key head's channels (CONV: a thread a channel)

// CONV: silu of the causal conv of one channel for every column, as gdn_conv computes it: xs = [the window's KC1
// inputs | this round's], weights w; also each column's square for the head's l2 norm.
__device__ __forceinline__ void conv_channel(const celem* win, int win_t, const celem* rw, int raw_c, const float* w4,
                                             int ncols, float acc[CMAX]) {
    float xs[SEQ], w[KC];
#pragma unroll
    for (int i = 0; i < KC1; ++i) xs[i] = cload(win[i * win_t]);
#pragma unroll
    for (int tap = 0; tap < KC; ++tap) w[tap] = w4[tap];
#pragma unroll
    for (int i = KC1; i < SEQ; ++i) xs[i] = i < KC1 + ncols ? cload(rw[(i - KC1) * raw_c]) : 0.f;
#pragma unroll
    for (int j = 0; j < CMAX; ++j) {
        float a = 0.f;
#pragma unroll
        for (int tap = 0; tap < KC; ++tap) a += xs[j + tap] * w[tap];
        acc[j] = a / (1.f + expf(-a));
    }
}

"""

SOURCE = r"""
#ifndef PDL
#define PDL 0
#endif
#ifndef CONV
#define CONV 0
#endif
#ifndef KC
#define KC 4
#endif
#define KC1 (KC - 1)
#define CONV_EPS 1e-6f  // the l2 norm's, as gdn_conv's
#define SEQ (KC1 + CMAX)
#define RS 4
#define THREADS (TV * RS)
#define WARPS (THREADS / 32)
#define ROWS (DK / RS)
#define RW (DK + DV + 2)
#define FULL 0xffffffffu
#if KEEP_K
#define KR(i4) (4 * (i4))  // a thread's k rows, held from the column's first pass to its second
#else
#define KR(i4) 0  // the four k rows of one float4, read again in the second pass
#endif

#if BF16
typedef unsigned short elem;
__device__ __forceinline__ float load(elem h) { return __uint_as_float(((unsigned)h) << 16); }
__device__ __forceinline__ elem store(float f) {  // to nearest even, as torch rounds
    const unsigned u = __float_as_uint(f);
    return (elem)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
#else
typedef float elem;
__device__ __forceinline__ float load(elem h) { return h; }
__device__ __forceinline__ elem store(float f) { return f; }
#endif
__device__ __forceinline__ float rounded(float f) { return load(store(f)); }

""" + CONV_CHANNEL + r"""// CONV, a decode: one channel's window moved on past this round's ncols inputs. Slot i takes input ncols + i of
// [window | raw], never a slot below i + 1, so the slots are read before they are written.
__device__ __forceinline__ void move_window(celem* win, int win_t, const celem* rw, int raw_c, int ncols) {
#pragma unroll
    for (int i = 0; i < KC1; ++i) {
        const int src = ncols + i;
        win[(size_t)i * win_t] = src < KC1 ? win[(size_t)src * win_t] : rw[(size_t)(src - KC1) * raw_c];
    }
}

// CONV: each column's sum of acc^2 over a warp, written to part[j][warp] by the warp's lane 0 (warps < QKW)
__device__ __forceinline__ void square_sums(const float acc[CMAX], bool on, int ncols, int t, float part[CMAX][QKW]) {
#pragma unroll
    for (int j = 0; j < CMAX; ++j) {
        if (j < ncols) {
            float v = on ? acc[j] * acc[j] : 0.f;
#pragma unroll
            for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(FULL, v, off);
            if (t % 32 == 0 && t / 32 < QKW) part[j][t / 32] = v;
        }
    }
}

__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(FULL, x, 1);
    return x + __shfl_xor_sync(FULL, x, 2);
}

// Row r of a staged k or q column (r = 4 i + s, thread s's i-th row) sits at 16 (i / 4) + 4 s + i % 4.
__device__ __forceinline__ int slot(int r) {
    const int i = r / RS, s = r % RS;
    return (i / 4) * (RS * 4) + s * 4 + (i % 4);
}

// state [L, Hv, DK, DV] f32; lanes [B] i64; mixed [B, C, width] f32: q | k | v, q and k l2-normalised (q scaled);
// ba [B, C, 2 Hv] f32: the raw beta and decay projections; dt_bias, rate [Hv] f32; record [L, rec_cols, Hv, RW] f32:
// each column's k, delta, g and beta. Without NORMED: out [B, C, Hv, DV] f32, every column's output. With NORMED
// (TV = DV: a block holds the whole head): z [B C, Hv DV] elements (row stride z_row), the gate; norm [DV] elements;
// y [B C, Hv DV] elements = norm * rms_norm(out) * silu(z), rounded where ignis.kernels.fused's gated_norm rounds.
// grid (ceil(DV / TV), Hv, B), THREADS threads.
extern "C" __global__ void __launch_bounds__(THREADS, MINB)
gdn_columns(float* __restrict__ state, const long long* __restrict__ lanes, const float* __restrict__ mixed,
            const float* __restrict__ ba, const float* __restrict__ dt_bias, const float* __restrict__ rate,
            float* __restrict__ out, float* __restrict__ record, const elem* __restrict__ z,
            const elem* __restrict__ norm, elem* __restrict__ y, int ncols, int hv, int width, int key_dim,
            int ratio, int rec_cols, int write_state, int do_record, int z_row, float eps,
            celem* __restrict__ window, const celem* __restrict__ raw, const float* __restrict__ taps,
            celem* __restrict__ inputs, const celem* __restrict__ raw_ba, int* __restrict__ counts, int win_l,
            int win_t, int raw_b, int raw_c, int in_l, int in_c, int ba_b, int ba_c, float qscale) {
    __shared__ __align__(16) float sk[CMAX][DK];
    __shared__ __align__(16) float sq[CMAX][DK];
    __shared__ float sv[CMAX][TV];
    __shared__ float ds[CMAX];
    __shared__ float bs[CMAX];
#if NORMED
    __shared__ float npart[CMAX][WARPS];
#endif
    const int t = threadIdx.x, cl = t / RS, s = t % RS;
    const int c = blockIdx.x * TV + cl;
    const int h = blockIdx.y, b = blockIdx.z;
    const long long lane = lanes[b];
    const int hk = h / ratio;
    const bool live = c < DV;
    const bool keeper = do_record && blockIdx.x == 0;  // one block of a head records its k and gates
    float* st_at = state + ((size_t)lane * hv + h) * (DK * DV);
    const float* mb = mixed + (size_t)b * ncols * width;
    float* rec = record + (size_t)lane * rec_cols * hv * RW + (size_t)h * RW;  // column j: + j * hv * RW

    // The state first, so that its loads are in flight with the staging's. (Read after the staging instead, no
    // register spills at six blocks an SM, but the 8 x 8 verify took 34.1 µs a layer against 28.9 on the H200.)
    float st[ROWS];
#pragma unroll
    for (int i = 0; i < ROWS; ++i) st[i] = live ? st_at[(i * RS + s) * DV + c] : 0.f;
#if NORMED
    float zr[CMAX];  // the gate of this thread's state column at each column (thread s = 0 writes y)
    const float wn = live ? load(norm[c]) : 0.f;
#define LOAD_GATE                                                                                                  \
    for (int j = 0; j < CMAX; ++j)                                                                                 \
        zr[j] = (j < ncols && live && s == 0) ? load(z[((size_t)b * ncols + j) * z_row + h * DV + c]) : 0.f;
#if !CONV
#pragma unroll
    LOAD_GATE
#endif
#endif
#if PDL
    // Launched ahead of the kernel before it: the state and the norm's weight are not its output and loaded above
    // while it finished, and so the gate where that kernel is the conv; mixed and ba are, so wait before the staging
    // reads them. With CONV the kernel before is the projection that made the gate too: it loads after the wait.
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#if NORMED && CONV
#pragma unroll
    LOAD_GATE
#endif

#if CONV
    // The short conv of this round's columns for the channels the block reads (gdn_conv's arithmetic): a thread a
    // channel of the key head's q and k (every block of the head's group computes them; one records them) and the
    // four threads of a state column its v channel's columns in turn. q and k are normalised after a barrier.
    __shared__ float qpart[CMAX][QKW];
    __shared__ float kpart[CMAX][QKW];
    __shared__ int last_block;
    int ticket = 0;  // thread 0's place in its key head's count (a decode)
    const celem* rw = raw + (size_t)b * raw_b;
    celem* wl = window + (size_t)lane * win_l;
    celem* il = inputs + (size_t)lane * in_l;
    const bool on = t < DK;
    const int chq = hk * DK + (on ? t : 0), chk = key_dim + chq, chv = 2 * key_dim + h * DV + (live ? c : 0);
    const bool qk_keeper = do_record && on && blockIdx.x == 0 && h % ratio == 0;  // records the key head's inputs
    {
        float acc[CMAX];
        conv_channel(wl + chq, win_t, rw + chq, raw_c, taps + (size_t)chq * KC, ncols, acc);
#pragma unroll
        for (int j = 0; j < CMAX; ++j)
            if (j < ncols && on) sq[j][slot(t)] = acc[j];
        square_sums(acc, on, ncols, t, qpart);
        conv_channel(wl + chk, win_t, rw + chk, raw_c, taps + (size_t)chk * KC, ncols, acc);
#pragma unroll
        for (int j = 0; j < CMAX; ++j)
            if (j < ncols && on) sk[j][slot(t)] = acc[j];
        square_sums(acc, on, ncols, t, kpart);
    }
    if (qk_keeper) {
        for (int j = 0; j < ncols; ++j) {
            il[(size_t)j * in_c + chq] = rw[(size_t)j * raw_c + chq];
            il[(size_t)j * in_c + chk] = rw[(size_t)j * raw_c + chk];
        }
    }
    for (int j = s; j < ncols; j += RS) {
        float a = 0.f;
#pragma unroll
        for (int tap = 0; tap < KC; ++tap) {
            const int n = j + tap;
            const float x = n < KC1 ? cload(wl[(size_t)n * win_t + chv]) : cload(rw[(size_t)(n - KC1) * raw_c + chv]);
            a += x * taps[(size_t)chv * KC + tap];
        }
        sv[j][cl] = live ? a / (1.f + expf(-a)) : 0.f;
        if (do_record && live) il[(size_t)j * in_c + chv] = rw[(size_t)j * raw_c + chv];
    }
#else
    // Stage every column's q and k (a thread a channel), the block's v and the gates: loads before stores.
    for (int e = t; e < DK; e += THREADS) {
        float qv[CMAX], kv[CMAX];
#pragma unroll
        for (int j = 0; j < CMAX; ++j) {
            if (j < ncols) {
                qv[j] = mb[j * width + hk * DK + e];
                kv[j] = mb[j * width + key_dim + hk * DK + e];
            }
        }
        const int p = slot(e);
#pragma unroll
        for (int j = 0; j < CMAX; ++j) {
            if (j < ncols) {
                sq[j][p] = qv[j];
                sk[j][p] = kv[j];
                if (keeper) rec[(size_t)j * hv * RW + e] = kv[j];
            }
        }
    }
    for (int j = s; j < ncols; j += RS) sv[j][cl] = live ? mb[j * width + 2 * key_dim + h * DV + c] : 0.f;
#endif
    if (t < ncols) {
#if CONV
        const celem* r = raw_ba + (size_t)b * ba_b + (size_t)t * ba_c;
        const float rb = cload(r[h]), ra = cload(r[hv + h]);
#else
        const float* r = ba + ((size_t)b * ncols + t) * 2 * hv;
        const float rb = r[h], ra = r[hv + h];
#endif
        const float beta = 1.f / (1.f + expf(-rb));
        const float a = ra + dt_bias[h];
        const float g = rate[h] * (a > 20.f ? a : log1pf(expf(a)));
        ds[t] = expf(g);
        bs[t] = beta;
        if (keeper) {
            rec[(size_t)t * hv * RW + DK + DV] = g;
            rec[(size_t)t * hv * RW + DK + DV + 1] = beta;
        }
    }
    __syncthreads();  // (CONV: the squares' sums are in; every read of the window by this block is done)
#if CONV
    if (!do_record) {  // a decode moves the window on: the block's own v channels now, its q and k below
        if (s == 0 && live) move_window(wl + chv, win_t, rw + chv, raw_c, ncols);
        // The key head's q and k channels are read by all of its group's blocks, which have read them by now: the
        // last to count itself in moves them, at its end (the count's round trip is not waited for until then).
        if (t == 0) ticket = atomicAdd(&counts[(size_t)b * (hv / ratio) + hk], 1);
    }
    if (on) {
#pragma unroll
        for (int j = 0; j < CMAX; ++j) {
            if (j < ncols) {
                float tq = 0.f, tk = 0.f;
#pragma unroll
                for (int u = 0; u < QKW; ++u) {
                    tq += qpart[j][u];
                    tk += kpart[j][u];
                }
                float qn = sq[j][slot(t)] * (1.f / sqrtf(tq + CONV_EPS));
                sq[j][slot(t)] = qn * qscale;
                const float kn = sk[j][slot(t)] * (1.f / sqrtf(tk + CONV_EPS));
                sk[j][slot(t)] = kn;
                if (keeper) rec[(size_t)j * hv * RW + t] = kn;
            }
        }
    }
    __syncthreads();
#endif
#if PDL
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // the next kernel may launch; it waits for us
#endif

#pragma unroll 1
    for (int j = 0; j < ncols; ++j) {
        const float decay = ds[j];
        const float4* k4 = reinterpret_cast<const float4*>(&sk[j][0]);
        const float4* q4 = reinterpret_cast<const float4*>(&sq[j][0]);
#if KEEP_K
        float kr[ROWS];
#else
        float kr[4];
#endif
        float m[4] = {0.f, 0.f, 0.f, 0.f};  // four running sums: a quarter of the dependent chain
#pragma unroll
        for (int i4 = 0; i4 < ROWS / 4; ++i4) {
            const float4 k = k4[i4 * RS + s];
            kr[KR(i4)] = k.x; kr[KR(i4) + 1] = k.y; kr[KR(i4) + 2] = k.z; kr[KR(i4) + 3] = k.w;
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                st[4 * i4 + u] *= decay;
                m[u] += kr[KR(i4) + u] * st[4 * i4 + u];
            }
        }
        const float mem = quad_sum((m[0] + m[1]) + (m[2] + m[3]));
        const float delta = live ? bs[j] * (sv[j][cl] - mem) : 0.f;
        if (do_record && s == 1 && live) rec[(size_t)j * hv * RW + DK + c] = delta;
        float os[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int i4 = 0; i4 < ROWS / 4; ++i4) {
            const float4 q = q4[i4 * RS + s];
            const float qr[4] = {q.x, q.y, q.z, q.w};
#if !KEEP_K
            const float4 k = k4[i4 * RS + s];  // read again: the column's k is not held in registers
            kr[0] = k.x; kr[1] = k.y; kr[2] = k.z; kr[3] = k.w;
#endif
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                st[4 * i4 + u] += kr[KR(i4) + u] * delta;
                os[u] += qr[u] * st[4 * i4 + u];
            }
        }
        const float o = quad_sum((os[0] + os[1]) + (os[2] + os[3]));
#if NORMED
        // The gated output norm over the head's DV outputs: the output rounded, its sum of squares over the block.
        const float ob = (s == 0 && live) ? rounded(o) : 0.f;
        float v = ob * ob;
#pragma unroll
        for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(FULL, v, off);
        if (t % 32 == 0) npart[j][t / 32] = v;
        __syncthreads();
        if (s == 0 && live) {
            float total = 0.f;
#pragma unroll
            for (int u = 0; u < WARPS; ++u) total += npart[j][u];
            const float r = 1.f / sqrtf(total / (float)DV + eps);
            const float wh = rounded(wn * rounded(ob * r));
            float g = 0.f;
#pragma unroll
            for (int n = 0; n < CMAX; ++n)
                if (n == j) g = zr[n];
            y[((size_t)b * ncols + j) * hv * DV + h * DV + c] = store(wh * (g / (1.f + expf(-g))));
        }
#else
        if (s == 0 && live) out[(((size_t)b * ncols + j) * hv + h) * DV + c] = o;
#endif
    }
    if (write_state && live) {
#pragma unroll
        for (int i = 0; i < ROWS; ++i) st_at[(i * RS + s) * DV + c] = st[i];
    }
#if CONV
    if (!do_record) {
        if (t == 0) last_block = ticket == (int)gridDim.x * ratio - 1;
        __syncthreads();
        if (last_block) {
            if (on) {
                move_window(wl + chq, win_t, rw + chq, raw_c, ncols);
                move_window(wl + chk, win_t, rw + chk, raw_c, ncols);
            }
            if (t == 0) counts[(size_t)b * (hv / ratio) + hk] = 0;  // ready for the next launch
        }
    }
#endif
}
"""
