"""`ignis serve` started as a user starts it, for the hardening tests: a real process tree on a free port."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Served:
    proc: subprocess.Popen
    url: str
    log: Path

    def events(self, name: str) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines()
                if line.startswith("{") and f'"{name}"' in line]

    def engine_pid(self) -> int:
        return int(self.events("ignis.serve.engine_started")[-1]["pid"])


@contextmanager
def serve(model: Path, log: Path, sets: dict[str, Any], env: dict[str, str] | None = None) -> Iterator[Served]:
    """`ignis serve --profile cpu --port 0` with `--set` overrides; yields once it announces its URL, and stops
    it (SIGTERM, then SIGKILL) when done unless the test already did."""
    cmd = [sys.executable, "-m", "ignis.cli", "serve", "--model", str(model), "--profile", "cpu", "--port", "0"]
    for k, v in {"log.format": "json", **sets}.items():
        cmd += ["--set", f"{k}={v}"]
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    try:
        url = None
        assert proc.stdout is not None
        for line in proc.stdout:
            if m := re.search(r"OpenAI API\s+(http://\S+)/v1", line):
                url = m.group(1)
                break
        assert url, f"ignis serve did not start:\n{log.read_text()[-3000:]}"
        yield Served(proc, url, log)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
