"""Suite-wide settings: the repository's root last on the import path (for tools/), tiny models run on one intra-op
thread, here and in every engine process a test starts; and the `restore_logging` fixture for modules that configure
logging, and `interpreted_loop_bounds` for Triton kernels whose loops have bounds computed in the kernel.

For matrices this small a second thread only adds synchronisation, which turns into long stalls on a shared
machine; one thread keeps the suite's time predictable on CI's two cores.

Without a GPU, Triton kernels run in Triton's interpreter (numpy on the CPU), so their tests check the kernels
themselves against their torch references; `triton.jit` reads the setting when a kernel is defined, so it is set
before any test module imports one."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
import torch

# tools/ is not installed: its tests import it from the repository root, and importing it puts the root last on the
# path (tools/__init__: the root's other folders would shadow installed packages of the same names).
sys.path.append(str(Path(__file__).resolve().parent.parent))
import tools  # noqa: E402, F401

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture()
def restore_logging() -> Iterator[None]:
    """For tests that configure logging (the CLI, the config log, training runs): put the root logger's handlers and
    level and structlog's defaults back afterwards, so the next test starts from a clean slate."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.reset_defaults()


@pytest.fixture()
def interpreted_loop_bounds(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Triton 3.6's interpreter turns a tensor loop bound (a one-element array) into an int with int(array), which
    NumPy 2.4 refuses for arrays with a dimension: it reads the element instead."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor

    def patched(tensor: object, scope: interpreter._LangPatchScope) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patched)
    yield


@pytest.fixture()
def interpreted_dot_by_rows(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The interpreter's tl.dot is one np.matmul over the whole tile, and OpenBLAS's sgemm rounds a row differently
    by where it sits in the tile on some CPUs (AMD EPYC with OpenBLAS 0.3.31: 4e-7 apart), which the tensor cores'
    mma does not. Rows one at a time (the same [1, K] x [K, N] product for every row) keep the tests of a row's
    bits alone and in a batch about the kernel, not about the CPU's BLAS."""
    import numpy as np
    from triton.runtime import interpreter

    dot = interpreter.InterpreterBuilder.create_dot

    def by_rows(self: object, a: object, b: object, d: object, input_precision: object, imprecise: object) -> object:
        a_data, b_data, acc = a.data, b.data, d.data  # type: ignore[attr-defined]
        if a_data.dtype != np.float32 or b_data.dtype != np.float32 or a_data.ndim != 2:
            return dot(self, a, b, d, input_precision, imprecise)
        rows = [np.matmul(a_data[i : i + 1], b_data, dtype=acc.dtype) for i in range(a_data.shape[0])]
        return interpreter.TensorHandle(np.concatenate(rows) + acc, d.dtype.scalar)  # type: ignore[attr-defined]

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", by_rows)
    yield
