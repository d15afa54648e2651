"""The CUDA C++ source of the commit's replay of a verify's kept columns onto every Gated DeltaNet layer's state
(compiled by ignis.kernels.nvrtc, launched from ignis.kernels.replay_cuda).

Owns: `SOURCE` and its compile-time sizes (DK, DV: the head's key and value widths; CMAX: the most columns a record
holds; RB: state rows a block; CG = DV / 4: a row's float4s, one a thread). Does not own: the launch, its checks or
when it runs (ignis.kernels.replay_cuda, ignis.kernels.gdn.replay).

The same work as the numba kernel `replay` of ignis.kernels.gdn_kernel: each kept column j of a lane (j <= last) is
S <- exp(g_j) S + k_j delta_j^T with the k, delta and g its verify recorded. Nothing is summed across threads, so the
state is laid out for its loads alone: block = RB rows of one value head of one lane of one layer, thread (r0, cg)
holds the float4 at columns 4 cg .. 4 cg + 3 of rows r0, r0 + 4, .., so a warp reads and writes whole rows as 16-byte
vectors, and a lane that keeps no column is neither read nor written.
"""

from __future__ import annotations

SOURCE = r"""
#define CG (DV / 4)  // a row's float4s
#define THREADS (CG * 4)
#define NR (RB / 4)  // rows a thread
#define RW (DK + DV + 2)

// states [G, L, Hv, DK, DV] f32; lanes, last [B] i64; records [G, L, rec_cols, Hv, RW] f32: each column's k, delta,
// g and beta. grid (DK / RB, Hv, G B), THREADS threads.
extern "C" __global__ void __launch_bounds__(THREADS)
gdn_replay(float* __restrict__ states, const long long* __restrict__ lanes, const float* __restrict__ records,
           const long long* __restrict__ last, int nb, int nl, int hv, int rec_cols) {
    __shared__ float sk[CMAX][RB];
    __shared__ __align__(16) float sd[CMAX][DV];
    __shared__ float se[CMAX];
    const int t = threadIdx.x, cg = t % CG, r0 = t / CG;
    const int h = blockIdx.y, b = blockIdx.z % nb, g = blockIdx.z / nb;
    const int kept = (int)last[b] + 1;
    if (kept <= 0) return;  // the state as it is
    const long long lane = lanes[b];
    const int row0 = blockIdx.x * RB;
    float4* st = reinterpret_cast<float4*>(states + (((size_t)g * nl + lane) * hv + h) * (DK * DV)
                                           + (size_t)row0 * DV) + cg;
    const float* rec = records + ((size_t)g * nl + lane) * rec_cols * hv * RW + (size_t)h * RW;  // + j hv RW
    float4 x[NR];
#pragma unroll
    for (int i = 0; i < NR; ++i) x[i] = st[(size_t)(r0 + 4 * i) * CG];
    for (int e = t; e < CMAX * RB; e += THREADS) {
        const int j = e / RB, r = e % RB;
        if (j < kept) sk[j][r] = rec[(size_t)j * hv * RW + row0 + r];
    }
    for (int e = t; e < CMAX * DV; e += THREADS) {
        const int j = e / DV, c = e % DV;
        if (j < kept) sd[j][c] = rec[(size_t)j * hv * RW + DK + c];
    }
    if (t < CMAX && t < kept) se[t] = expf(rec[(size_t)t * hv * RW + DK + DV]);
    __syncthreads();
    for (int j = 0; j < kept; ++j) {
        const float e = se[j];
        const float4 d = reinterpret_cast<const float4*>(&sd[j][0])[cg];
#pragma unroll
        for (int i = 0; i < NR; ++i) {
            const float k = sk[j][r0 + 4 * i];
            x[i].x = x[i].x * e + k * d.x;
            x[i].y = x[i].y * e + k * d.y;
            x[i].z = x[i].z * e + k * d.z;
            x[i].w = x[i].w * e + k * d.w;
        }
    }
#pragma unroll
    for (int i = 0; i < NR; ++i) st[(size_t)(r0 + 4 * i) * CG] = x[i];
}
"""
