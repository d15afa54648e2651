"""How many sequences the drafter trains on at once: what is left of the accelerator's memory after the target.

Owns: measuring one probe step's peak memory and turning it into a micro-batch, and the decision to keep every tap
feature in memory or compute them a batch at a time. Does not own: the step itself (ignis.train.loop).

On CUDA the target stays loaded (inference only, no gradients) and the drafter's micro-batch takes what remains: a
probe forward + backward over `probe` of the longest sequences gives the bytes one sequence needs; the optimizer's
two moments per parameter are set aside first. A full batch is then split into micro-batches whose gradients add up,
so the recipe (sequences per step) does not depend on the device. On the CPU the whole batch runs at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

HEADROOM = 0.85  # share of the free memory a micro-batch may plan to use: the allocator fragments the rest
# Keep every tap in memory only when they take at most this share of what is free. On the accelerator the drafter's
# micro-batch is sized afterwards from what the cache leaves (fit_micro_batch), so the cache may take most of it; host
# memory is shared with the rest of the machine.
TAP_CACHE_SHARE = {"cuda": 0.7, "cpu": 0.5}


def micro_batch_for(free: int, fixed: int, per_sequence: int, requested: int) -> int:
    """Sequences per micro-batch: what fits in HEADROOM * free - fixed bytes, at most `requested`, at least 1."""
    room = HEADROOM * free - fixed
    if per_sequence <= 0:
        return requested
    return max(1, min(requested, int(room // per_sequence)))


def fit_micro_batch(probe_step: Callable[[int], None], requested: int, optimizer_bytes: int,
                    device: torch.device, probe: int = 2) -> int:
    """Run `probe_step(n)` (forward + backward on n of the longest sequences, no optimizer step) and size the
    micro-batch from its peak; on the CPU, `requested`."""
    if device.type != "cuda":
        return requested
    n = min(probe, requested)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    probe_step(n)
    torch.cuda.synchronize(device)
    per_sequence = (torch.cuda.max_memory_allocated(device) - before) // n
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    return micro_batch_for(free, optimizer_bytes, per_sequence, requested)


def tap_cache_fits(nbytes: int, device: torch.device) -> bool:
    """Whether `nbytes` of tap features may live in `device` memory for the whole run."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        import os

        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return nbytes <= TAP_CACHE_SHARE["cuda" if device.type == "cuda" else "cpu"] * free
