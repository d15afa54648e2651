"""Start-up progress: what the engine's load steps report, and how it reaches the person waiting.

Owns: the `Progress` interface every start-up phase calls (`weights`, `drafter`, `caches`, `warmup`: prefill and
the round's CUDA graphs) and `StartupProgress`, which draws a bar when stderr is a terminal and otherwise logs a
line at most every `every_s` seconds, and logs each phase's end with its time and the memory it took. Does not own
what the phases do (ignis.engine.core, ignis.model.loader) or the ready line (ignis.server.serve).

A phase reports `(name, done, total)` as often as it likes; `done == total` ends it. Memory is measured here (device
memory allocated on a GPU, the process's resident memory on the CPU) unless the caller says how much it took.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Protocol, TextIO

from ignis.logging import get_logger

log = get_logger("ignis.engine.progress")


class Progress(Protocol):
    def __call__(self, phase: str, done: int, total: int, *, unit: str = "", memory_bytes: int | None = None) -> None:
        """Phase `phase` has done `done` of `total` (in `unit`s); `done == total` ends it. `memory_bytes`: what the
        phase took, when the caller knows better than a probe of the whole process."""


def silent(phase: str, done: int, total: int, *, unit: str = "", memory_bytes: int | None = None) -> None:
    """A Progress that reports nothing (tools and tests that load engines in a loop)."""


class StartupProgress:
    """Bar on a terminal, periodic structlog lines otherwise; one `ignis.engine.loaded` line per finished phase."""

    def __init__(self, memory: Callable[[], int], *, stream: TextIO | None = None, every_s: float = 2.0) -> None:
        self._memory = memory
        self._stream = stream if stream is not None else sys.stderr
        self._bar = self._stream.isatty()
        self._every_s = every_s
        self._phase: str | None = None
        self._t0 = 0.0
        self._m0 = 0
        self._last = 0.0

    def __call__(self, phase: str, done: int, total: int, *, unit: str = "", memory_bytes: int | None = None) -> None:
        now = time.monotonic()
        if phase != self._phase:
            # A phase that ends within every_s says so once, in its "loaded" line.
            self._phase, self._t0, self._m0, self._last = phase, now, self._memory(), now
        if done >= total:
            took = memory_bytes if memory_bytes is not None else max(self._memory() - self._m0, 0)
            if self._bar:
                self._draw(phase, total, total, unit, end="\n")
            log.info("ignis.engine.loaded", phase=phase, seconds=round(now - self._t0, 2),
                     memory_mib=round(took / 2**20, 1), **({unit: total} if unit else {}))
            self._phase = None
        elif self._bar:
            self._draw(phase, done, total, unit, end="")
        elif now - self._last >= self._every_s:
            self._last = now
            log.info("ignis.engine.loading", phase=phase, done=done, total=total, unit=unit,
                     percent=round(100.0 * done / max(total, 1), 1), seconds=round(now - self._t0, 1))

    def _draw(self, phase: str, done: int, total: int, unit: str, end: str) -> None:
        width = 30
        filled = width * done // max(total, 1)
        elapsed = time.monotonic() - self._t0
        self._stream.write(f"\r  {phase:<8} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} {unit} "
                           f"{elapsed:5.1f} s{end}")
        self._stream.flush()


def memory_probe(device_type: str) -> Callable[[], int]:
    """Bytes in use now: allocated device memory on a GPU, resident memory of this process on the CPU."""
    if device_type == "cuda":
        import torch

        return torch.cuda.memory_allocated
    return resident_bytes


def resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    import os

    return pages * os.sysconf("SC_PAGE_SIZE")
