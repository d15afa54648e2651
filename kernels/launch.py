"""Launching a numba-cuda kernel on torch tensors, on torch's current stream; whether the Triton kernels can run.

Owns: `launch`, which every numba kernel module of ignis.kernels uses: bf16 tensors go in as int16 views (torch
exports no bf16 to numba; the kernels widen the bits), and the launch goes to the stream torch is on, read at every
call, so a CUDA graph being captured records it. `triton_installed` and `nvrtc_installed`, which the paths that
prefer a Triton or a CUDA C++ kernel (attention, the int4 product) ask. `split_counters` and `sm_count`, which the
int4 kernels that meet their input splits through counters share. `PDL`, `pdl` and `dependent_launches`: the switch
of programmatic dependent launch for the kernels that take it, and the round's choice of it. Importing this module
imports neither numba, triton nor CUDA.
"""

from __future__ import annotations

import functools
import importlib.util
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def launch(kernel: Any, grid: tuple[int, ...], threads: int, args: tuple[Any, ...], device: torch.device) -> None:
    from numba import cuda

    handle = torch.cuda.current_stream(device).cuda_stream
    stream = 0 if handle == 0 else cuda.external_stream(handle)
    arrays = tuple(
        cuda.as_cuda_array(a.view(torch.int16) if a.dtype == torch.bfloat16 else a) if isinstance(a, torch.Tensor)
        else a
        for a in args
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # numba warns about grids under 128 blocks: one lane's work is our normal case
        kernel[grid, threads, stream](*arrays)


@functools.cache
def triton_installed() -> bool:
    """Triton is importable (found, not imported: importing it is left to the first kernel call)."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def nvrtc_installed() -> bool:
    """cuda-python's bindings are importable (found, not imported), with which ignis.kernels.nvrtc compiles CUDA C++
    kernels at run time."""
    try:
        return importlib.util.find_spec("cuda.bindings") is not None
    except ModuleNotFoundError:  # no `cuda` namespace at all
        return False


# Programmatic dependent launch (Hopper and later): the kernels that support it (the Triton ones of
# ignis.kernels.gemv_triton, norm_triton and swiglu_triton, and the 4-bit product of int4_mma) launch so that they may
# start before the kernel ahead of them on the stream has finished, and wait for it (griddepcontrol.wait) before they
# read what it wrote; the weight-streaming products load their first weight tiles before that wait. A kernel launched
# so always waits before it ends, so the order of every kernel's writes on the stream is kept.
# PDL None (the default): the round decides (`dependent_launches`), on for rounds of at most PACKED_PDL_ROWS rows over
# a 4-bit target, where the product loads its codes before the wait: the 27B-shape decode step 6.73 -> 6.47 ms and
# the 1 x 8 verify 7.73 -> 7.33 on the H200, while an 8 x 8 verify lost 2.6% (30.66 against 29.88 ms) and no bf16
# round moved past the runs' spread (BENCHMARKS.md, "PDL for 4-bit rounds"). True or False: every launch, or none
# (tools.bench_round --pdl, tools.bench_quant --pdl).
PDL: bool | None = None
PACKED_PDL_ROWS = 8
# Whether the Gated DeltaNet's CUDA C++ kernels (the conv and the recurrence) launch programmatic-dependent, loading
# the conv's window and taps, and the recurrence's state, while the kernel ahead finishes (the conv then takes its
# CUDA C++ kernel at every row count, since the numba one launches only plainly): None (the default) where `pdl` says
# kernels do; True or False in every round (tools.bench_round --gdn-pdl). On the H200, the 27B-shape decode step with
# 4-bit weights and the output head packed: 6.09 ms without, 5.93 with, 5.76 with the recurrence applying the gated
# norm as well (gdn.CUDA_NORMED, which follows this switch; BENCHMARKS.md).
GDN_PDL: bool | None = None
# Where a kernel launched programmatic-dependent that streams a weight (the products of int4_mma and gemv_triton, and
# the residual norm before them) lets the next kernel launch: True (the default), as soon as it has issued the loads
# it makes before its own wait, so the next kernel's blocks may start, and load what does not depend on this one,
# while it streams; False, once its loop is done. Correct either way: the next kernel still waits for this one to
# finish before it reads its output. On the H200, the 27B's 4-bit products back to back with PDL at one row: gate_up
# 1.21 -> 1.18 of its floor, down 1.53 -> 1.49, attention qkv 1.30 -> 1.26, in_proj and o_proj unchanged; the 4-bit
# decode step unchanged within its runs' spread (BENCHMARKS.md, "Reads back to back").
EARLY_TRIGGER = True
_round_pdl = False  # what the round running or being captured asked for (`dependent_launches`)


def _early(on: bool, device: torch.device) -> bool:
    """`on`, on a CUDA device of compute capability 9.0 or later (never the CPU's Triton interpreter)."""
    return on and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def gdn_pdl(device: torch.device) -> bool:
    """Whether the Gated DeltaNet's CUDA C++ kernels on `device` launch programmatic-dependent: as `pdl` says where
    GDN_PDL is None, else GDN_PDL on a device that can."""
    return pdl(device) if GDN_PDL is None else _early(GDN_PDL, device)


def pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch with programmatic dependent launch: PDL on (or None and the round asks for
    it), a CUDA device of compute capability 9.0 or later (never the CPU's Triton interpreter)."""
    return _early(_round_pdl if PDL is None else PDL, device)


@contextmanager
def dependent_launches(on: bool) -> Iterator[None]:
    """Launches inside the block use programmatic dependent launch when `on` and PDL is None (the round's choice);
    set while a round runs or is captured, so its graph keeps the launches' form."""
    global _round_pdl
    before, _round_pdl = _round_pdl, on
    try:
        yield
    finally:
        _round_pdl = before


SPLIT_COUNTERS = 1 << 14  # counters a device holds for kernels whose input splits meet through them
PLANNING_SMS = 132  # an H200's SMs: what a launch plan assumes off a GPU (the CPU's Triton interpreter)

_lock = threading.Lock()
_counters: dict[torch.device, torch.Tensor] = {}
_sms: dict[torch.device, int] = {}


def split_counters(device: torch.device) -> torch.Tensor:
    """The device's split counters [SPLIT_COUNTERS] int32, zero between calls: a kernel's last split to arrive at a
    counter resets it, and products on one device run one at a time (one stream's order), so every kernel that meets
    its splits this way shares them. Allocated once: captured graphs keep the address."""
    with _lock:
        if device not in _counters:
            _counters[device] = torch.zeros(SPLIT_COUNTERS, dtype=torch.int32, device=device)
        return _counters[device]


def sm_count(device: torch.device) -> int:
    """The device's streaming multiprocessors (PLANNING_SMS off a GPU)."""
    if device.type != "cuda":
        return PLANNING_SMS
    with _lock:
        if device not in _sms:
            _sms[device] = torch.cuda.get_device_properties(device).multi_processor_count
        return _sms[device]
