"""Start-up progress: a bar on a terminal, a line every few seconds otherwise, and one line per finished phase with
its time and memory."""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest
import structlog

from ignis.progress import StartupProgress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def default_logging() -> Iterator[None]:
    """structlog's defaults (no level filter), so that capture_logs sees info events whatever ran before."""
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()


def test_a_terminal_gets_a_bar_that_ends_each_phase_on_its_own_line() -> None:
    out = Terminal()
    used = iter([100 * 2**20, 400 * 2**20])  # at the start of the phase, at its end
    progress = StartupProgress(lambda: next(used), stream=out)
    with structlog.testing.capture_logs() as logs:
        for done in range(1, 5):
            progress("weights", done, 4, unit="tensors")
    text = out.getvalue()
    assert text.count("\r") == 4 and text.endswith("4/4 tensors   0.0 s\n")
    assert "[" + "#" * 15 + "." * 15 + "] 2/4" in text
    assert [(e["event"], e["phase"], e["memory_mib"], e["tensors"]) for e in logs] == [
        ("ignis.engine.loaded", "weights", 300.0, 4)]


def test_without_a_terminal_long_phases_log_every_few_seconds_and_the_caller_may_state_the_memory() -> None:
    clock = iter([0.0, 0.5, 2.6, 3.0, 5.0, 5.1])
    import ignis.progress

    real = ignis.progress.time.monotonic
    ignis.progress.time.monotonic = lambda: next(clock)  # type: ignore[assignment]
    try:
        progress = StartupProgress(lambda: 0, stream=io.StringIO(), every_s=2.0)
        with structlog.testing.capture_logs() as logs:
            for done in range(1, 7):
                progress("warmup", done, 6, unit="graphs", memory_bytes=2**30 if done == 6 else None)
    finally:
        ignis.progress.time.monotonic = real  # type: ignore[assignment]
    assert [(e["event"], e.get("done")) for e in logs] == [
        ("ignis.engine.loading", 3), ("ignis.engine.loading", 5), ("ignis.engine.loaded", None)]
    assert logs[-1]["memory_mib"] == 1024.0 and logs[-1]["seconds"] == 5.1 and logs[0]["percent"] == 50.0
