"""The CUDA C++ source of the Gated DeltaNet's fused short conv for a decode or a verify (compiled by
ignis.kernels.nvrtc, launched from ignis.kernels.conv_cuda).

Owns: `SOURCE` and its compile-time sizes (DKT: the threads of a block, one channel each, at least the key head's
width; KC: the conv's taps; CMAX: the most columns a launch takes; BF16: whether elements are bf16 bits, else
float32; PDL: launched programmatic-dependent, ignis.kernels.launch.gdn_pdl: the window and the taps load before the
kernel waits for the projection ahead). Does not own: the launch, its checks or when it runs (ignis.kernels.conv_cuda,
ignis.kernels.fused).

The work of the numba kernel `conv` of ignis.kernels.fused_kernel, in its order of operations: silu of the causal
depthwise conv over [window | this round's inputs], q and k l2-normalised per head of channels (q then scaled), the
raw beta and decay projections widened to float32, and either each column's input recorded (a verify) or the window
moved on (a decode). A block is one head of channels of one lane and takes all of its columns: every input its
columns' taps read (KC - 1 + C of its channel) and its KC weights are loaded before anything is computed, and the
norms of all its columns meet at one barrier, so a block waits out about one memory latency; the window moves
after, from lines its loads left in L1. bf16 elements widen exactly, and the recorded inputs are their own bits.
"""

from __future__ import annotations

CMAX = 8  # the most columns a launch takes: a verify of up to 7 drafts, or a decode's one

SOURCE = r"""
#ifndef PDL
#define PDL 0
#endif
#define KC1 (KC - 1)
#define SEQ (KC1 + CMAX)
#define WARPS (DKT / 32)
#define FULL 0xffffffffu
#define EPS 1e-6f

#if BF16
typedef unsigned short elem;
__device__ __forceinline__ float load(elem h) { return __uint_as_float(((unsigned)h) << 16); }
__device__ __forceinline__ elem widened(float f) { return (elem)(__float_as_uint(f) >> 16); }  // a loaded bf16: exact
#else
typedef float elem;
__device__ __forceinline__ float load(elem h) { return h; }
__device__ __forceinline__ elem widened(float f) { return f; }
#endif

// window [L, KC1, D] (row strides win_l, win_t); lanes [B] i64; raw [B, C, D] (strides raw_b, raw_c): this round's
// conv inputs; weight [D, KC] f32; mixed [B, C, D] f32 out; record [L, C', D] (strides rec_l, rec_c); ba [B, C, NBA]
// (strides ba_b, ba_c) -> ba_out [B, C, NBA] f32. Last dimensions contiguous. grid (ceil(D / dk), B), DKT threads.
extern "C" __global__ void __launch_bounds__(DKT)
gdn_conv(elem* __restrict__ window, const long long* __restrict__ lanes, const elem* __restrict__ raw,
         const float* __restrict__ weight, float* __restrict__ mixed, elem* __restrict__ record,
         const elem* __restrict__ ba, float* __restrict__ ba_out, int cols, int dim, int dk, int qk_heads,
         float qscale, int do_record, int win_l, int win_t, int raw_b, int raw_c, int rec_l, int rec_c, int ba_b,
         int ba_c, int nba) {
    __shared__ float part[CMAX][WARPS];
    const int t = threadIdx.x, head = blockIdx.x, b = blockIdx.y;
    const int ch = head * dk + t;
    const long long lane = lanes[b];
    const bool active = t < dk && ch < dim;
    float xs[SEQ], w[KC];
#pragma unroll
    for (int i = 0; i < KC1; ++i) xs[i] = active ? load(window[lane * win_l + i * win_t + ch]) : 0.f;
#pragma unroll
    for (int tap = 0; tap < KC; ++tap) w[tap] = active ? weight[ch * KC + tap] : 0.f;
#if PDL
    // Launched ahead of the kernel before it (a projection): the window and the taps are not its output and loaded
    // above while it finished; raw and ba are, so wait before reading them.
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    if (head == 0) {
        for (int i = t; i < cols * nba; i += DKT) {
            const int j = i / nba, n = i % nba;
            ba_out[((long long)b * cols + j) * nba + n] = load(ba[(long long)b * ba_b + j * ba_c + n]);
        }
    }
#pragma unroll
    for (int i = KC1; i < SEQ; ++i) {
        xs[i] = 0.f;
        if (active && i < KC1 + cols) xs[i] = load(raw[(long long)b * raw_b + (i - KC1) * raw_c + ch]);
    }
#if PDL
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // the recurrence may launch; it waits for us
#endif
    float acc[CMAX];
#pragma unroll
    for (int j = 0; j < CMAX; ++j) {
        float a = 0.f;
#pragma unroll
        for (int tap = 0; tap < KC; ++tap) a += xs[j + tap] * w[tap];
        acc[j] = active ? a / (1.f + expf(-a)) : 0.f;
    }
    if (head < qk_heads) {  // the same for the whole block: each column over the head's channels
#pragma unroll
        for (int j = 0; j < CMAX; ++j) {
            if (j < cols) {
                float v = acc[j] * acc[j];
#pragma unroll
                for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(FULL, v, off);
                if (t % 32 == 0) part[j][t / 32] = v;
            }
        }
        __syncthreads();
#pragma unroll
        for (int j = 0; j < CMAX; ++j) {
            if (j < cols) {
                float total = 0.f;
#pragma unroll
                for (int u = 0; u < WARPS; ++u) total += part[j][u];
                acc[j] = acc[j] * (1.f / sqrtf(total + EPS));
                if (head < qk_heads / 2) acc[j] = acc[j] * qscale;
            }
        }
    }
    if (!active) return;
#pragma unroll
    for (int j = 0; j < CMAX; ++j) {
        if (j < cols) {
            mixed[((long long)b * cols + j) * dim + ch] = acc[j];
            if (do_record) record[lane * rec_l + j * rec_c + ch] = widened(xs[KC1 + j]);
        }
    }
    if (!do_record) {  // the window after the round: slot i takes input cols + i (never a slot < i + 1), L1-hot
#pragma unroll
        for (int i = 0; i < KC1; ++i) {
            const int src = cols + i;
            window[lane * win_l + i * win_t + ch] = src < KC1 ? window[lane * win_l + src * win_t + ch]
                                                              : raw[(long long)b * raw_b + (src - KC1) * raw_c + ch];
        }
    }
}
"""
