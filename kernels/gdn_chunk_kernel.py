"""The CUDA C++ source of a verify's Gated DeltaNet recurrence in chunk form (compiled by ignis.kernels.nvrtc,
launched from ignis.kernels.gdn_chunk).

Owns: `SOURCE` and its compile-time sizes (DK, DV: the head's key and value widths; CMAX: the most columns a launch
takes; TVC: a warp's value columns of a row; NCOL: value columns a thread, TVC apart (a block holds TVC NCOL); SL: row
slices a block's state columns are summed over, one warp a slice when TVC is 32; MINB: the blocks an SM the
registers are bounded for; PDL: launched programmatic-dependent). Does not own: the
launch, its checks or when it runs (ignis.kernels.gdn_chunk, ignis.kernels.gdn).

A verify leaves the state alone, so its columns need not be applied to it one after another. With e_j = exp(g_j),
G_j = e_0 .. e_j and r(i, j) = e_(i+1) .. e_j, the state a column j meets decayed is G_j S + sum_(i<j) r(i, j) k_i
delta_i^T, so, for each value column c on its own:
    a_j = (S^T k_j)[c],  b_j = (S^T q_j)[c]                    (one pass over the state: 2 CMAX sums a column)
    delta_j = beta_j (v_j[c] - G_j a_j - sum_(i<j) r(i, j) (k_i . k_j) delta_i)
    o_j = G_j b_j + sum_(i<=j) r(i, j) (k_i . q_j) delta_i
The dot products k_i . k_j and k_i . q_j are the key head's, the same for every value column; the decay products are
taken as products, never as quotients of G (which underflow for fast decays). Against the column-by-column kernel
(ignis.kernels.gdn_cuda_kernel), which decays, sums, updates and sums again every state element each column (four
dependent passes a column), the state is read once into 2 CMAX independent running sums a thread and never written.

Block = TVC NCOL value columns of one value head of one lane, SL * TVC threads: thread (s, c) = t / TVC, t % TVC keeps
rows s DK/SL .. (s+1) DK/SL - 1 of columns c, c + TVC, .. (a warp reads a row's TVC columns as one coalesced load) and
sums them against every staged column's k and q, which a warp reads as broadcasts (a row's 2 CMAX values side by
side, each read used for NCOL columns); the slices' sums meet in shared memory, and the first TVC NCOL threads solve
their columns' deltas and outputs. The columns are
also staged transposed (a column's rows side by side), from which two threads a pair take the key head's dot
products as 16-byte reads.
"""

from __future__ import annotations

from ignis.kernels.gdn_cuda_kernel import CONV_CHANNEL

CMAX = 8  # the most columns a launch takes: a verify of up to 7 drafts

_HEAD = r"""
#ifndef PDL
#define PDL 0
#endif
#ifndef CONV
#define CONV 0
#endif
#ifndef CBF16
#define CBF16 0
#endif
#ifndef KC
#define KC 4
#endif
#define KC1 (KC - 1)
#define SEQ (KC1 + CMAX)
#define CONV_EPS 1e-6f  // the l2 norm's, as gdn_conv's
#define THREADS (TVC * SL)
#define BC (TVC * NCOL)  // value columns a block
#define RPS (DK / SL)  // rows a slice
#define RW (DK + DV + 2)
#define W2 (2 * CMAX)  // a staged row: k of every column, then q of every column
#define PAIRS (CMAX * (CMAX + 1) / 2)  // (i, j), i <= j: the k . q products
#define STRICT (CMAX * (CMAX - 1) / 2)  // (i, j), i < j: the k . k products
#define DKP (DK + 4)  // a transposed column's stride: column j starts 4 j banks on, so columns read at once differ
#define STAGED (DK * W2 + W2 * DKP)
#define SUMS (SL * W2 * BC)
#define POOL (STAGED > SUMS ? STAGED : SUMS)

// The pair p as (i, j), row by row: i <= j ((0, 0), (0, 1), .., (1, 1), ..), or i < j where strict.
__device__ __forceinline__ void pair_of(int p, bool strict, int& i, int& j) {
    i = 0;
    int left = strict ? CMAX - 1 : CMAX;
    while (p >= left) {
        p -= left;
        ++i;
        --left;
    }
    j = i + p + (strict ? 1 : 0);
}

"""

_BODY = r"""
// CONV: each column's sum of squares of acc over the warp, written to part[j][warp u of the key head's channels]
__device__ __forceinline__ void head_squares(const float acc[CMAX], int ncols, int e, float part[CMAX][QKW]) {
#pragma unroll
    for (int j = 0; j < CMAX; ++j) {
        if (j < ncols) {
            float v = acc[j] * acc[j];
#pragma unroll
            for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
            if (e % 32 == 0) part[j][e / 32] = v;
        }
    }
}

// state [L, Hv, DK, DV] f32 (read); lanes [B] i64; mixed [B, C, width] f32: q | k | v, q and k l2-normalised (q
// scaled); ba [B, C, 2 Hv] f32: the raw beta and decay projections; dt_bias, rate [Hv] f32; out [B, C, Hv, DV] f32:
// every column's output; record [L, rec_cols, Hv, RW] f32: each column's k, delta, g and beta.
// grid (DV / BC, Hv, B), THREADS threads.
extern "C" __global__ void __launch_bounds__(THREADS, MINB)
gdn_chunk(const float* __restrict__ state, const long long* __restrict__ lanes, const float* __restrict__ mixed,
          const float* __restrict__ ba, const float* __restrict__ dt_bias, const float* __restrict__ rate,
          float* __restrict__ out, float* __restrict__ record, int ncols, int hv, int width, int key_dim, int ratio,
          int rec_cols, const celem* __restrict__ window, const celem* __restrict__ raw,
          const float* __restrict__ taps, celem* __restrict__ inputs, const celem* __restrict__ raw_ba, int win_l,
          int win_t, int raw_b, int raw_c, int in_l, int in_c, int ba_b, int ba_c, float qscale) {
    // The staged columns, then (past a barrier) the slices' sums in the same memory.
    __shared__ __align__(16) float pool[POOL];
    float(*sqk)[W2] = reinterpret_cast<float(*)[W2]>(pool);  // row r: k_0[r] .. k_(CMAX-1)[r], q_0[r] .. q_(CMAX-1)[r]
    float(*skt)[DKP] = reinterpret_cast<float(*)[DKP]>(pool + DK * W2);  // transposed: column j's k (j < CMAX) or q
    float(*part)[W2][BC] = reinterpret_cast<float(*)[W2][BC]>(pool);  // each slice's sums
    __shared__ float sv[CMAX][BC];
    __shared__ float se[CMAX];  // e_j = exp(g_j); 1 past ncols
    __shared__ float sb[CMAX];  // beta_j; 0 past ncols
    __shared__ float gam[CMAX];  // G_j
    __shared__ float wkk[CMAX][CMAX];  // [i][j], i < j: r(i, j) (k_i . k_j)
    __shared__ float wkq[CMAX][CMAX];  // [i][j], i <= j: r(i, j) (k_i . q_j)
    const int t = threadIdx.x, s = t / TVC, cl = t % TVC;
    const int c = blockIdx.x * BC + cl;  // the thread's first column; its others NCOL apart by TVC
    const int h = blockIdx.y, b = blockIdx.z;
    const long long lane = lanes[b];
    const int hk = h / ratio;
    const bool keeper = blockIdx.x == 0;  // one block of a head records its k and gates
    const float* st_at = state + ((size_t)lane * hv + h) * (DK * DV) + (size_t)s * RPS * DV + c;
    const float* mb = mixed + (size_t)b * ncols * width;
    float* rec = record + (size_t)lane * rec_cols * hv * RW + (size_t)h * RW;  // column j: + j * hv * RW

    // The state first, so that its loads are in flight while the block stages its columns and their dot products.
    float st[NCOL][RPS];
#pragma unroll
    for (int i = 0; i < RPS; ++i) {
#pragma unroll
        for (int n = 0; n < NCOL; ++n) st[n][i] = st_at[(size_t)i * DV + n * TVC];
    }
#if PDL
    asm volatile("griddepcontrol.wait;" ::: "memory");  // mixed and ba are the kernel before's output
#endif

#if CONV
    // The short conv of this round's columns for the channels the block reads (gdn_conv's arithmetic): the key head's
    // q and k channels (every block of the head's group convolves them; one records them), a thread a channel in
    // turn, then the block's own v channels. q and k are normalised once the heads' squares are in.
    __shared__ float qkpart[2][CMAX][QKW];  // [q, k][column][warp]: the head's squares
    {
        const celem* rw = raw + (size_t)b * raw_b;
        const celem* wl = window + (size_t)lane * win_l;
        celem* il = inputs + (size_t)lane * in_l;
        const bool qk_keeper = keeper && h % ratio == 0;  // records the key head's inputs
        for (int e2 = t; e2 < 2 * DK; e2 += THREADS) {  // a warp's channels all q or all k (DK a multiple of 32)
            const int which = e2 / DK, e = e2 % DK;  // 0: q, 1: k
            const int ch = which * key_dim + hk * DK + e;
            float acc[CMAX];
            conv_channel(wl + ch, win_t, rw + ch, raw_c, taps + (size_t)ch * KC, ncols, acc);
            const int col0 = which == 0 ? CMAX : 0;  // the staged row: k first, then q
#pragma unroll
            for (int j = 0; j < CMAX; ++j) skt[col0 + j][e] = j < ncols ? acc[j] : 0.f;
            head_squares(acc, ncols, e, qkpart[which]);
            if (qk_keeper) {
                for (int j = 0; j < ncols; ++j) il[(size_t)j * in_c + ch] = rw[(size_t)j * raw_c + ch];
            }
        }
        for (int n = t; n < BC; n += THREADS) {
            const int chv = 2 * key_dim + h * DV + blockIdx.x * BC + n;
            float acc[CMAX];
            conv_channel(wl + chv, win_t, rw + chv, raw_c, taps + (size_t)chv * KC, ncols, acc);
#pragma unroll
            for (int j = 0; j < CMAX; ++j) sv[j][n] = j < ncols ? acc[j] : 0.f;
            for (int j = 0; j < ncols; ++j) il[(size_t)j * in_c + chv] = rw[(size_t)j * raw_c + chv];
        }
    }
    __syncthreads();
    for (int e2 = t; e2 < 2 * DK; e2 += THREADS) {  // each channel normalised over its head, in both layouts
        const int which = e2 / DK, e = e2 % DK;
        const int col0 = which == 0 ? CMAX : 0;
        float row[CMAX];
#pragma unroll
        for (int j = 0; j < CMAX; ++j) {
            row[j] = 0.f;
            if (j < ncols) {
                float total = 0.f;
#pragma unroll
                for (int u = 0; u < QKW; ++u) total += qkpart[which][j][u];
                row[j] = skt[col0 + j][e] * (1.f / sqrtf(total + CONV_EPS));
                if (which == 0) row[j] = row[j] * qscale;
            }
            skt[col0 + j][e] = row[j];
        }
        float4* dst = reinterpret_cast<float4*>(&sqk[e][col0]);
#pragma unroll
        for (int u = 0; u < CMAX / 4; ++u)
            dst[u] = make_float4(row[4 * u], row[4 * u + 1], row[4 * u + 2], row[4 * u + 3]);
        if (keeper && which == 1) {
#pragma unroll
            for (int j = 0; j < CMAX; ++j)
                if (j < ncols) rec[(size_t)j * hv * RW + e] = row[j];
        }
    }
#else
    // Stage every column's k and q (a thread a key channel, zeros past ncols), the block's v and the gates.
    for (int e = t; e < DK; e += THREADS) {
#pragma unroll
        for (int part = 0; part < 2; ++part) {  // k, then q: CMAX values held at a time
            const int from = part == 0 ? key_dim + hk * DK + e : hk * DK + e;
            float row[CMAX];
#pragma unroll
            for (int j = 0; j < CMAX; ++j) row[j] = j < ncols ? mb[j * width + from] : 0.f;
            float4* dst = reinterpret_cast<float4*>(&sqk[e][part * CMAX]);
#pragma unroll
            for (int u = 0; u < CMAX / 4; ++u)
                dst[u] = make_float4(row[4 * u], row[4 * u + 1], row[4 * u + 2], row[4 * u + 3]);
#pragma unroll
            for (int j = 0; j < CMAX; ++j) skt[part * CMAX + j][e] = row[j];
            if (keeper && part == 0) {
#pragma unroll
                for (int j = 0; j < CMAX; ++j)
                    if (j < ncols) rec[(size_t)j * hv * RW + e] = row[j];
            }
        }
    }
    for (int j = s; j < CMAX; j += SL) {
#pragma unroll
        for (int n = 0; n < NCOL; ++n)
            sv[j][cl + n * TVC] = j < ncols ? mb[j * width + 2 * key_dim + h * DV + c + n * TVC] : 0.f;
    }
#endif
    if (t < CMAX) {
        float e = 1.f, beta = 0.f;
        if (t < ncols) {
#if CONV
            const celem* r = raw_ba + (size_t)b * ba_b + (size_t)t * ba_c;
            const float rb = cload(r[h]), ra = cload(r[hv + h]);
#else
            const float* r = ba + ((size_t)b * ncols + t) * 2 * hv;
            const float rb = r[h], ra = r[hv + h];
#endif
            beta = 1.f / (1.f + expf(-rb));
            const float a = ra + dt_bias[h];
            const float g = rate[h] * (a > 20.f ? a : log1pf(expf(a)));
            e = expf(g);
            if (keeper) {
                rec[(size_t)t * hv * RW + DK + DV] = g;
                rec[(size_t)t * hv * RW + DK + DV + 1] = beta;
            }
        }
        se[t] = e;
        sb[t] = beta;
    }
    __syncthreads();

    // The key head's dot products k_i . q_j (i <= j) and k_i . k_j (i < j), each weighted by r(i, j): two threads a
    // pair, each every other float4 of the transposed columns, met by a shuffle; and G_j.
    for (int base = 0; base < 2 * (PAIRS + STRICT); base += THREADS) {  // every thread of a warp takes each turn
        const int p2 = base + t;
        const bool on = p2 < 2 * (PAIRS + STRICT);
        const int p = on ? p2 / 2 : 0, half = p2 % 2;
        const bool kk = p >= PAIRS;
        int i, j;
        pair_of(kk ? p - PAIRS : p, kk, i, j);
        const float4* x4 = reinterpret_cast<const float4*>(&skt[i][0]);
        const float4* y4 = reinterpret_cast<const float4*>(&skt[kk ? j : CMAX + j][0]);
        float sum[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 8
        for (int m = half; m < DK / 4; m += 2) {
            const float4 x = x4[m], y = y4[m];
            sum[0] += x.x * y.x;
            sum[1] += x.y * y.y;
            sum[2] += x.z * y.z;
            sum[3] += x.w * y.w;
        }
        float d = (sum[0] + sum[1]) + (sum[2] + sum[3]);
        d += __shfl_xor_sync(0xffffffffu, d, 1);
        if (on && half == 0) {
            float w = 1.f;
            for (int l = i + 1; l <= j; ++l) w *= se[l];
            if (kk) wkk[i][j] = w * d;
            else wkq[i][j] = w * d;
        }
    }
    if (t < CMAX) {
        float g = 1.f;
        for (int l = 0; l <= t; ++l) g *= se[l];
        gam[t] = g;
    }

    // One pass over the state: this thread's rows of its columns against every column's k and q.
    float acc[NCOL][W2];
#pragma unroll
    for (int n = 0; n < NCOL; ++n) {
#pragma unroll
        for (int m = 0; m < W2; ++m) acc[n][m] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < RPS; ++i) {
        const float4* row = reinterpret_cast<const float4*>(&sqk[s * RPS + i][0]);
#pragma unroll
        for (int u = 0; u < W2 / 4; ++u) {
            const float4 x = row[u];
#pragma unroll
            for (int n = 0; n < NCOL; ++n) {
                acc[n][4 * u] += st[n][i] * x.x;
                acc[n][4 * u + 1] += st[n][i] * x.y;
                acc[n][4 * u + 2] += st[n][i] * x.z;
                acc[n][4 * u + 3] += st[n][i] * x.w;
            }
        }
    }
#if PDL
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // the next kernel may launch; it waits for us
#endif
    __syncthreads();  // every warp is done with the staged columns, whose memory takes the sums
#pragma unroll
    for (int n = 0; n < NCOL; ++n) {
#pragma unroll
        for (int m = 0; m < W2; ++m) part[s][m][cl + n * TVC] = acc[n][m];
    }
    __syncthreads();

    // Each column's deltas and outputs, in column order.
    if (t < BC) {  // thread t: the block's column t
        const int cb = blockIdx.x * BC + t;
        float a[CMAX], q[CMAX], delta[CMAX];
#pragma unroll
        for (int j = 0; j < CMAX; ++j) {
            float sa = 0.f, sq = 0.f;
#pragma unroll
            for (int u = 0; u < SL; ++u) {
                sa += part[u][j][t];
                sq += part[u][CMAX + j][t];
            }
            a[j] = sa;
            q[j] = sq;
        }
#pragma unroll
        for (int j = 0; j < CMAX; ++j) {
            if (j < ncols) {
                float mem = gam[j] * a[j];
#pragma unroll
                for (int i = 0; i < j; ++i) mem += wkk[i][j] * delta[i];
                delta[j] = sb[j] * (sv[j][t] - mem);
                float o = gam[j] * q[j];
#pragma unroll
                for (int i = 0; i <= j; ++i) o += wkq[i][j] * delta[i];
                rec[(size_t)j * hv * RW + DK + cb] = delta[j];
                out[(((size_t)b * ncols + j) * hv + h) * DV + cb] = o;
            } else {
                delta[j] = 0.f;
            }
        }
    }
}
"""

SOURCE = _HEAD + CONV_CHANNEL + _BODY
