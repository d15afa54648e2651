"""CUDA C++ kernels compiled at run time with NVRTC and launched on torch's current stream, through cuda-python's
bindings (cuda.bindings, which numba-cuda already brings).

Owns: `compile_cubin` (source + macros -> a cubin for one architecture, and ptxas's report; runs without a GPU, so
the CPU tests compile every kernel for sm_90), `Function` (a kernel loaded on a device, launched with torch
tensors and ints on the stream torch is on, read at every call, so a CUDA graph being captured records it) and `load`
(a kernel variant compiled and loaded once a process and device). Does not
own: kernel sources, argument checks or launch shapes (the kernel's own module).

Importing this module imports neither cuda.bindings nor CUDA. A kernel variant is compiled on its first use (a few
hundred milliseconds) and loaded once per device, which must therefore happen before a CUDA graph captures it: the
engine's warm-up runs every shape first.
"""

from __future__ import annotations

import ctypes
import re
import threading
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch


class CompileError(RuntimeError):
    """NVRTC refused a kernel source: the message carries its log."""


@dataclass(frozen=True)
class Cubin:
    image: bytes  # the cubin NVRTC built
    registers: int  # per thread, from ptxas
    spills: int  # bytes of spill stores and loads, from ptxas
    stack: int = 0  # bytes of stack frame (local arrays among them), from ptxas


def _check(result: Any, what: str) -> None:
    code = result[0] if isinstance(result, tuple) else result
    if int(code) != 0:
        raise CompileError(f"{what} failed: {code!r}")


@lru_cache(maxsize=256)
def compile_cubin(source: str, name: str, arch: str, defines: tuple[tuple[str, int], ...]) -> Cubin:
    """`source` compiled by NVRTC for `arch` (e.g. "sm_90") with each (macro, value) of `defines`. Cached in the
    process by its arguments."""
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], [])
    _check(err, "nvrtcCreateProgram")
    options = [f"--gpu-architecture={arch}", "--std=c++17", "-Xptxas=-v"]
    options += [f"-D{macro}={value}" for macro, value in defines]
    compiled = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])
    _, size = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, log)
    text = log.decode(errors="replace").rstrip("\x00")
    if int(compiled[0]) != 0:
        raise CompileError(f"NVRTC could not compile {name} for {arch} with {dict(defines)}:\n{text}")
    _, size = nvrtc.nvrtcGetCUBINSize(prog)
    image = b" " * size
    _check(nvrtc.nvrtcGetCUBIN(prog, image), "nvrtcGetCUBIN")
    nvrtc.nvrtcDestroyProgram(prog)
    registers = max((int(n) for n in re.findall(r"Used (\d+) registers", text)), default=0)
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill", text))
    stack = max((int(n) for n in re.findall(r"(\d+) bytes stack frame", text)), default=0)
    return Cubin(image, registers, spills, stack)


def arch_of(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


_lock = threading.Lock()


class Function:
    """A kernel of a cubin, loaded in `device`'s primary context (torch's)."""

    def __init__(self, cubin: Cubin, name: str, device: torch.device) -> None:
        from cuda.bindings import driver

        self._driver = driver
        with _lock, torch.cuda.device(device):
            torch.cuda.init()
            _check(driver.cuInit(0), "cuInit")
            index = device.index if device.index is not None else torch.cuda.current_device()
            err, ctx = driver.cuDevicePrimaryCtxRetain(index)
            _check(err, "cuDevicePrimaryCtxRetain")
            _check(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")  # this thread may not have touched CUDA yet
            err, self._module = driver.cuModuleLoadData(cubin.image)
            _check(err, "cuModuleLoadData")
            err, self._function = driver.cuModuleGetFunction(self._module, name.encode())
            _check(err, f"cuModuleGetFunction({name})")
        self.device = device
        self._raised = 0  # the function's dynamic shared memory limit as last raised (0: the default)

    def __call__(self, grid: tuple[int, int, int], threads: int, args: tuple[torch.Tensor | int | float, ...],
                 pdl: bool = False, shared: int = 0) -> None:
        """Launches on torch's current stream of the device: tensors go in as their data pointers, ints as int32,
        floats as float32. pdl: with programmatic dependent launch (the kernel may start before the one ahead of it on
        the stream has finished, and must execute griddepcontrol.wait before it reads that kernel's output). shared:
        bytes of dynamic shared memory a block of threads (the function's limit raised to it on its first use)."""
        driver = self._driver
        if shared > self._raised:  # static and dynamic shared memory past 48 KiB together need the limit raised
            attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _check(driver.cuFuncSetAttribute(self._function, attribute, shared), "cuFuncSetAttribute")
            self._raised = shared
        values = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
        types = tuple(ctypes.c_void_p if isinstance(a, torch.Tensor) else ctypes.c_float if isinstance(a, float)
                      else ctypes.c_int for a in args)
        stream = driver.CUstream(torch.cuda.current_stream(self.device).cuda_stream)
        if not pdl:
            _check(driver.cuLaunchKernel(self._function, *grid, threads, 1, 1, shared, stream, (values, types), 0),
                   "cuLaunchKernel")
            return
        config = driver.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = grid
        config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
        config.sharedMemBytes = shared
        config.hStream = stream
        early = driver.CUlaunchAttribute()
        early.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        early.value.programmaticStreamSerializationAllowed = 1
        config.attrs = [early]
        config.numAttrs = 1
        _check(driver.cuLaunchKernelEx(config, self._function, (values, types), 0), "cuLaunchKernelEx")


_loaded_lock = threading.Lock()  # apart from _lock, which Function takes while it loads
_loaded: dict[tuple[str, str, tuple[tuple[str, int], ...], torch.device], Function] = {}


def load(source: str, name: str, defines: tuple[tuple[str, int], ...], device: torch.device) -> Function:
    """Kernel `name` of `source` compiled with `defines` for `device`'s architecture and loaded on it: once a process
    for each of them."""
    key = (source, name, defines, device)
    with _loaded_lock:
        if key not in _loaded:
            _loaded[key] = Function(compile_cubin(source, name, arch_of(device), defines), name, device)
        return _loaded[key]
