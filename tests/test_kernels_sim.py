"""The top-k kernel's own source, run in numba's CUDA simulator on small rows, against the reference.

The simulator has no warp intrinsics, so a shim adds ballot/shuffle through a per-warp barrier; it is valid for the
full-mask, warp-uniform calls this kernel makes. NUMBA_ENABLE_CUDASIM must be set before numba.cuda is imported,
so the cases run in two child interpreters side by side (tests/simulator.py) and the rest of the suite keeps the
real numba.cuda. Blocks of 64 threads (2 warps) keep the simulator fast; the warp fold, the cross-block merge and the
counter reset are the same code as with 256.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np
import pytest
import simulator
import torch

BLOCK = 64

# name: (dtype, rows, ncols, k, blocks per row, data)
CASES: dict[str, tuple[str, int, int, int, int, str]] = {
    "fp32_split": ("float32", 2, 300, 5, 2, "normal"),
    "bf16_odd_ties": ("bfloat16", 1, 301, 7, 2, "ties"),
    "fp32_k40_two_lists": ("float32", 1, 120, 40, 2, "ties"),
    "fp32_special_one_block": ("float32", 2, 150, 9, 1, "special"),
}


def _data(kind: str, rows: int, ncols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return torch.randn(rows, ncols, generator=g).to(dtype)
    if kind == "ties":
        return torch.randint(0, 4, (rows, ncols), generator=g).to(dtype)
    x = torch.randn(rows, ncols, generator=g)
    x[0, ::7] = 0.0
    x[0, 3::7] = -0.0
    x[0, 5] = float("nan")
    x[0, 40] = -float("nan")
    x[0, 11] = float("inf")
    x[0, 12] = -float("inf")
    x[1] = -float("inf")  # masked row: fewer finite values than k
    x[1, 100:104] = torch.tensor([1.0, -2.0, 1.0, 3.0])
    return x.to(dtype)


def _install_warp_shim() -> None:
    """Warp intrinsics for the simulator's FakeCUDAModule, and a lock around its lazy shared-array creation."""
    from numba.cuda.simulator import kernelapi

    lock = threading.Lock()

    class Warp:
        def __init__(self) -> None:
            self.barrier = threading.Barrier(32, timeout=120)
            self.slots: list[list[object]] = [[None] * 32, [None] * 32]

    def exchange(mod: object, value: object) -> tuple[list[object], int]:
        # Two slot sets used alternately: a lane cannot write set p again before every lane has passed the next
        # barrier, by which time every lane has read set p. So one barrier per intrinsic suffices.
        t = threading.current_thread()
        tid = t.thread_id  # type: ignore[attr-defined]
        with lock:
            warps = mod.__dict__.setdefault("_warps", {})
            warp = warps.get(tid // 32) or warps.setdefault(tid // 32, Warp())
        parity = getattr(t, "_parity", 0)
        t._parity = parity ^ 1  # type: ignore[attr-defined]
        warp.slots[parity][tid % 32] = value
        warp.barrier.wait()
        return warp.slots[parity], tid % 32

    def ballot_sync(self: object, mask: int, pred: object) -> int:
        vals, _ = exchange(self, bool(pred))
        return sum(1 << i for i, v in enumerate(vals) if v)

    def shfl_sync(self: object, mask: int, value: object, src: int) -> object:
        vals, _ = exchange(self, value)
        return vals[int(src) % 32]

    def shfl_up_sync(self: object, mask: int, value: object, delta: int) -> object:
        vals, lane = exchange(self, value)
        return vals[lane - int(delta)] if lane >= int(delta) else value

    def shfl_xor_sync(self: object, mask: int, value: object, lane_mask: int) -> object:
        vals, lane = exchange(self, value)
        return vals[lane ^ int(lane_mask)]

    def shared_array(self: object, shape: Any, dtype: Any, alignment: object = None) -> np.ndarray:
        # The simulator keys shared arrays by their source line and creates them without a lock; two lanes racing
        # there got different arrays. Same keying, under a lock.
        caller = sys._getframe(1)
        key = (caller.f_code.co_filename, caller.f_lineno)
        with lock:
            res = self._allocations.get(key)  # type: ignore[attr-defined]
            if res is None:
                kind = np.dtype(dtype) if isinstance(dtype, type) else np.dtype(str(dtype))  # numpy or numba type
                res = self._allocations[key] = np.empty(shape, kind)  # type: ignore[attr-defined]
        return res

    kernelapi.FakeCUDAModule.ballot_sync = ballot_sync  # type: ignore[attr-defined]
    kernelapi.FakeCUDAModule.shfl_sync = shfl_sync  # type: ignore[attr-defined]
    kernelapi.FakeCUDAModule.shfl_up_sync = shfl_up_sync  # type: ignore[attr-defined]
    kernelapi.FakeCUDAModule.shfl_xor_sync = shfl_xor_sync  # type: ignore[attr-defined]
    kernelapi.FakeCUDAShared.array = shared_array  # type: ignore[method-assign]


def _child(inp: str, outp: str, part: int, parts: int) -> None:
    """Child side: the simulator, one launch per case (every parts-th from the part-th), outputs and counters
    saved."""
    from numba import cuda

    from ignis.kernels.topk_kernel import make_kernel

    assert type(cuda.jit(lambda: None)).__name__ == "FakeCUDAKernel"  # the simulator, not a driver
    _install_warp_shim()
    data = np.load(inp)
    out: dict[str, np.ndarray] = {}
    for name in list(CASES)[part::parts]:
        half, rows, ncols, k, nblk, chunk, ws_row = (int(v) for v in data[name + ".args"])
        xw = data[name + ".x"]
        ws = np.zeros(max(1, rows * ws_row), np.int64)
        counters = np.zeros(rows, np.int32)
        vals = np.zeros(rows * k, np.int16 if half else np.int32)
        ids = np.zeros(rows * k, np.int64)
        kern = cuda.jit(make_kernel(bool(half), k > 32, BLOCK))
        kern[(nblk, rows), BLOCK](xw, xw.size // rows, ncols, k, chunk, ws, ws_row, counters, vals, ids)
        out[name + ".vals"] = vals
        out[name + ".ids"] = ids
        out[name + ".counters"] = counters
    savez: Any = np.savez  # numpy's stubs take no **arrays
    savez(outp, **out)


CHILD = """
import sys
sys.setswitchinterval(1e-3)  # measured fastest for lanes that meet at a barrier every few statements
from test_kernels_sim import _child
_child(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
"""


@pytest.fixture(scope="module")
def simulated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.Tensor, np.ndarray, int]]:
    """Run the cases in two simulator children side by side; return each case's input, outputs and grid width."""
    from ignis.kernels.topk_launch import split, words

    tmp = tmp_path_factory.mktemp("sim")
    inputs: dict[str, np.ndarray] = {}
    cases: dict[str, tuple[torch.Tensor, int]] = {}
    for i, (name, (dtype_name, rows, ncols, k, want, kind)) in enumerate(CASES.items()):
        dtype = getattr(torch, dtype_name)
        half = dtype == torch.bfloat16
        x = _data(kind, rows, ncols, dtype, seed=i)
        padded = torch.nn.functional.pad(x, (0, ncols % 2)) if half else x
        nblk, chunk = split(words(ncols, half), want)
        ws_row = 16 * -(-nblk * k // 16) if nblk > 1 else 0
        inputs[name + ".x"] = padded.contiguous().view(torch.int32).reshape(-1).numpy()
        inputs[name + ".args"] = np.array([half, rows, ncols, k, nblk, chunk, ws_row], np.int64)
        cases[name] = (x, nblk)
    savez: Any = np.savez  # numpy's stubs take no **arrays
    savez(tmp / "in.npz", **inputs)
    outs = [str(tmp / f"out{part}.npz") for part in range(2)]
    results = simulator.run_parts(CHILD, [[str(tmp / "in.npz"), outp, str(part), "2"] for part, outp in
                                          enumerate(outs)], timeout=900)
    failed = simulator.failures(results, last_line="")
    assert not failed, failed
    out = {k: v for outp in outs for k, v in np.load(outp).items()}
    return {name: (x, out, nblk) for name, (x, nblk) in cases.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_source_in_simulator_matches_reference(
    simulated: dict[str, tuple[torch.Tensor, np.ndarray, int]], name: str
) -> None:
    from ignis.kernels.topk import topk_reference

    x, out, nblk = simulated[name]
    rows, k = x.shape[0], CASES[name][3]
    assert nblk == CASES[name][4]
    ref_vals, ref_ids = topk_reference(x, k)
    bits = torch.int16 if x.dtype == torch.bfloat16 else torch.int32
    assert torch.equal(torch.from_numpy(out[name + ".ids"]).reshape(rows, k), ref_ids)
    assert torch.equal(torch.from_numpy(out[name + ".vals"]).reshape(rows, k), ref_vals.view(bits))
    assert (out[name + ".counters"] == 0).all(), "the last block of each row must leave its counter at zero"
