"""A progress bar on stderr for the long phases of drafter training (generation, training).

Owns: drawing one line of progress (a bar on a terminal, a plain line every `every_s` seconds otherwise) with the
rate and the time left. Does not own: what is counted.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, label: str, total: float, unit: str, *, stream: TextIO | None = None, every_s: float = 30.0) -> None:
        self.label = label
        self.total = max(total, 1e-9)
        self.unit = unit
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every_s = 0.25 if self.tty else every_s
        self.t0 = time.monotonic()
        self.shown = 0.0
        self.done = 0.0
        self.drawn = -1.0  # `done` when last drawn

    def update(self, done: float, note: str = "") -> None:
        self.done = done
        now = time.monotonic()
        if now - self.shown < self.every_s and done < self.total:
            return
        self.shown = now
        self._draw(note)
        self.drawn = done

    def close(self, note: str = "") -> None:
        if self.drawn != self.done or note:
            self._draw(note)
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, note: str) -> None:
        elapsed = time.monotonic() - self.t0
        frac = min(self.done / self.total, 1.0)
        rate = self.done / elapsed if elapsed > 0 else 0.0
        left = (self.total - self.done) / rate if rate > 0 else float("inf")
        bar = "#" * int(24 * frac) + "-" * (24 - int(24 * frac))
        eta = _clock(left) if left != float("inf") else "?"
        line = (f"{self.label} [{bar}] {frac:6.1%} {_count(self.done)}/{_count(self.total)} {self.unit} "
                f"{_count(rate)}/s {_clock(elapsed)} elapsed, {eta} left {note}").rstrip()
        self.stream.write(("\r" + line + "\x1b[K") if self.tty else line + "\n")
        self.stream.flush()


def _count(x: float) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{suffix}"
    return f"{x:.0f}" if x == int(x) else f"{x:.1f}"


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
