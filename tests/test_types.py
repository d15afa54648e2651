"""The type checker over every installed package and over tools/ (the benchmarks run only on a GPU, so here is where
CI reads them): a signature that drifts from its callers fails here, not in use."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_mypy_finds_no_errors() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "ignis", "backends", "kernels", "ipc", "config", "tools"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
