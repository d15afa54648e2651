"""The CUDA C++ source of the 4-bit product for 17 to 64 rows: `SOURCE`, the int4_mma kernel's arithmetic with x
staged once a block of threads in shared memory.

Owns: the kernel body. Does not own: the layout of the codes (ignis.kernels.int4_mma, whose kernel source's prelude
this one shares: the loads, the dequantization, the mma and the stores' rounding), the launch (ignis.kernels.int4_tile)
or compiling (ignis.kernels.nvrtc).

Why a second kernel: int4_mma's warps each load their own x for every 16 features' 512 bytes of codes, 8 KB a chunk
at 64 rows, so at 33-64 rows x's traffic through L1 and L2 and its registers (with the 64 sums a thread holds), not
the codes, bound it: 5-12x its bytes' time on the H200. Here a block of RB x RS warps takes one part of the input
split for RB x F 16-feature blocks, and its threads copy each 64-column chunk of x for all rows, with the chunk's
codes and scales, into shared memory once (cp.async, a ring of STAGES chunks in flight without holding registers, one
barrier a chunk); every warp then reads its fragments from there (x's rows padded to 144 bytes: the 16-byte reads of
a quarter warp fall in distinct banks) for F blocks of codes at a time.

A row's sums are int4_mma's, bit for bit, whatever rows share the call: the input split is choose's (KS x KW parts, a
part a run of whole units of chunks), every chunk's four mma and its scaled fused multiply-add into the part's total
are the same instructions on the same operands in the same order, and the parts meet as int4_mma's do: a KS part's KW
totals added in warp order, then the KS parts in order from 0.f where KS > 1. Here every part is its own block of
threads, so the parts' fp32 totals meet in a workspace [KS x KW, M, N], added by the last block of a feature tile to
arrive (a counter a tile, reset by that block).

Compile-time macros: NT (row tiles of 8, as many as the call's rows need), F (16-feature blocks a warp), RB (a
block's feature groups), RS (warps a group's row tiles are split over: more warps an SM, fewer sums a thread, each
dequantizing the group's codes itself), STAGES (chunks in the ring), MINB (blocks an SM, for the register budget),
KS, KW, GPC, F16, SBF16, SWIGLU and PDL as int4_mma's (PDL: the first chunks' codes load before griddepcontrol.wait,
x and every store after it).
"""

from ignis.kernels.int4_mma_kernel import PRELUDE

SOURCE = PRELUDE + r"""
#ifndef MINB
#define MINB 1  /* blocks an SM the registers must allow (1: ptxas's own choice spills at NT 8) */
#endif
#define XROW 72  /* u16 a staged row of x: its 64 columns and 16 bytes of padding */
#define PARTS (KS * KW)
#ifndef RS
#define RS 1  /* warps a feature group's row tiles are split over */
#endif
#define NTW (NT / RS)  /* row tiles a warp: NT a multiple of RS */
#define THREADS (32 * RB * RS)
#define WF (RB * F)  /* 16-feature blocks a block of threads reads: warp r's f-th is r * F + f */
#define X_BYTES (NT * 8 * XROW * 2)  /* a stage's x */
#define C_BYTES (WF * 512)  /* its codes: a feature block's chunk is 32 lanes x 16 bytes */
#define Z_BYTES (WF * 64)  /* its scales and zero points: 8 lane groups x 8 bytes a feature block */
#define STAGE_BYTES (X_BYTES + C_BYTES + Z_BYTES)
#define XP ((NT * 64 + THREADS - 1) / THREADS)  /* 16-byte pieces a thread copies a chunk: of x */
#define CP ((WF * 32 + THREADS - 1) / THREADS)  /* of codes */
#define ZP ((WF * 4 + THREADS - 1) / THREADS)  /* of scales */

// int4_mma's mma without `volatile`: the same instruction on the same operands, which the compiler may now interleave
// with the other row tiles' and blocks' (each sum's own chain of four stays in order: it is its data dependence)
__device__ __forceinline__ void mma_free(float c[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm(MMA " {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void copy16(unsigned dst, const void* src, unsigned bytes) {  // zeros past `bytes`
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void commit_stage() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// The weight's feature block that the block of threads' index wf = r * F + f stands for (warp r's f-th: BLOCK_OF(f)
// of that warp's rb0), and in `live` whether the warp's output block for it is within the output (else nothing is
// copied for it, and block 0 stands in)
__device__ __forceinline__ int block_at(int wf, int half, bool& live) {
    const int r = wf / F, f = wf % F;
    const int rb0 = (blockIdx.x * RB + r) * FO, out = rb0 + f % FO, rb = out + f / FO * half;
    live = out < half;
    return live ? rb : 0;
}

// The 16-byte pieces of a chunk a thread copies into a stage, piece i = threadIdx.x + k * THREADS of each kind: the
// same rows, lanes and feature blocks every chunk, so their addresses are worked out once (chunk 0's, stage 0's)
struct Stager {
    const u16* xsrc[XP];
    const uint4* csrc[CP];
    const uint2* zsrc[ZP];
    unsigned xdst[XP], cdst[CP], zdst[ZP];
    unsigned xlive, xon, con, zon;  // bit k: piece k is a row of the call (else zeros) / is copied at all
};

__device__ __forceinline__ Stager stager_of(const uint4* codes, const uint2* zs, const u16* x, unsigned base, int sx,
                                            int M, int half, int chunks, int groups) {
    Stager p;
    p.xlive = p.xon = p.con = p.zon = 0;
#pragma unroll
    for (int k = 0; k < XP; ++k) {
        const int i = threadIdx.x + k * THREADS, row = i >> 3, piece = i & 7;
        p.xsrc[k] = x + (size_t)(row < M ? row : 0) * sx + piece * 8;
        p.xdst[k] = base + (row * XROW + piece * 8) * 2;
        p.xlive |= (unsigned)(i < NT * 64 && row < M) << k;
        p.xon |= (unsigned)(i < NT * 64) << k;
    }
#pragma unroll
    for (int k = 0; k < CP; ++k) {  // 32 pieces a feature block: its lanes' 16 bytes
        const int i = threadIdx.x + k * THREADS;
        bool live;
        const int rb = block_at(i >> 5, half, live);
        p.csrc[k] = codes + ((size_t)rb * chunks) * 32 + (i & 31);
        p.cdst[k] = base + X_BYTES + i * 16;
        p.con |= (unsigned)(i < WF * 32 && live) << k;
    }
#pragma unroll
    for (int k = 0; k < ZP; ++k) {  // 4 pieces a feature block: its 8 lane groups' scales, 2 a piece
        const int i = threadIdx.x + k * THREADS;
        bool live;
        const int rb = block_at(i >> 2, half, live);
        p.zsrc[k] = zs + (size_t)rb * groups * 8 + (i & 3) * 2;
        p.zdst[k] = base + X_BYTES + C_BYTES + i * 16;
        p.zon |= (unsigned)(i < WF * 4 && live) << k;
    }
    return p;
}

// chunk c's codes and scales for the block's feature blocks into stage s (not committed)
__device__ __forceinline__ void stage_weights(const Stager& p, int c, int s) {
#pragma unroll
    for (int k = 0; k < CP; ++k)
        if (p.con >> k & 1) copy16(p.cdst[k] + s * STAGE_BYTES, p.csrc[k] + (size_t)c * 32, 16);
#pragma unroll
    for (int k = 0; k < ZP; ++k)
        if (p.zon >> k & 1) copy16(p.zdst[k] + s * STAGE_BYTES, p.zsrc[k] + (size_t)(c / GPC) * 8, 16);
}

// chunk c's 64 columns of x for the NT * 8 rows into stage s (rows from M on are zeros), not committed
__device__ __forceinline__ void stage_x(const Stager& p, int c, int s) {
#pragma unroll
    for (int k = 0; k < XP; ++k)
        if (p.xon >> k & 1) copy16(p.xdst[k] + s * STAGE_BYTES, p.xsrc[k] + c * 64, (p.xlive >> k & 1) * 16);
}

#if PARTS > 1
// a row's sum at a feature from the parts' totals in ws [PARTS, M, N], in int4_mma's order: a KS part's KW totals in
// warp order, then the KS parts from 0.f (one part alone is its own total)
__device__ __forceinline__ float total_of(const float* ws, int row, int feature, int M, int N) {
    const float* p = ws + (size_t)row * N + feature;
    const size_t stride = (size_t)M * N;
    float total = 0.f;
#pragma unroll
    for (int k = 0; k < KS; ++k) {
        float s = __ldcg(p + (size_t)(k * KW) * stride);
#pragma unroll
        for (int w = 1; w < KW; ++w) s += __ldcg(p + (size_t)(k * KW + w) * stride);
        total = KS > 1 ? total + s : s;
    }
    return total;
}
#endif

// codes [N/16, K/64, 32] uint4 and zs [N/16, K/group, 8] uint2 as int4_mma's; x [M, sx-strided rows of K]; out [M, N]
// (with SWIGLU [M, N/2]); ws [PARTS, M, N] fp32 and cnt [gridDim.x] int32 (zero between calls) where PARTS > 1;
// STAGES x STAGE_BYTES of dynamic shared memory
extern "C" __global__ void __launch_bounds__(THREADS, MINB)
int4_tile(const uint4* __restrict__ codes, const uint2* __restrict__ zs, const u16* __restrict__ x,
          u16* __restrict__ out, float* __restrict__ ws, int* __restrict__ cnt, int M, int N, int K, int sx, int unit)
{
    extern __shared__ __align__(16) unsigned char smem[];
    const int lane = threadIdx.x & 31, r = (threadIdx.x >> 5) / RS, rp = (threadIdx.x >> 5) % RS;  // group, rows
    const int g = lane >> 2, t = lane & 3;
    const int blocks = N >> 4, chunks = K >> 6, groups = chunks / GPC, units = chunks / unit;
    const int half = SWIGLU ? blocks / 2 : blocks, No = half * 16;
    const int rb0 = (blockIdx.x * RB + r) * FO;  // the warp's first output feature block; it owns FO of them
    const bool owns = rb0 < half;  // a warp past the output still stages its share and meets the barriers
    // the part: choose's split, KS parts of the units, each split over KW; chunks c0 .. c1 - 1 (never empty)
    const int part = blockIdx.y, ks = part / KW, kw = part % KW;
    const int ua = ks * units / KS, ub = (ks + 1) * units / KS;
    const int c0 = (ua + kw * (ub - ua) / KW) * unit, c1 = (ua + (kw + 1) * (ub - ua) / KW) * unit;
    float acc[F][NTW][4];  // the warp's row tiles rp NTW .. (rp + 1) NTW - 1
#pragma unroll
    for (int f = 0; f < F; ++f)
#pragma unroll
        for (int n = 0; n < NTW; ++n) acc[f][n][0] = acc[f][n][1] = acc[f][n][2] = acc[f][n][3] = 0.f;

    const Stager st = stager_of(codes, zs, x, (unsigned)__cvta_generic_to_shared(smem), sx, M, half, chunks, groups);
    // the first STAGES - 1 chunks, a commit group each (with PDL the codes of all of them go before the wait, in the
    // first group: waiting for a chunk's group still finds its codes landed)
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s)
        if (c0 + s < c1) stage_weights(st, c0 + s, s);
#if PDL
    asm volatile("griddepcontrol.wait;" ::: "memory");  // x is the kernel ahead's output
#endif
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (c0 + s < c1) stage_x(st, c0 + s, s);
        commit_stage();  // empty past the part: the count of groups stays one a chunk
    }
    int computing = 0, filling = STAGES - 1;  // the stage chunk c is in, and the one chunk c + STAGES - 1 goes to
    for (int c = c0; c < c1; ++c) {
        asm volatile("cp.async.wait_group %0;" :: "n"(STAGES - 2) : "memory");  // chunk c's stage has landed
        __syncthreads();  // for every thread's copies, and every warp is done with the stage refilled next
        if (c + STAGES - 1 < c1) {
            stage_weights(st, c + STAGES - 1, filling);
            stage_x(st, c + STAGES - 1, filling);
        }
        commit_stage();
        if (owns) {
            const unsigned char* stage = smem + computing * STAGE_BYTES;
            const uint4* cs = reinterpret_cast<const uint4*>(stage + X_BYTES) + r * F * 32 + lane;
            const uint2* zsm = reinterpret_cast<const uint2*>(stage + X_BYTES + C_BYTES) + r * F * 8 + g;
            u32 h[F][16];  // per block: feature g columns 0-7, g + 8 0-7, g 8-15, g + 8 8-15 (of 16t ..)
            float sg[F], sg8[F];
#pragma unroll
            for (int f = 0; f < F; ++f) {
                const uint4 w = cs[f * 32];
                const uint2 z = zsm[f * 8];
                const u32 nz0 = __byte_perm(z.x, 0, 0x3232), nz1 = __byte_perm(z.y, 0, 0x3232);
                sg[f] = scale_of(z.x);
                sg8[f] = scale_of(z.y);
                dequant(w.x, nz0, h[f]);
                dequant(w.y, nz1, h[f] + 4);
                dequant(w.z, nz0, h[f] + 8);
                dequant(w.w, nz1, h[f] + 12);
            }
            const u16* xr = reinterpret_cast<const u16*>(stage) + (rp * NTW * 8 + g) * XROW + t * 16;
#pragma unroll
            for (int n = 0; n < NTW; ++n) {  // NT covers the call's rows: no tile is all padding
                const uint4 xa = *reinterpret_cast<const uint4*>(xr + n * 8 * XROW);
                const uint4 xb = *reinterpret_cast<const uint4*>(xr + n * 8 * XROW + 8);
#pragma unroll
                for (int f = 0; f < F; ++f) {
                    const u32* q = h[f];
                    float p[4] = {0.f, 0.f, 0.f, 0.f};
                    mma_free(p, q[0], q[4], q[1], q[5], xa.x, xa.y);
                    mma_free(p, q[2], q[6], q[3], q[7], xa.z, xa.w);
                    mma_free(p, q[8], q[12], q[9], q[13], xb.x, xb.y);
                    mma_free(p, q[10], q[14], q[11], q[15], xb.z, xb.w);
                    acc[f][n][0] += p[0] * sg[f];
                    acc[f][n][1] += p[1] * sg[f];
                    acc[f][n][2] += p[2] * sg8[f];
                    acc[f][n][3] += p[3] * sg8[f];
                }
            }
        }
        computing = computing + 1 == STAGES ? 0 : computing + 1;
        filling = filling + 1 == STAGES ? 0 : filling + 1;
    }
#define BLOCK_OF(f) ((rb0 + (f) % FO < half ? rb0 + (f) % FO : rb0) + (f) / FO * half)
    asm volatile("cp.async.wait_group 0;" ::: "memory");
#if PDL
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    // acc[f][n][i] is out[row (rp NTW + n) * 8 + 2t + (i & 1)][feature BLOCK_OF(f) * 16 + g + 8 (i >> 1)]
#if PARTS > 1
    if (owns) {
#pragma unroll
        for (int f = 0; f < F; ++f)
#pragma unroll
            for (int n = 0; n < NTW; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int row = (rp * NTW + n) * 8 + 2 * t + (i & 1), feature = BLOCK_OF(f) * 16 + g + 8 * (i >> 1);
                    if (rb0 + f % FO < half && row < M) ws[((size_t)part * M + row) * N + feature] = acc[f][n][i];
                }
    }
    if (!last_to_arrive(cnt, PARTS)) return;
    // the tile's outputs, a thread each in turn (consecutive threads, consecutive features): features f0 .. f0 + fw - 1
    const int f0 = blockIdx.x * RB * FO * 16, fw = min(RB * FO * 16, No - f0);
#pragma unroll 4
    for (int e = threadIdx.x; e < M * fw; e += THREADS) {  // unrolled: several elements' loads in flight
        const int row = e / fw, feature = f0 + e % fw;
#if SWIGLU
        out[(size_t)row * No + feature] = swiglu_of(total_of(ws, row, feature, M, N),
                                                    total_of(ws, row, feature + half * 16, M, N));
#else
        out[(size_t)row * No + feature] = rounded(total_of(ws, row, feature, M, N));
#endif
    }
    if (threadIdx.x == 0) cnt[blockIdx.x] = 0;
    return;
#else
    if (!owns) return;
#pragma unroll
    for (int f = 0; f < FO; ++f) {
        if (rb0 + f >= half) return;
        const int feature = (rb0 + f) * 16 + g;
#pragma unroll
        for (int n = 0; n < NTW; ++n)
            store_quad(out, No, M, (rp * NTW + n) * 8 + 2 * t, feature, acc[f][n], acc[SWIGLU ? f + FO : f][n]);
    }
#endif
}
"""
