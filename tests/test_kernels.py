"""ignis.kernels.topk on CPU: the reference order, the public API's checks and shapes, lazy imports, and the kernel
compiling to sm_90 PTX for every signature without a GPU."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch

from ignis.errors import InputError
from ignis.kernels.topk import MAX_K, topk, topk_reference


def _lexsort_order(x: torch.Tensor, k: int) -> torch.Tensor:
    """research/kernels.md §5's NumPy formulation: NaN first, then larger canonical value, then smaller column."""
    v = x.double().numpy()
    nan = np.isnan(v)
    v = np.where(nan | (v == 0), 0.0, v)
    cols = np.broadcast_to(np.arange(v.shape[-1]), v.shape)
    return torch.from_numpy(np.lexsort((cols, -v, ~nan), axis=-1)[:, :k].copy())


def _specials(rows: int, ncols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (rows, ncols), generator=g).float()  # ties everywhere
    x[:, 1::5] = -0.0
    x[0, [2, 9]] = torch.nan
    x[0, 4] = -torch.nan
    x[1, [6, 7]] = torch.inf
    x[1, 8] = -torch.inf
    x[2] = -torch.inf
    x[2, 30] = 1e-40  # a subnormal, and the only finite value
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_is_the_stable_descending_order(dtype: torch.dtype) -> None:
    x = _specials(5, 97, seed=1).to(dtype)
    for k in (1, 7, 64):
        vals, ids = topk_reference(x, k)
        assert torch.equal(ids, _lexsort_order(x, k))
        bits = torch.int16 if dtype != torch.float32 else torch.int32
        assert torch.equal(vals.view(bits), x.gather(1, ids).view(bits))  # the input's own bits: -0.0, NaN payloads


def test_reference_values_equal_torch_topk_and_ties_go_to_the_smaller_id() -> None:
    x = _specials(6, 300, seed=2)
    vals, ids = topk_reference(x, 20)
    tk = torch.topk(x, 20)
    torch.testing.assert_close(vals, tk.values, rtol=0, atol=0, equal_nan=True)
    for r in range(x.shape[0]):
        for j in range(20):
            same = (x[r] == vals[r, j]) | (x[r].isnan() & vals[r, j].isnan())
            earlier = ids[r, :j][same[ids[r, :j]]]
            # Among columns equal to this value, ours are the smallest ones, in increasing order.
            assert int(ids[r, j]) == int(same.nonzero()[len(earlier), 0])


def test_top1_is_argmax() -> None:
    x = torch.randint(0, 5, (64, 1000), generator=torch.Generator().manual_seed(3)).float()
    assert torch.equal(topk(x, 1)[1][:, 0], x.argmax(-1))


def test_cpu_topk_is_the_reference_for_any_leading_shape() -> None:
    x = torch.randn(2, 3, 500, generator=torch.Generator().manual_seed(4))
    vals, ids = topk(x, 9)
    assert vals.shape == ids.shape == (2, 3, 9) and ids.dtype == torch.int64
    ref_vals, ref_ids = topk_reference(x.reshape(6, 500), 9)
    assert torch.equal(ids.reshape(6, 9), ref_ids) and torch.equal(vals.reshape(6, 9), ref_vals)
    one_row_vals, one_row_ids = topk(x[0, 0], 9)
    assert torch.equal(one_row_ids, ref_ids[0]) and torch.equal(one_row_vals, ref_vals[0])


@pytest.mark.parametrize(
    ("shape", "dtype", "k", "field"),
    [
        ((4, 100), torch.float32, 0, "k"),
        ((4, 100), torch.float32, MAX_K + 1, "k"),
        ((4, 10), torch.float32, 11, "k"),
        ((4, 100), torch.int64, 5, "x"),
        ((), torch.float32, 1, "x"),
    ],
)
def test_bad_arguments_name_the_field(shape: tuple[int, ...], dtype: torch.dtype, k: int, field: str) -> None:
    with pytest.raises(InputError) as err:
        topk(torch.zeros(shape, dtype=dtype), k)
    assert err.value.field == field


def test_importing_the_kernels_touches_neither_numba_nor_cuda() -> None:
    code = (
        "import sys, torch, ignis.kernels, ignis.kernels.topk, ignis.kernels.topk_launch\n"
        "assert not any(m == 'numba' or m.startswith('numba.') for m in sys.modules), 'numba imported'\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize(("half", "two"), [(False, False), (False, True), (True, False), (True, True)])
def test_kernel_compiles_to_sm90_ptx(half: bool, two: bool) -> None:
    # Typing and lowering errors surface here without a GPU; numba-cuda (not numba's deprecated built-in target)
    # must be the one compiling.
    from numba import cuda
    from numba.cuda import types as numba_types

    from ignis.kernels.topk_kernel import make_kernel, signature
    from ignis.kernels.topk_launch import BLOCK

    types: Any = numba_types
    assert cuda.implementation == "NVIDIA"
    ptx, _ = cuda.compile_ptx(make_kernel(half, two, BLOCK), types.void(*signature(half)), cc=(9, 0))
    assert ".target sm_90" in ptx
    assert ".local" not in ptx  # the lists live in registers, not in local memory
    assert ptx.count("atom.global.add") == 1 and ptx.count("membar.gl") == 2  # one counter; release and acquire
    assert "vote.sync.ballot" in ptx and "shfl.sync.up" in ptx and "shfl.sync.bfly" in ptx  # insert; bitonic merge
