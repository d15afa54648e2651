"""The deterministic split-K epilogue the Triton GEMV kernels share: `store_split`.

Owns: one `triton.jit` helper. A program holding its split's fp32 partial sums of one output tile either stores the
tile (one split) or stores its partials in a workspace and bumps the tile's counter (release/acquire, GPU scope); the
last split to arrive adds every split's partials in split order, writes the output and resets the counter, all in the
one launch. The sum's order never depends on which split finishes last. Does not own: the counters (one static array
a device, ignis.kernels.launch.split_counters: products on one device run one at a time, in one stream's order) or
the kernels that call it (ignis.kernels.int4_triton, ignis.kernels.gemv_triton).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_split(
    acc,  # [BLOCK_M, BLOCK_N] fp32: this split's partial sums of the tile
    out_ptr,  # [M, N] the output, model dtype
    ws_ptr,  # [SPLIT_K, M, N] fp32 workspace (unread with one split)
    counter,  # pointer to the tile's int32 counter (unread with one split)
    offs,  # [BLOCK_M, BLOCK_N] the tile's offsets in [M, N]
    mask,  # [BLOCK_M, BLOCK_N]
    pid_k, M, N,
    SPLIT_K: tl.constexpr,
):
    if SPLIT_K == 1:
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ws_ptr + pid_k * M * N + offs, acc, mask=mask)
        # every thread's partials are issued before one thread's release: the split-K semaphore of CUTLASS
        tl.debug_barrier()
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros_like(acc)
            for k in range(SPLIT_K):  # split order, whichever came last; a loop, as unrolled loads all stay live
                total += tl.load(ws_ptr + k * M * N + offs, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(counter, 0)  # ready for the next call (the next kernel on the stream sees it)
