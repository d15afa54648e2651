"""What a kernel that only reads reaches at the sizes of a round's products: the practical floor beside the copy one.

A product's floor is its bytes over the copy bandwidth of a 2 GiB copy; a kernel of 16-180 MB also pays its launch,
the first loads' latency and its tail. This tool times kernels that read N bytes and do nothing else, launched back
to back in a CUDA graph over enough copies that none is read from L2 (as tools.quant_products.graph_ms times the
products), at the sizes of the 27B's 4-bit and bf16 products, in two ways:

- `ld`: every thread loads 16 bytes at a time from global memory into registers (UNROLL loads in flight a thread),
  blocks of 512 threads, BLOCKS_PER_SM of them an SM, a contiguous slice each;
- `ld, N ahead of the wait` (with PDL only): the same, but each thread issues only its first N rounds of loads
  before griddepcontrol.wait, the rest after it, as a product that must wait for its input streams the rest of its
  weight only once the kernel ahead has finished (N = 0: a fully dependent read);
- `bulk`: one thread a block of threads issues bulk asynchronous copies (cp.async.bulk, completing on mbarriers)
  of CHUNK bytes into STAGES slots of shared memory, the block reads each slot as it lands and refills it: bytes in
  flight cost shared memory, not registers.

Each with and without programmatic dependent launch (the next kernel may start once this one has begun; every load
is issued before griddepcontrol.wait, the one store after it). Reported: µs a launch and x the copy floor.

    python -m tools.bench_read --out read.json
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

SOURCE = r"""
typedef unsigned int u32;
typedef unsigned long long u64;

extern "C" __global__ void read_ld(const uint4* __restrict__ src, u32* __restrict__ out, int per_block)
{
#if PDL
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    const uint4* p = src + (size_t)blockIdx.x * per_block;
    u32 acc = 0;
    int round = 0;
    for (int i = threadIdx.x; i < per_block; i += blockDim.x * UNROLL) {
#if PDL && AHEAD >= 0
        if (round++ == AHEAD) asm volatile("griddepcontrol.wait;" ::: "memory");  // the rest reads after the kernel ahead
#endif
        uint4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int j = i + u * blockDim.x;
            v[u] = make_uint4(0, 0, 0, 0);
            if (j < per_block)
                asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                             : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w) : "l"(p + j));
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
#if PDL
    asm volatile("griddepcontrol.wait;" ::: "memory");  // (again, where the loop did: no effect)
#endif
    out[blockIdx.x * blockDim.x + threadIdx.x] = acc + round;
}

__device__ __forceinline__ u32 smem(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void fetch(void* dst, const char* src, u32 bytes, u64* bar) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem(bar)), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(smem(dst)), "l"(src), "r"(bytes), "r"(smem(bar)) : "memory");
}

__device__ __forceinline__ void wait_parity(u64* bar, u32 parity) {
    u32 done = 0;
    while (!done)
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(smem(bar)), "r"(parity) : "memory");
}

extern "C" __global__ void read_bulk(const char* __restrict__ src, u32* __restrict__ out, int per_block)
{
    extern __shared__ __align__(128) uint4 slots[];  // STAGES x CHUNK bytes
    __shared__ __align__(8) u64 bar[STAGES];
    const char* p = src + (size_t)blockIdx.x * per_block;
    const int chunks = per_block / CHUNK;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem(bar + s)) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        for (int s = 0; s < STAGES && s < chunks; ++s) fetch((char*)slots + s * CHUNK, p + (size_t)s * CHUNK, CHUNK, bar + s);
    }
#if PDL
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    __syncthreads();
    u32 acc = 0;
    for (int c = 0; c < chunks; ++c) {
        const int s = c % STAGES;
        wait_parity(bar + s, (c / STAGES) & 1);
        const uint4* slot = slots + s * (CHUNK / 16);
        for (int j = threadIdx.x; j < CHUNK / 16; j += blockDim.x) {
            const uint4 v = slot[j];
            acc ^= v.x ^ v.y ^ v.z ^ v.w;
        }
        __syncthreads();  // the slot is read: it may be refilled
        if (threadIdx.x == 0 && c + STAGES < chunks) {
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            fetch((char*)slots + s * CHUNK, p + (size_t)(c + STAGES) * CHUNK, CHUNK, bar + s);
        }
    }
#if PDL
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}
"""

# the 27B decode step's products: 4-bit (codes + bf16 scales and zero points at groups of 128) and bf16 bytes
SIZES_MB = (4.2, 8.4, 11.9, 16.7, 23.7, 31.5, 47.4, 94.4, 178.3)
FLUSH = 512 * 2**20  # bytes a timed graph cycles over (the H200's L2 is 50 MB)
THREADS = 512


@dataclass(frozen=True)
class Form:
    kind: str  # "ld" or "bulk"
    blocks_per_sm: int
    unroll: int = 4  # ld: 16-byte loads in flight a thread
    stages: int = 0  # bulk: slots of shared memory a block
    chunk: int = 0  # bulk: bytes a copy
    ahead: int = -1  # ld with PDL: rounds of UNROLL loads a thread reads before it waits for the kernel ahead (-1: all)

    @property
    def name(self) -> str:
        if self.kind == "ld" and self.ahead >= 0:
            return f"ld b{self.blocks_per_sm} u{self.unroll}, {self.ahead} ahead of the wait"
        if self.kind == "ld":
            return f"ld b{self.blocks_per_sm} u{self.unroll}"
        return f"bulk b{self.blocks_per_sm} {self.stages}x{self.chunk // 1024}K"


FORMS = [Form("ld", 1, 8), Form("ld", 2, 4), Form("ld", 4, 4), Form("ld", 2, 8),
         Form("bulk", 1, stages=6, chunk=32768), Form("bulk", 1, stages=12, chunk=16384),
         Form("bulk", 2, stages=6, chunk=16384), Form("bulk", 1, stages=6, chunk=16384),
         Form("bulk", 2, stages=3, chunk=32768),
         Form("ld", 2, 4, ahead=0), Form("ld", 2, 4, ahead=1), Form("ld", 2, 4, ahead=2), Form("ld", 2, 4, ahead=4)]


@functools.cache
def _function(form: Form, pdl: bool, device: torch.device) -> Any:
    """The form's kernel, compiled and loaded once for all sizes."""
    from ignis.kernels.nvrtc import Function, arch_of, compile_cubin

    name = "read_ld" if form.kind == "ld" else "read_bulk"
    defines = (("PDL", int(pdl)), ("UNROLL", form.unroll), ("STAGES", max(1, form.stages)),
               ("CHUNK", max(16, form.chunk)), ("AHEAD", form.ahead))
    return Function(compile_cubin(SOURCE, name, arch_of(device), defines), name, device)


def time_form(form: Form, pdl: bool, nbytes: int, sms: int, device: torch.device, reps: int) -> float:
    """µs a launch reading `nbytes` (rounded down to whole slices), back to back in a CUDA graph over copies."""
    blocks = sms * form.blocks_per_sm
    unit = blocks * (form.chunk if form.kind == "bulk" else 16)
    size = nbytes // unit * unit
    if size == 0:
        return math.nan  # fewer bytes than one slice a block of threads
    copies = max(2, FLUSH // size)
    bufs = [torch.randint(0, 2**31 - 1, (size // 4,), dtype=torch.int32, device=device) for _ in range(copies)]
    out = torch.empty(blocks * THREADS, dtype=torch.int32, device=device)
    fn = _function(form, pdl, device)
    per_block = size // blocks if form.kind == "bulk" else size // blocks // 16
    shared = form.stages * form.chunk if form.kind == "bulk" else 0

    def call(buf: torch.Tensor) -> None:
        fn((blocks, 1, 1), THREADS, (buf, out, per_block), pdl, shared)

    from tools.quant_products import graph_ms

    ms = graph_ms([functools.partial(call, b) for b in bufs], reps)
    return ms * 1000 * nbytes / size  # µs for nbytes at the rate measured


def main(argv: list[str] | None = None) -> int:
    from tools.round_timing import copy_bandwidth

    ap = argparse.ArgumentParser(prog="python -m tools.bench_read", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write the results as JSON")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES_MB)), help="MB (10^6 bytes) a read, comma-separated")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_read needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    bw = copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name(device)}, {sms} SMs, copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    sizes = [float(s) for s in args.sizes.split(",")]
    rows = []
    print("| form | PDL | " + " | ".join(f"{s:g} MB" for s in sizes) + " |")
    print("|---|---|" + "---|" * len(sizes))
    for form in FORMS:
        for pdl in (False, True) if form.ahead < 0 else (True,):
            cells = []
            for mb in sizes:
                nbytes = int(mb * 1e6)
                us = time_form(form, pdl, nbytes, sms, device, args.reps)
                floor = nbytes / bw * 1e6
                rows.append({"form": asdict(form), "pdl": pdl, "mb": mb, "us": us, "floor_us": floor})
                cells.append("-" if math.isnan(us) else f"{us:.1f} ({us / floor:.2f})")
            print(f"| {form.name} | {'on' if pdl else 'off'} | " + " | ".join(cells) + " |", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"copy_bandwidth": bw, "sms": sms, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
