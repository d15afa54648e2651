"""Kernel sources in numba-cuda's CUDA simulator, in child interpreters, several at once.

NUMBA_ENABLE_CUDASIM must be set before numba.cuda is imported, and the rest of the suite keeps the real numba.cuda,
so each check runs in a child. The simulator runs every GPU thread as a Python thread under one GIL: a child keeps
one core busy, so a check split into parts runs them side by side.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_parts(code: str, parts: Sequence[Sequence[str]], timeout: float) -> list[subprocess.CompletedProcess[str]]:
    """Run `code` once per part (its sys.argv[1:] the part's strings), all at once, in the simulator from the
    repository root; each child's exit status and output, in the parts' order. A child still running `timeout`
    seconds after the parent begins to wait on it is killed and reads as failed; all are killed when the parent is
    interrupted."""
    # the children import test modules, which import their helpers from tests/ as pytest lets them
    path = [os.path.join(ROOT, "tests"), ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=os.pathsep.join(path))
    procs = [subprocess.Popen([sys.executable, "-c", code, *argv], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for argv in parts]
    done = []
    try:
        for proc in procs:
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
                err += f"\nkilled after {timeout} s"
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done


def failures(results: Sequence[subprocess.CompletedProcess[str]], last_line: str = "ok") -> str:
    """The output of each child that failed or did not end its output with `last_line` ("" when none did)."""
    bad = [r for r in results if r.returncode != 0 or not r.stdout.strip().endswith(last_line)]
    return "\n\n".join(f"{r.args[3:]}: exit {r.returncode}\n{r.stdout[-3000:]}{r.stderr[-3000:]}" for r in bad)
