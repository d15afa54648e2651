"""The CUDA C++ source of the warp-filtered top-k over wide rows (compiled by ignis.kernels.nvrtc, launched from
ignis.kernels.topk_cuda).

Owns: `SOURCE` and its compile-time sizes (BF16: elements are bf16 bits, else float32; UNROLL: elements a lane loads
and sorts before the warp merges them, a power of two). Does not own: the launch, its checks or the split of a row
(ignis.kernels.topk_cuda).

Every element becomes one 64-bit key: its value's bits made order-preserving in the high word (-0.0 as +0.0, every
NaN above +inf) and the column complemented in the low word, so one signed comparison is ignis.kernels.topk's whole
order and no two keys of a row are equal. A warp keeps a list of its 32 largest keys, lane i the i-th. Each lane
loads and sorts UNROLL keys; the warp then offers them rank by rank (every lane's r-th largest: a bitonic sort across
the lanes, then a half-cleaner merge into the list), stopping at the first rank where no lane's key beats the list's
last. A row's 32 largest seldom put more than a few in one lane, so a few sorts and merges (about 21 dependent
shuffle stages each) take each load of UNROLL x 32 columns.
- `topk_chunks`: block (chunk, row), 8 warps: each warp filters its share of the chunk, warp 0 then merges the
  other warps' lists into its own and stores the chunk's 32 best keys, sorted.
- `topk_merge`: block (row): the 8 warps merge the row's chunks' sorted lists the same way, warp 0 merges theirs
  and stores the k best: their columns and the input's own elements there (values bit for bit).
"""

from __future__ import annotations

SOURCE = r"""
#define FULL 0xffffffffu
#define WARPS 8
#define LOWEST ((long long)0x8000000000000000ULL)

#if BF16
typedef unsigned short elem;
__device__ __forceinline__ float widen(elem h) { return __uint_as_float(((unsigned)h) << 16); }
#else
typedef float elem;
__device__ __forceinline__ float widen(elem h) { return h; }
#endif

__device__ __forceinline__ long long make_key(float v, int col) {
    int o = (v == 0.0f) ? 0 : __float_as_int(v);  // -0.0 ties +0.0
    o ^= (o >> 31) & 0x7fffffff;                  // negative floats: the magnitude's order reversed
    if (v != v) o = 0x7fffffff;                   // every NaN above +inf
    return ((long long)o << 32) | (long long)(0x7fffffff - col);
}

// The warp's 32 keys sorted across its lanes, largest at lane 0 (a bitonic network of shuffles).
__device__ __forceinline__ long long sort32(long long v, int lane) {
#pragma unroll
    for (int k = 2; k <= 32; k <<= 1)
#pragma unroll
        for (int j = k >> 1; j > 0; j >>= 1) {
            long long o = __shfl_xor_sync(FULL, v, j);
            bool keep_max = ((lane & j) == 0) == ((lane & k) == 0);
            v = keep_max ? max(v, o) : min(v, o);
        }
    return v;
}

// The 32 largest of two lists sorted largest first: the larger of each key and its mirror in the other list form a
// bitonic sequence holding them, which a half-cleaner network sorts.
__device__ __forceinline__ long long merge32(long long a, long long b, int lane) {
    long long v = max(a, __shfl_sync(FULL, b, 31 - lane));
#pragma unroll
    for (int j = 16; j > 0; j >>= 1) {
        long long o = __shfl_xor_sync(FULL, v, j);
        v = (lane & j) == 0 ? max(v, o) : min(v, o);
    }
    return v;
}

// A lane's UNROLL keys sorted in its registers, largest first (a bitonic network over compile-time indices).
__device__ __forceinline__ void sort_lane(long long (&key)[UNROLL]) {
#pragma unroll
    for (int k = 2; k <= UNROLL; k <<= 1)
#pragma unroll
        for (int j = k >> 1; j > 0; j >>= 1)
#pragma unroll
            for (int i = 0; i < UNROLL; ++i) {
                const int l = i ^ j;
                if (l > i) {
                    const long long a = key[i], b = key[l];
                    const bool down = (i & k) == 0;
                    key[i] = down ? max(a, b) : min(a, b);
                    key[l] = down ? min(a, b) : max(a, b);
                }
            }
}

// The warp's keys, each lane's sorted, join its list rank by rank: every lane's r-th largest at once, until no lane's
// beats the list's last (the 32nd largest so far). A lane's later ranks are smaller still, so nothing is missed,
// and a row's 32 largest seldom put more than a few in one lane: a few ranks, not all UNROLL, are merged.
__device__ __forceinline__ void offer(long long (&key)[UNROLL], long long &list, long long &last, int lane) {
    sort_lane(key);
#pragma unroll
    for (int r = 0; r < UNROLL; ++r) {
        if (!__any_sync(FULL, key[r] > last)) break;
        list = merge32(list, sort32(key[r], lane), lane);
        last = __shfl_sync(FULL, list, 31);
    }
}

// Warp 0's list becomes the block's: the other warps' sorted lists (in shared memory) merged into it.
__device__ __forceinline__ void gather_lists(long long (*lists)[32], long long &list, int lane, int warp) {
    lists[warp][lane] = list;
    __syncthreads();
    if (warp == 0)
        for (int w = 1; w < WARPS; ++w) list = merge32(list, lists[w][lane], lane);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32) topk_chunks(
    const elem *__restrict__ x, long long *__restrict__ keys, int ncols, int stride, int chunk) {
    __shared__ long long lists[WARPS][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row = blockIdx.y, s = blockIdx.x, nchunks = gridDim.x;
    const elem *xr = x + (long long)row * stride;
    int begin = s * chunk, end = min(ncols, begin + chunk);
    int share = (chunk + WARPS - 1) / WARPS;
    int wb = begin + warp * share, we = min(end, wb + share);
    long long list = LOWEST, last = LOWEST;
    for (int base = wb; base < we; base += 32 * UNROLL) {
        long long key[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            int col = base + u * 32 + lane;
            key[u] = col < we ? make_key(widen(xr[col]), col) : LOWEST;
        }
        offer(key, list, last, lane);
    }
    gather_lists(lists, list, lane, warp);
    if (warp == 0) keys[((long long)row * nchunks + s) * 32 + lane] = list;
}

extern "C" __global__ void __launch_bounds__(WARPS * 32) topk_merge(
    const long long *__restrict__ keys, const elem *__restrict__ x, elem *__restrict__ values,
    long long *__restrict__ ids, int nkeys, int stride, int k) {
    __shared__ long long lists[WARPS][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row = blockIdx.x;
    const long long *kr = keys + (long long)row * nkeys;
    long long list = LOWEST, last = LOWEST;
    for (int base = warp * 32; base < nkeys; base += WARPS * 32) {  // each chunk's 32 keys, sorted
        long long key = kr[base + lane];
        if (__any_sync(FULL, key > last)) {
            list = merge32(list, key, lane);
            last = __shfl_sync(FULL, list, 31);
        }
    }
    gather_lists(lists, list, lane, warp);
    if (warp == 0 && lane < k) {
        long long col = 0x7fffffff - (list & 0x7fffffffLL);
        ids[(long long)row * k + lane] = col;
        values[(long long)row * k + lane] = x[(long long)row * stride + col];
    }
}
"""
