"""Reading the first bytes of a weight into the GPU's L2 cache ahead of the product that reads it: `prefetch`.

Owns: a CUDA C++ kernel (NVRTC) that asks the memory system for a byte range and returns without waiting for it, its
launch on torch's current stream (capturable) and its launch shape (`Form`). Does not own: which weight, how many bytes
or when (ignis.model.prefetch, which forks it onto a side stream beside the small kernels between two products).

Why: a decode round's products read their weights at the memory's bandwidth, but between two of them the memory idles
while the round's small kernels run (norms, the conv and recurrence, attention: about 1.3 ms of a 27B decode's 14.3 ms).
The first bytes of the next weight, asked for at the start of such a window, are in L2 when its product starts, so
that product reads them from L2 instead of memory.

Two forms: `bulk`, one `cp.async.bulk.prefetch.L2` a thread for a chunk of `chunk` bytes (Hopper's bulk copy engine
fetches it); `lines`, one `prefetch.global.L2::evict_last` a thread for each 128-byte line of its chunk. Neither
writes memory or waits, so the kernel ends as soon as its requests are issued.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from ignis.kernels.launch import nvrtc_installed

SOURCE = r"""
extern "C" __global__ void l2_prefetch(const char* base, int bytes, int chunk) {
    const int n = (bytes + chunk - 1) / chunk;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const char* a = base + (long long)i * chunk;
        const int size = min(chunk, bytes - i * chunk);
#if BULK
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(a), "r"(size) : "memory");
#else
        for (int off = 0; off < size; off += 128) {
            asm volatile("prefetch.global.L2::evict_last [%0];" :: "l"(a + off));
        }
#endif
    }
}
"""


@dataclass(frozen=True)
class Form:
    """A launch shape: blocks of `threads` threads, each thread asking for `chunk` bytes at a time."""

    bulk: bool = True  # cp.async.bulk.prefetch.L2 (sm_90) rather than a prefetch a line
    blocks: int = 32
    threads: int = 32
    chunk: int = 32768  # bytes, a multiple of 128


FORM = Form()  # the shape `prefetch` launches unless told another (the benchmarks sweep them)

_lock = threading.Lock()
_functions: dict[tuple[bool, torch.device], object] = {}


def fits(weight: torch.Tensor) -> bool:
    """Whether `prefetch` takes the weight: a CUDA tensor of at least 16-byte alignment on an sm_90 or later GPU with
    NVRTC installed."""
    return (weight.is_cuda and weight.data_ptr() % 16 == 0 and nvrtc_installed()
            and torch.cuda.get_device_capability(weight.device)[0] >= 9)


def defines(bulk: bool) -> tuple[tuple[str, int], ...]:
    return (("BULK", int(bulk)),)


def _function(bulk: bool, device: torch.device) -> object:
    from ignis.kernels.nvrtc import Function, arch_of, compile_cubin

    key = (bulk, device)
    with _lock:
        if key not in _functions:
            _functions[key] = Function(compile_cubin(SOURCE, "l2_prefetch", arch_of(device), defines(bulk)),
                                       "l2_prefetch", device)
        return _functions[key]


def prefetch(weight: torch.Tensor, nbytes: int, form: Form | None = None) -> None:
    """Ask for the first `nbytes` bytes of `weight`'s storage (at most all of it, rounded down to 16 bytes) to be read
    into L2, on torch's current stream; the weight's values are not touched."""
    form = form or FORM
    if not fits(weight):
        raise ValueError(f"l2_prefetch.prefetch takes a 16-byte aligned CUDA tensor on sm_90 or later; got "
                         f"{weight.device} at {weight.data_ptr():#x}")
    if form.chunk % 128 or form.chunk <= 0:
        raise ValueError(f"l2_prefetch: chunk must be a positive multiple of 128 bytes; got {form.chunk}")
    size = min(nbytes, weight.numel() * weight.element_size(), 2**31 - 1) // 16 * 16
    if size <= 0:
        return
    kernel = _function(form.bulk, weight.device)
    kernel((form.blocks, 1, 1), form.threads, (weight, size, form.chunk))  # type: ignore[operator]
