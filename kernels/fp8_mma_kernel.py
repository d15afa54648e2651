"""The CUDA C++ source of the FP8 product on mma.sync with the weight as the 16-row operand: `SOURCE`.

Owns: the kernel body and how it reads the weight. Does not own: the launch shape, argument checks or the launch
(ignis.kernels.fp8_mma), the format (ignis.quant.fp8), nor compiling (ignis.kernels.nvrtc).

The weight is read as it is stored: e4m3 codes [N, K], one row of K bytes an output feature, and a float32 scale a
feature. mma.m16n8k16 computes a [16, 8] block of out^T as in the 4-bit kernel (ignis.kernels.int4_mma_kernel):
lane (g = lane / 4, t = lane % 4) holds A's features g and g + 8 and B's activation row g. Of a 64-column chunk,
the lane takes columns 16t .. 16t + 15: one 16-byte load of feature g's row and one of feature g + 8's (a warp's load
reads 64 contiguous bytes of each of 8 rows), and the same two 16-byte pieces of x as the 4-bit kernel. mma j of the
chunk adds the lane's columns 4j .. 4j + 3 through its slots 2t, 2t + 1 (columns 4j, 4j + 1) and 2t + 8, 2t + 9
(columns 4j + 2, 4j + 3), the order the 4-bit kernel gives its codes, so x's registers feed both kernels alike.

A 32-bit word of codes (columns 4j .. 4j + 3 of one feature) becomes two registers of 16-bit pairs: each byte pair
through cvt.rn.f16x2.e4m3x2, exact (every e4m3 value is an fp16 normal or zero); for bf16 activations each fp16
then widens to fp32 and the pair rounds to bf16x2, exact too (three bits of mantissa at most). The tensor cores add
a feature's products into its fp32 total directly (no group scale between chunks); the feature's scale multiplies
the total once, after the warps' and blocks' partial sums have met, and the result is rounded once.

The split of the input, the warps' and blocks' partial sums, the row tiles and the SwiGLU store are the 4-bit
kernel's (its PRELUDE, and its macros NT, F, U, AHEAD, KS, KW, RB, RG, F16, PDL, TRIGGER; SWIGLU is left 0), so a
row's sums are ordered by the weight's shape alone, never by the rows that share the call.
"""

from ignis.kernels.int4_mma_kernel import PRELUDE

SOURCE = PRELUDE + r"""
// a word of four codes (columns 4j .. 4j + 3) -> the pairs (4j, 4j + 1) and (4j + 2, 4j + 3) of the activation
// dtype, exactly
__device__ __forceinline__ void widen(u32 w, u32& lo, u32& hi) {
#if F16
    asm("{ .reg .b16 p, q;\n"
        "mov.b32 {p, q}, %2;\n"
        "cvt.rn.f16x2.e4m3x2 %0, p;\n"
        "cvt.rn.f16x2.e4m3x2 %1, q; }" : "=r"(lo), "=r"(hi) : "r"(w));
#else
    asm("{ .reg .b16 p, q, a, b, c, d; .reg .b32 f, h; .reg .f32 fa, fb, fc, fd;\n"
        "mov.b32 {p, q}, %2;\n"
        "cvt.rn.f16x2.e4m3x2 f, p;\n"
        "cvt.rn.f16x2.e4m3x2 h, q;\n"
        "mov.b32 {a, b}, f;\n"
        "mov.b32 {c, d}, h;\n"
        "cvt.f32.f16 fa, a;\n"
        "cvt.f32.f16 fb, b;\n"
        "cvt.f32.f16 fc, c;\n"
        "cvt.f32.f16 fd, d;\n"
        "cvt.rn.bf16x2.f32 %0, fb, fa;\n"
        "cvt.rn.bf16x2.f32 %1, fd, fc; }" : "=r"(lo), "=r"(hi) : "r"(w));
#endif
}

// w [N, K] e4m3 codes, rows of K bytes; scale [N] fp32; x [M, sx-strided rows of K] 16-bit; out [M, N] 16-bit
extern "C" __global__ void __launch_bounds__(32 * RB * KW)
fp8_mma(const unsigned char* __restrict__ w, const float* __restrict__ scale, const u16* __restrict__ x,
        u16* __restrict__ out, float* __restrict__ ws, int* __restrict__ cnt, int M, int N, int K, int sx, int unit)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int kw = warp % KW, r = warp / KW;
    const int blocks = N >> 4, chunks = K >> 6, units = chunks / unit;
    const int rb0 = (blockIdx.x / RG * RB + r) * F;  // the warp's first feature block; it owns F of them
    // the warp's f-th feature block, or its first where that is past the weight (its results are not stored)
#define BLOCK_OF(f) (rb0 + (f) < blocks ? rb0 + (f) : rb0)
    const int row0 = blockIdx.x % RG * NT * 8;
    if (row0 >= M) return;
    x += (size_t)row0 * sx;
    out += (size_t)row0 * N;
    M -= row0;
    const int ua = blockIdx.y * units / KS, ub = (blockIdx.y + 1) * units / KS;
    const int s0 = (ua + kw * (ub - ua) / KW) * (unit / U), s1 = (ua + (kw + 1) * (ub - ua) / KW) * (unit / U);
    float acc[F][NT][4];
#pragma unroll
    for (int f = 0; f < F; ++f)
#pragma unroll
        for (int n = 0; n < NT; ++n) acc[f][n][0] = acc[f][n][1] = acc[f][n][2] = acc[f][n][3] = 0.f;

    if (rb0 < blocks && s0 < s1) {
        // feature g's row of each block at the run's first chunk, the lane's 16 bytes; feature g + 8's is R8 on
        const size_t R8 = (size_t)K / 2;  // 8 rows of K bytes, in 16-byte units
        const uint4* wp[F];
#pragma unroll
        for (int f = 0; f < F; ++f)
            wp[f] = reinterpret_cast<const uint4*>(w + ((size_t)BLOCK_OF(f) * 16 + g) * K + (size_t)s0 * U * 64) + t;
        const u16* xp = x + (size_t)s0 * U * 64 + t * 16;
        // AHEAD + 1 steps of codes in registers: step s + AHEAD is loaded while step s computes
        uint4 wq[AHEAD + 1][F][U][2];
#pragma unroll
        for (int a = 0; a < AHEAD; ++a) {
            const int d = min(s0 + a, s1 - 1) - s0;
#pragma unroll
            for (int f = 0; f < F; ++f)
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    wq[a][f][u][0] = load_codes(wp[f] + (d * U + u) * 4);
                    wq[a][f][u][1] = load_codes(wp[f] + R8 + (d * U + u) * 4);
                }
        }
#if PDL
#if TRIGGER
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
        asm volatile("griddepcontrol.wait;" ::: "memory");  // x is the previous kernel's output; the weight is not
#endif
        for (int s = s0; s < s1; ++s) {
            const int d = min(s + AHEAD, s1 - 1) - s;  // the last steps reload the last: no read past the weight
#pragma unroll
            for (int f = 0; f < F; ++f)
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    wq[AHEAD][f][u][0] = load_codes(wp[f] + (d * U + u) * 4);
                    wq[AHEAD][f][u][1] = load_codes(wp[f] + R8 + (d * U + u) * 4);
                }
            uint4 xs[XAHEAD ? U : 1][NT][2];
            if (XAHEAD) {
#pragma unroll
                for (int u = 0; u < U; ++u) load_xs(xs[XAHEAD ? u : 0], xp + u * 64, sx, g, M);
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (!XAHEAD) load_xs(xs[0], xp + u * 64, sx, g, M);
#pragma unroll
                for (int f = 0; f < F; ++f) {
                    const uint4 a = wq[0][f][u][0], b = wq[0][f][u][1];  // features g and g + 8
                    u32 alo[4], ahi[4], blo[4], bhi[4];
                    widen(a.x, alo[0], ahi[0]);
                    widen(a.y, alo[1], ahi[1]);
                    widen(a.z, alo[2], ahi[2]);
                    widen(a.w, alo[3], ahi[3]);
                    widen(b.x, blo[0], bhi[0]);
                    widen(b.y, blo[1], bhi[1]);
                    widen(b.z, blo[2], bhi[2]);
                    widen(b.w, blo[3], bhi[3]);
#pragma unroll
                    for (int n = 0; n < NT; ++n) {
                        const uint4 xa = xs[XAHEAD ? u : 0][n][0], xb = xs[XAHEAD ? u : 0][n][1];
                        mma(acc[f][n], alo[0], blo[0], ahi[0], bhi[0], xa.x, xa.y);
                        mma(acc[f][n], alo[1], blo[1], ahi[1], bhi[1], xa.z, xa.w);
                        mma(acc[f][n], alo[2], blo[2], ahi[2], bhi[2], xb.x, xb.y);
                        mma(acc[f][n], alo[3], blo[3], ahi[3], bhi[3], xb.z, xb.w);
                    }
                }
            }
#pragma unroll
            for (int a = 0; a < AHEAD; ++a)
#pragma unroll
                for (int f = 0; f < F; ++f)
#pragma unroll
                    for (int u = 0; u < U; ++u) {
                        wq[a][f][u][0] = wq[a + 1][f][u][0];
                        wq[a][f][u][1] = wq[a + 1][f][u][1];
                    }
#pragma unroll
            for (int f = 0; f < F; ++f) wp[f] += U * 4;
            xp += U * 64;
        }
    }
#if PDL
    asm volatile("griddepcontrol.wait;" ::: "memory");  // for warps without a run above; no stores before it
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif

#if KW > 1
    __shared__ float red[(KW - 1) * RB * F * NT * 4 * 32];
    if (kw > 0) {
#pragma unroll
        for (int f = 0; f < F; ++f)
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    red[(((((kw - 1) * RB + r) * F + f) * NT + n) * 4 + i) * 32 + lane] = acc[f][n][i];
    }
    __syncthreads();
    if (kw == 0) {
        for (int k = 1; k < KW; ++k) {  // warp order, whichever finished first
#pragma unroll
            for (int f = 0; f < F; ++f)
#pragma unroll
                for (int n = 0; n < NT; ++n)
#pragma unroll
                    for (int i = 0; i < 4; ++i)
                        acc[f][n][i] += red[(((((k - 1) * RB + r) * F + f) * NT + n) * 4 + i) * 32 + lane];
        }
    }
#endif
    // acc[f][n][i] is out[row n * 8 + 2t + (i & 1)][feature BLOCK_OF(f) * 16 + g + 8 (i >> 1)], unscaled
#if KS > 1
    const int Mall = M + row0;  // the call's rows: the workspace's
    if (kw == 0) {
#pragma unroll
        for (int f = 0; f < F; ++f)
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int row = n * 8 + 2 * t + (i & 1), feature = BLOCK_OF(f) * 16 + g + 8 * (i >> 1);
                    if (rb0 + f < blocks && row < M)
                        ws[((size_t)blockIdx.y * Mall + row0 + row) * N + feature] = acc[f][n][i];
                }
    }
    if (!last_to_arrive(cnt, KS)) return;
    if (kw == 0) {
#pragma unroll
        for (int f = 0; f < F; ++f)
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int row = n * 8 + 2 * t + (i & 1), feature = BLOCK_OF(f) * 16 + g + 8 * (i >> 1);
                    if (rb0 + f < blocks && row < M) {
                        float total = 0.f;
                        for (int k = 0; k < KS; ++k)
                            total += __ldcg(ws + ((size_t)k * Mall + row0 + row) * N + feature);
                        acc[f][n][i] = total;
                    }
                }
    }
    if (threadIdx.x == 0) cnt[blockIdx.x] = 0;
#endif
    if (kw > 0 || rb0 >= blocks) return;
#pragma unroll
    for (int f = 0; f < F; ++f) {  // each feature's scale times its total, once
        const float sg = __ldg(scale + BLOCK_OF(f) * 16 + g), sg8 = __ldg(scale + BLOCK_OF(f) * 16 + g + 8);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            acc[f][n][0] *= sg;
            acc[f][n][1] *= sg;
            acc[f][n][2] *= sg8;
            acc[f][n][3] *= sg8;
        }
    }
#pragma unroll
    for (int f = 0; f < F; ++f) {
        if (rb0 + f >= blocks) return;
        const int feature = (rb0 + f) * 16 + g;
#pragma unroll
        for (int n = 0; n < NT; ++n) store_quad(out, N, M, n * 8 + 2 * t, feature, acc[f][n], acc[f][n]);
    }
}
"""
