"""`ignis serve` started as a user starts it, for the hardening tests: a real process tree on a free port."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serving import launch


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
    args = ["--model", str(model), "--profile", "cpu", "--port", "0"]
    for k, v in {"log.format": "json", **sets}.items():
        args += ["--set", f"{k}={v}"]
    with launch(args, log, env) as s:
        yield Served(s.proc, s.url, log)
