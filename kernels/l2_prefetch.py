"""Weights brought into the L2 cache ahead of the product that reads them, while the kernels before it leave the
memory bus idle.

A decode round's small kernels (a Gated DeltaNet layer's conv, recurrence and gated norm, an attention layer's
norms, RoPE and attention) move few bytes for their time, and the weight products after them wait on DRAM. A
prefetch issued as such a layer starts, on a side stream, has the next product's weight on its way into L2 while
they run: `cp.async.bulk.prefetch.L2` (sm_90 and later) asks the copy engine of each SM for a span of global memory
without taking registers or shared memory, and the kernel ends as soon as the requests are issued.

Owns: `prefetch` (the launch on torch's current stream, capturable), `supported`. Does not own: which weights are
prefetched or when (ignis.model.ops), compiling (ignis.kernels.nvrtc).
"""

from __future__ import annotations

import threading

import torch
from ignis.kernels.launch import sm_count
from ignis.kernels.nvrtc import Function, arch_of, compile_cubin

SOURCE = r"""
extern "C" __global__ void l2_prefetch(const char* base, unsigned int chunks) {
    // chunks of CHUNK bytes from base, strided over the grid's threads: one bulk request each
    for (unsigned int c = blockIdx.x * blockDim.x + threadIdx.x; c < chunks; c += gridDim.x * blockDim.x) {
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;"
                     :: "l"(base + (unsigned long long)c * CHUNK), "r"((unsigned int)CHUNK) : "memory");
    }
}
"""
CHUNK = 16 * 1024  # bytes a request asks for
THREADS = 32
# blocks per SM: each SM's bulk-copy unit takes about 0.13 TB/s of prefetch requests on the H200 (a 15.7 MB weight
# took 30 us from 4 SMs), so a prefetch spread over every SM asks faster than DRAM answers
BLOCKS_PER_SM = 1

_functions: dict[torch.device, Function] = {}
_lock = threading.Lock()


def supported(device: torch.device) -> bool:
    """Bulk L2 prefetches need a CUDA device of compute capability 9.0 or later."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def function(device: torch.device) -> Function:
    with _lock:
        fn = _functions.get(device)
        if fn is None:
            cubin = compile_cubin(SOURCE, "l2_prefetch", arch_of(device), (("CHUNK", CHUNK),))
            fn = _functions[device] = Function(cubin, "l2_prefetch", device)
    return fn


def prefetch(t: torch.Tensor, limit: int | None = None) -> None:
    """Asks for the whole CHUNK-byte chunks of t's bytes (at most its first `limit`) to be brought into L2, on
    torch's current stream. A hint: it changes no values, and what is not in L2 when it is read comes from DRAM as
    before."""
    nbytes = t.numel() * t.element_size()
    chunks = min(nbytes, nbytes if limit is None else limit) // CHUNK
    if chunks == 0:
        return
    if not t.is_contiguous():
        raise ValueError("prefetch takes a contiguous tensor")
    blocks = min(chunks, BLOCKS_PER_SM * sm_count(t.device))
    function(t.device)((blocks, 1, 1), THREADS, (t, chunks))
