"""Compiling Triton kernels for the H200 (sm_90a) on a machine without a GPU, for the Triton kernels' tests.

`run_child` runs a test's compile script in a child interpreter without TRITON_INTERPRET (the test process runs
Triton's interpreter, tests/conftest.py) and returns what it printed; the script imports `build` and `spills` from
here: `build` compiles a jit function for sm_90 from its argument types, constants and the arguments Triton may take
as multiples of 16, `spills` counts the register spills ptxas reports for the result.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_child(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          check=False, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def build(fn: Any, types: dict[str, str], constants: dict[str, Any], divisible: tuple[str, ...], warps: int,
          stages: int) -> Any:
    """fn compiled for sm_90: arguments typed by `types` (others i32), `constants` as constexprs, pointers and the
    `divisible` arguments taken as multiples of 16."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    sig = {n: types.get(n, "i32") for n in names} | {n: "constexpr" for n in constants}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if sig[n][0] == "*" or n in divisible}
    src = ASTSource(fn, sig, {(names.index(n),): v for n, v in constants.items()}, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def spills(kernel: Any) -> int:
    """Bytes of register spills (stores and loads) ptxas reports for a compiled kernel's PTX."""
    from triton import knobs

    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    out = subprocess.run([knobs.nvidia.ptxas.path, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                         capture_output=True, text=True, check=True).stderr
    os.unlink(f.name)
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill", out))
