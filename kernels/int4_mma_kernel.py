"""The CUDA C++ source of the 4-bit product on mma.sync with the weight as the 16-row operand: `SOURCE`.

Owns: the kernel body and the register layout it reads (`ignis.kernels.int4_mma.pack` writes it). Does not own: the
packing, the launch shape, argument checks or the launch (ignis.kernels.int4_mma), nor compiling (ignis.kernels.nvrtc).

mma.m16n8k16 computes a [16, 8] block of out^T: 16 output features (the weight's rows, the A operand) by 8
activation rows (x, the B operand), over 16 input columns. Lane (g = lane / 4, t = lane % 4) holds A's features g and
g + 8 and B's activation row g. The input columns of a 64-column chunk are ordered so that one 16-byte load gives a
lane every code it needs for four mma (columns 16t .. 16t + 15 of features g and g + 8) and two 16-byte loads of x
give it the matching 16 activations of row g: mma j of the chunk adds columns 16t + 4j .. 16t + 4j + 3 of every lane,
through its slots 2t, 2t + 1 (columns 4j, 4j + 1) and 2t + 8, 2t + 9 (columns 4j + 2, 4j + 3). So the codes go from
memory to the tensor cores without shared memory, and x is read in 16-byte pieces.

The lane's four words: feature g columns 0-7, feature g + 8 columns 0-7, then both for columns 8-15 (of 16t..). In a
word, nibble p (p < 4) holds column 2p and nibble p + 4 column 2p + 1, so `(w >> 4p) & 0x000F000F` puts the pair
(2p, 2p + 1) in the low bits of two 16-bit halves, one lop3 ORs a float's exponent in (bf16 128 + q, fp16 1024 + q,
exact) and one packed fma subtracts that magic number plus the group's zero point: q - z, exact, for two codes in two
instructions (and a shift for three of every four).

A warp owns F blocks of 16 features and a contiguous run of the input's chunks: KS blocks of threads split the input
(in units of a shape's `unit` chunks), KW warps split a block's part, it walks its run U chunks a step, and RB warps
take RB x F blocks of a block of threads. RG neighbouring blocks of threads take the same features for RG groups of
NT row tiles each (the second reads the codes from L2 as the first did from DRAM). Every dequantized code meets NT
tiles of 8 activation rows, and every tile of x F blocks of codes. Each 64-column chunk's mma sums in fp32 (C starts
at zero), then that sum times the group's scale is added to the warp's fp32 total; the KW warps' totals are added in
warp order through shared memory, and the KS blocks' in block order by the last block to finish (fp32 partials in a
workspace, a counter a feature block). The order of every sum depends on the weight's shape (KS, KW, unit) only,
never on F, U, RB, RG or the rows, so a row's result is the same whatever rows share the call and whatever launch the
rows pick.

SWIGLU (a fused gate | up weight of an MLP): a warp's F blocks are F / 2 blocks of the gate half and, for each, the
block N / 2 features on in the up half, so each thread holds a gate sum and its up sum; the store rounds both as the
product's output would be, and writes silu(gate) * up as the SwiGLU kernel computes it: N / 2 outputs a row, one
launch instead of two, and the gate | up rows never leave the registers.

Compile-time macros: NT (row tiles a block), F, U, AHEAD (steps loaded ahead of the one computing), KS, KW, RB, RG
(blocks of threads a feature block's rows are split over), GPC (64-column chunks a group), F16 (1: fp16 activations,
0: bf16), SBF16 (1: the scales are bf16 bits, 0: fp16), SWIGLU (1: the output is silu(gate) * up; F even), PDL (1:
launched with programmatic dependent launch, ignis.kernels.launch.PDL: the AHEAD steps of codes and scales load before
griddepcontrol.wait, x and every store after it, and the next kernel may launch once the loop is done; 0 by default),
TRIGGER (with PDL, 1: the next kernel may launch as soon as the codes ahead are issued, before this kernel's own wait,
ignis.kernels.launch.EARLY_TRIGGER; 0: once the loop is done), RING (1: the step loop unrolled over the AHEAD + 1
slots of codes and scales, so no copies move them between slots, with each step's loads, x's among them, above a
branch that always holds but that ptxas cannot resolve, and issued only once the step's own codes have landed (ptxas
gives every load of codes one scoreboard, and a wait on it waits for all of them: loads issued before that wait
would hold it for their whole latency); 0, the default: the plain loop, whose loads ptxas moves: the
next step's codes to the loop's end, where the copies between slots wait on them, and each x load next to the mma
that reads it. The same sums either way; ignis.kernels.int4_mma.RING_LAUNCHES says which weights take it), XRING
(with RING, where a step's x fits in registers: x in the ring's slots as well, each step's loaded AHEAD steps before
its sums, with its codes; 0 by default), WINDOW (benchmarks only, 0 by default: every warp reads the codes and
scales of its feature block modulo WINDOW, so a launch at its own grid and instructions reads its codes from L2, and
its sums are not the product's; ignis.kernels.int4_mma's `window`), XPAD (1: the lanes of the rows past the call's
load row 0's x, as their addresses already say, instead of zeros; those rows' sums are never stored, so the bits are
the same, and no register is zeroed nor load predicated: four fewer instructions a chunk; 0, the default;
ignis.kernels.int4_mma.X_PAD_ROW0).
"""

# The macros' defaults, the types and the device functions the 4-bit kernels share (ignis.kernels.int4_tile_kernel
# builds its kernel on them too).
PRELUDE = r"""
#ifndef PDL
#define PDL 0
#endif
#ifndef RG
#define RG 1
#endif
#ifndef SWIGLU
#define SWIGLU 0
#endif
#ifndef TRIGGER
#define TRIGGER 0
#endif
#ifndef XPAD
#define XPAD 0
#endif
#define FO (SWIGLU ? F / 2 : F)  /* output feature blocks a warp: with SWIGLU FO gate blocks and their up partners */

typedef unsigned int u32;
typedef unsigned short u16;

#if F16
#define MAGIC 0x64006400u
#define ONE2 0x3C003C00u
#define MMA "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
#define FMA2 "fma.rn.f16x2"
#define CVT "cvt.rn.f16.f32"
#else
#define MAGIC 0x43004300u
#define ONE2 0x3F803F80u
#define MMA "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
#define FMA2 "fma.rn.bf16x2"
#define CVT "cvt.rn.bf16.f32"
#endif

#define GS (U / GPC)  /* groups a step */
#define XAHEAD (NT * U <= 8)  /* a step's x held in registers at once */

// The loads and the mma are volatile so that the compiler keeps their order: a step's loads are issued before the
// previous step's mma, not sunk to where their values are first used.
__device__ __forceinline__ uint4 load_codes(const uint4* p) {  // streamed once: no L1 line
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ uint2 load_scales(const uint2* p) {
    uint2 v;
    asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

__device__ __forceinline__ uint4 load_x(const u16* p, bool live) {  // zero for rows past the call's (XPAD: p's)
#if XPAD
    uint4 v;  // a row past the call's has row 0's address: its sums are never stored
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
#else
    uint4 v = make_uint4(0, 0, 0, 0);
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %5, 0;\n"
                 "@p ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4]; }"
                 : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w) : "l"(p), "r"((int)live));
#endif
    return v;
}

// q - z for the pairs (nibble p, nibble p + 4) of w, p = 0..3; nz = -(magic + z) in both halves
__device__ __forceinline__ void dequant(u32 w, u32 nz, u32 h[4]) {
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        u32 m;
        asm("lop3.b32 %0, %1, 0x000F000F, %2, 0xEA;" : "=r"(m) : "r"(w >> (4 * p)), "n"(MAGIC));
        asm(FMA2 " %0, %1, %2, %3;" : "=r"(h[p]) : "r"(m), "r"(ONE2), "r"(nz));
    }
}

// a lane's 16 activations of one chunk (two 16-byte pieces) for each of its NT rows n * 8 + g
__device__ __forceinline__ void load_xs(uint4 xs[NT][2], const u16* p, int sx, int g, int M) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        const int row = n * 8 + g;
        const u16* q = p + (size_t)(row < M ? row : 0) * sx;
        xs[n][0] = load_x(q, row < M);
        xs[n][1] = load_x(q + 8, row < M);
    }
}

__device__ __forceinline__ void mma(float c[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(MMA " {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float scale_of(u32 bits) {  // the low 16 bits: the scale in its own dtype
#if SBF16
    return __uint_as_float(bits << 16);
#else
    float f;
    asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.f32.f16 %0, lo; }" : "=f"(f) : "r"(bits));
    return f;
#endif
}

__device__ __forceinline__ u16 rounded(float v) {
    u16 h;
    asm(CVT " %0, %1;" : "=h"(h) : "f"(v));
    return h;
}

__device__ __forceinline__ float widened(u16 h) {  // the 16-bit value as a float, exactly
#if F16
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    return __uint_as_float((u32)h << 16);
#endif
}

// silu(gate) * up from the fp32 sums as the unfused chain computes it: the product rounds gate and up to the 16-bit
// dtype, SwiGLU takes silu of the gate in fp32 rounded, times up, rounded (ignis.kernels.swiglu_triton)
__device__ __forceinline__ u16 swiglu_of(float gate, float up) {
    const float g = widened(rounded(gate)), u = widened(rounded(up));
    return rounded(widened(rounded(g / (1.f + __expf(-g)))) * u);
}


// a lane's four sums of one row tile and feature block (rows row and row + 1, features feature and feature + 8) into
// out [M, No]: each rounded to the 16-bit dtype, or with SWIGLU silu(gate) * up from the gate sums `v` and their up
// partners' `up`; rows from M on are not stored
__device__ __forceinline__ void store_quad(u16* out, int No, int M, int row, int feature, const float v[4],
                                           const float up[4]) {
#if SWIGLU
#define OUT(i) swiglu_of(v[i], up[i])
#else
#define OUT(i) rounded(v[i])
#endif
    if (row < M) {
        out[(size_t)row * No + feature] = OUT(0);
        out[(size_t)row * No + feature + 8] = OUT(2);
    }
    if (row + 1 < M) {
        out[(size_t)(row + 1) * No + feature] = OUT(1);
        out[(size_t)(row + 1) * No + feature + 8] = OUT(3);
    }
#undef OUT
}

// a split's meeting (the split-K semaphore of CUTLASS): once every thread's stores before it are visible, the block
// of threads counts itself in at cnt[blockIdx.x]; true for the last of `parts` to arrive, which then sees the others'
__device__ __forceinline__ bool last_to_arrive(int* cnt, int parts) {
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(cnt + blockIdx.x, 1) == parts - 1;
    __syncthreads();
    if (!last) return false;
    __threadfence();
    return true;
}
"""

SOURCE = PRELUDE + r"""
#ifndef RING
#define RING 0
#endif
#ifndef XRING
#define XRING 0
#endif
#ifndef WINDOW
#define WINDOW 0
#endif
#if XRING && !(RING && XAHEAD)
#error "XRING holds a step's x in the ring's slots: RING, and NT * U <= 8"
#endif
// A step's pieces as macros, so that both loops of the kernel (RING and the plain one) compile from the same tokens.
// The codes and scales of step s + AHEAD (the last steps reload the last: no read past the weight) into slot SLOT
#define LOAD_STEP(SLOT, AFTER) \
        const int d = min(s + AHEAD, s1 - 1) - s + (AFTER); \
        _Pragma("unroll") \
        for (int f = 0; f < F; ++f) { \
            _Pragma("unroll") \
            for (int u = 0; u < U; ++u) wq[SLOT][f][u] = load_codes(wp[f] + (d * U + u) * 32); \
            _Pragma("unroll") \
            for (int q = 0; q < GS; ++q) zq[SLOT][f][q] = load_scales(zp[f] + (d * GS + q) * 8); \
        }
// x: the step's activations before any of its mma when they fit in registers, else a chunk's at a time (STEP_SUMS)
#define LOAD_X \
        uint4 xs[XAHEAD ? U : 1][NT][2]; \
        if (XAHEAD) { \
            _Pragma("unroll") \
            for (int u = 0; u < U; ++u) load_xs(xs[XAHEAD ? u : 0], xp + u * 64, sx, g, M); \
        }
// XRING: the x of the step D steps on into the ring's slot SLOT
#define LOAD_STEP_X(SLOT, D) \
        _Pragma("unroll") \
        for (int u = 0; u < U; ++u) load_xs(xr[SLOT][u], xp + ((D) * U + u) * 64, sx, g, M);
// 0, from a word of codes and the launch's unit (> 0): what ptxas cannot fold, so what waits for the word's load
__device__ __forceinline__ int landed(u32 word, int unit) {
    return (word == 0x5EED5EEDu) & (unit < 0);
}
// the warp's pointers to the next step
#define NEXT_STEP \
        _Pragma("unroll") \
        for (int f = 0; f < F; ++f) { \
            wp[f] += U * 32; \
            zp[f] += GS * 8; \
        } \
        xp += U * 64;
// one step's sums: U chunks of the warp's F feature blocks, codes W[f][u] and scales Z[f][group], against the NT
// row tiles of x (X[u], or loaded a chunk at a time into X[0] from xp where a step's x does not fit in registers);
// each chunk's 64 columns summed on the tensor cores (A: the codes as q - z, exact; B: x), then scaled into acc by
// the group's scale
#define STEP_SUMS(W, Z, X) \
        _Pragma("unroll") \
        for (int u = 0; u < U; ++u) { \
            if (!XAHEAD) load_xs(X[0], xp + u * 64, sx, g, M); \
            _Pragma("unroll") \
            for (int f = 0; f < F; ++f) { \
                const uint4 w = W[f][u]; \
                const uint2 z = Z[f][u / GPC]; \
                const u32 nz0 = __byte_perm(z.x, 0, 0x3232), nz1 = __byte_perm(z.y, 0, 0x3232); \
                const float sg = scale_of(z.x), sg8 = scale_of(z.y); \
                u32 h0[4], h1[4], h2[4], h3[4]; \
                dequant(w.x, nz0, h0);  /* feature g, columns 0-7 */ \
                dequant(w.y, nz1, h1);  /* feature g + 8, columns 0-7 */ \
                dequant(w.z, nz0, h2);  /* feature g, columns 8-15 */ \
                dequant(w.w, nz1, h3);  /* feature g + 8, columns 8-15 */ \
                _Pragma("unroll") \
                for (int n = 0; n < NT; ++n) { \
                    const uint4 xa = X[XAHEAD ? u : 0][n][0], xb = X[XAHEAD ? u : 0][n][1]; \
                    float part[4] = {0.f, 0.f, 0.f, 0.f}; \
                    mma(part, h0[0], h1[0], h0[1], h1[1], xa.x, xa.y); \
                    mma(part, h0[2], h1[2], h0[3], h1[3], xa.z, xa.w); \
                    mma(part, h2[0], h3[0], h2[1], h3[1], xb.x, xb.y); \
                    mma(part, h2[2], h3[2], h2[3], h3[3], xb.z, xb.w); \
                    acc[f][n][0] += part[0] * sg; \
                    acc[f][n][1] += part[1] * sg; \
                    acc[f][n][2] += part[2] * sg8; \
                    acc[f][n][3] += part[3] * sg8; \
                } \
            } \
        }

// codes [N/16, K/64, 32] uint4 (ignis.kernels.int4_mma.pack); zs [N/16, K/group, 8] uint2: for lane group g, feature
// g then g + 8, each (scale bits | -(magic + z) << 16); x [M, sx-strided rows of K] 16-bit; out [M, N] 16-bit, or
// with SWIGLU [M, N/2]: silu(features 0..N/2-1) * features N/2..N-1
extern "C" __global__ void __launch_bounds__(32 * RB * KW)
int4_mma(const uint4* __restrict__ codes, const uint2* __restrict__ zs, const u16* __restrict__ x,
         u16* __restrict__ out, float* __restrict__ ws, int* __restrict__ cnt, int M, int N, int K, int sx, int unit)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int kw = warp % KW, r = warp / KW;
    const int blocks = N >> 4, chunks = K >> 6, groups = chunks / GPC, units = chunks / unit;
    const int half = SWIGLU ? blocks / 2 : blocks, No = half * 16;  // the output's feature blocks and width
    const int rb0 = (blockIdx.x / RG * RB + r) * FO;  // the warp's first output feature block; it owns FO of them
    // the weight's feature block of the warp's f-th: output block rb0 + f % FO (the warp's first where that is past
    // the output: its results are not stored) and, with SWIGLU, for f >= FO that block's up partner
#define BLOCK_OF(f) ((rb0 + (f) % FO < half ? rb0 + (f) % FO : rb0) + (f) / FO * half)
    // the block's rows: row0 .. row0 + 8 NT - 1 of the call's M; x and out are moved to row0, M counts from it
    const int row0 = blockIdx.x % RG * NT * 8;
    if (row0 >= M) return;  // the whole block: no rows of the call here
    x += (size_t)row0 * sx;
    out += (size_t)row0 * No;
    M -= row0;
    // the KW warps split the input in units of `unit` chunks (a multiple of U fixed by the weight's shape, so the
    // split, and with it the order of the sums, does not depend on U); s0, s1 count steps of U chunks
    // the KS blocks of threads along y split the input first, then their KW warps split their part
    const int ua = blockIdx.y * units / KS, ub = (blockIdx.y + 1) * units / KS;
    const int s0 = (ua + kw * (ub - ua) / KW) * (unit / U), s1 = (ua + (kw + 1) * (ub - ua) / KW) * (unit / U);
    float acc[F][NT][4];
#pragma unroll
    for (int f = 0; f < F; ++f)
#pragma unroll
        for (int n = 0; n < NT; ++n) acc[f][n][0] = acc[f][n][1] = acc[f][n][2] = acc[f][n][3] = 0.f;

    if (rb0 < half && s0 < s1) {
        const uint4* wp[F];
        const uint2* zp[F];
#pragma unroll
        for (int f = 0; f < F; ++f) {
            const int rb = WINDOW ? BLOCK_OF(f) % WINDOW : BLOCK_OF(f);  // the block whose codes it reads
            wp[f] = codes + ((size_t)rb * chunks + (size_t)s0 * U) * 32 + lane;
            zp[f] = zs + ((size_t)rb * groups + (size_t)s0 * GS) * 8 + g;
        }
        const u16* xp = x + (size_t)s0 * U * 64 + t * 16;
        // AHEAD + 1 steps of codes and scales in registers: step s + AHEAD is loaded while step s computes
        uint4 wq[AHEAD + 1][F][U];
        uint2 zq[AHEAD + 1][F][GS];
#pragma unroll
        for (int a = 0; a < AHEAD; ++a) {
            const int d = min(s0 + a, s1 - 1) - s0;
#pragma unroll
            for (int f = 0; f < F; ++f) {
#pragma unroll
                for (int u = 0; u < U; ++u) wq[a][f][u] = load_codes(wp[f] + (d * U + u) * 32);
#pragma unroll
                for (int q = 0; q < GS; ++q) zq[a][f][q] = load_scales(zp[f] + (d * GS + q) * 8);
            }
        }
#if PDL
#if TRIGGER
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // the next kernel may launch and load now
#endif
        // the weight is not the previous kernel's output: it loaded above while that kernel finished; x is, so wait
        asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#if RING
        // the loop unrolled over the ring's AHEAD + 1 slots (step s's codes in slot (s - s0) % (AHEAD + 1), so no
        // copies between slots), and the step's compute behind a branch on `unit > 0`, which always holds but which
        // ptxas cannot resolve: the loads of the step AHEAD on and the step's x stay above it, issued before the
        // step's first mma, where ptxas otherwise moves the codes to the loop's end (RING above). Their addresses
        // take a 0 computed from the step's own first word of codes (`landed`), so they issue after the wait for
        // it: ptxas waits on one scoreboard for every load of codes, so a load issued ahead of that wait would
        // hold the step for a whole latency, where issued after it, it has a step's compute to land in
        int s = s0;
#if XRING
        // x in the ring too: step s + AHEAD's x loads with its codes (the first AHEAD steps' here, after the wait)
        uint4 xr[AHEAD + 1][U][NT][2];
#pragma unroll
        for (int a = 0; a < AHEAD; ++a) {
            LOAD_STEP_X(a, min(s0 + a, s1 - 1) - s0)
        }
#endif
        for (;;) {
#pragma unroll
            for (int i = 0; i < AHEAD + 1; ++i) {
                if (s >= s1) goto ring_done;
                LOAD_STEP((i + AHEAD) % (AHEAD + 1), landed(wq[i][0][0].x, unit))  // into the slot step s - 1 freed
#if XRING
                LOAD_STEP_X((i + AHEAD) % (AHEAD + 1), d)  // with its codes (LOAD_STEP's d)
                if (unit > 0) {
                    STEP_SUMS(wq[i], zq[i], xr[i])
                }
#else
                LOAD_X
                if (unit > 0) {
                    STEP_SUMS(wq[i], zq[i], xs)
                }
#endif
                NEXT_STEP
                ++s;
            }
        }
ring_done:;
#else
        for (int s = s0; s < s1; ++s) {
            LOAD_STEP(AHEAD, 0)
            LOAD_X
            STEP_SUMS(wq[0], zq[0], xs)
#pragma unroll
            for (int a = 0; a < AHEAD; ++a)
#pragma unroll
                for (int f = 0; f < F; ++f) {
#pragma unroll
                    for (int u = 0; u < U; ++u) wq[a][f][u] = wq[a + 1][f][u];
#pragma unroll
                    for (int q = 0; q < GS; ++q) zq[a][f][q] = zq[a + 1][f][q];
                }
            NEXT_STEP
        }
#endif
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
    // acc[f][n][i] is out[row n * 8 + 2t + (i & 1)][feature (rb0 + f) * 16 + g + 8 (i >> 1)]
#if KS > 1
    // every block of threads stores its fp32 partials; the last of a feature block's KS to arrive adds them in
    // split order (whichever came last) and resets the counter for the next call: the split-K semaphore of CUTLASS
    const int Mall = M + row0;  // the call's rows: the workspace's
    if (kw == 0) {
#pragma unroll
        for (int f = 0; f < F; ++f)
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int row = n * 8 + 2 * t + (i & 1), feature = BLOCK_OF(f) * 16 + g + 8 * (i >> 1);
                    if (rb0 + f % FO < half && row < M)
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
                    if (rb0 + f % FO < half && row < M) {
                        float total = 0.f;
                        for (int k = 0; k < KS; ++k)
                            total += __ldcg(ws + ((size_t)k * Mall + row0 + row) * N + feature);
                        acc[f][n][i] = total;
                    }
                }
    }
    if (threadIdx.x == 0) cnt[blockIdx.x] = 0;
#endif
    if (kw > 0) return;
#pragma unroll
    for (int f = 0; f < FO; ++f) {
        if (rb0 + f >= half) return;
        const int feature = (rb0 + f) * 16 + g;
#pragma unroll
        for (int n = 0; n < NT; ++n) store_quad(out, No, M, n * 8 + 2 * t, feature, acc[f][n], acc[SWIGLU ? f + FO : f][n]);
    }
}
"""
