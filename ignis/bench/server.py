"""An `ignis serve` started for a benchmark: a child process on a free port, stopped when the run ends.

Owns: the command line (MODEL, `--port 0` and the caller's serve arguments), waiting for its "OpenAI API" line, the
log file its stderr goes to, and stopping it (SIGTERM, which drains). Does not own: the server (ignis.server.serve).
"""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

from ignis.errors import IgnisError

START_TIMEOUT_S = 900.0  # a large checkpoint loads for minutes


class StartedServer:
    def __init__(self, model: str | None, serve_args: str, log: Path, timeout_s: float = START_TIMEOUT_S) -> None:
        cmd = [sys.executable, "-m", "ignis.cli", "serve", *([model] if model else []), "--port", "0",
               *shlex.split(serve_args)]
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log
        with log.open("w") as err:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        self.base_url = self._wait(timeout_s)

    def _wait(self, timeout_s: float) -> str:
        found: list[str] = []

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                if m := re.search(r"OpenAI API\s+(http://\S+/v1)", line):
                    found.append(m.group(1))
                    break

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not found:
            self.stop()
            tail = self.log.read_text().strip().splitlines()[-1:] or ["no output"]
            raise IgnisError(f"ignis serve did not start within {timeout_s:g} s; its log is {self.log}: {tail[0]}")
        return found[0]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
