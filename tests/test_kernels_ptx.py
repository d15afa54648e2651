"""The device round's numba-cuda kernels compile for sm_90 on a machine without a GPU, with the argument types the
launches pass (bf16 as int16, fp32, int64 lanes and positions), so a typing or lowering error fails here, in CI,
rather than on the first GPU start-up; their per-thread arrays live in registers, not local memory; and the GDN
recurrence reads k and q from shared memory as 16-byte vectors."""

from __future__ import annotations

from typing import Any

import pytest


def _kernels() -> list[tuple[str, Any, tuple[Any, ...]]]:
    from numba.cuda import types

    from ignis.kernels.attention_kernel import make_kernels as attention_kernels
    from ignis.kernels.fused_kernel import make_kernels
    from ignis.kernels.gdn_kernel import make_kernels as gdn_kernels
    from ignis.kernels.gdn_kernel import column_tile, make_window_kernel

    t: Any = types

    def a(dt: Any, n: int) -> Any:
        return t.Array(dt, n, "A")

    e, f, i = t.int16, t.float32, t.int64  # a bf16 element, fp32, int64
    k = make_kernels(True, 128, 5)  # bf16, blocks of 128 for per-head kernels, rows up to 5 x 1024 for the norm
    att = attention_kernels(True, 6, 256)
    gdn = gdn_kernels(128, 128, 8)
    tiled = gdn_kernels(128, 128, column_tile(128, 128)).columns  # a prefill's columns, staged a tile at a time
    return [
        ("add_rms_norm", k["add_rms_norm"], (a(e, 2), a(e, 2), a(f, 1), a(e, 2), a(e, 2), f, t.boolean)),
        ("conv", k["conv"], (a(e, 3), a(i, 1), a(e, 3), a(f, 2), a(f, 3), a(e, 3), a(e, 3), a(f, 3), t.boolean, i, i,
                             f, i)),
        ("gated_norm", k["gated_norm"], (a(f, 3), a(e, 2), a(e, 1), a(e, 2), f)),
        ("swiglu", k["swiglu"], (a(e, 2), a(e, 2))),
        ("qk_rope_write", k["qk_rope_write"], (a(e, 2), a(f, 1), a(f, 1), a(e, 2), a(e, 2), a(e, 4), a(e, 4), a(i, 2),
                                               a(i, 1), a(i, 2), a(e, 4), f, i, i)),
        ("grouped_conv", k["grouped_conv"], (a(e, 3), a(e, 2), a(e, 4), a(e, 3), i)),
        ("attention partial", att["partial"], (a(e, 4), a(e, 4), a(e, 4), a(i, 2), a(i, 1), a(i, 2), a(f, 5), a(f, 4),
                                               a(f, 4), f, i)),
        ("attention combine", att["combine"], (a(f, 5), a(f, 4), a(f, 4), a(e, 2), a(e, 2), i)),
        ("gdn columns", gdn.columns, (a(f, 4), a(i, 1), a(f, 3), a(f, 3), a(f, 1), a(f, 1), a(f, 4), a(f, 4), i, i,
                               t.boolean, t.boolean)),
        ("gdn columns, prefill tile", tiled, (a(f, 4), a(i, 1), a(f, 3), a(f, 3), a(f, 1), a(f, 1), a(f, 4), a(f, 4),
                                              i, i, t.boolean, t.boolean)),
        ("gdn replay", gdn.replay, (a(f, 5), a(i, 1), a(f, 5), a(i, 1), i)),
        ("gdn window", make_window_kernel(), (a(e, 4), a(e, 4), a(i, 1), a(i, 1))),
    ]


@pytest.mark.parametrize("index", range(12))
def test_kernel_compiles_for_sm90_with_registers_only(index: int) -> None:
    from numba import cuda
    from numba.cuda import types

    name, kernel, signature = _kernels()[index]
    assert cuda.implementation == "NVIDIA"
    ptx, _ = cuda.compile_ptx(kernel.py_func, types.void(*signature), cc=(9, 0))
    assert ".target sm_90" in ptx, name
    assert ".local" not in ptx, f"{name}: a per-thread array spilled to local memory"


@pytest.mark.parametrize("name", ["gdn columns", "gdn replay"])
def test_recurrence_reads_k_and_q_as_16_byte_vectors(name: str) -> None:
    # A thread's 32 rows of k (and q) at dk = 128 come in 8 ld.shared.v4.f32, one a four multiply-adds; a signed index
    # or a shared array without 16-byte alignment would bring back one scalar load a multiply-add.
    from numba import cuda
    from numba.cuda import types

    _, kernel, signature = next(k for k in _kernels() if k[0] == name)
    ptx, _ = cuda.compile_ptx(kernel.py_func, types.void(*signature), cc=(9, 0))
    assert ptx.count("ld.shared.v4.f32") == (16 if name == "gdn columns" else 8), name
