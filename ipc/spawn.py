"""Starting ignis's own child processes (the GPU process, front-ends) and handing them their config.

Owns: the command line of a child (`python -m <module>`), the config passed on its stdin as JSON with the engine
secret (which never appears in a command line, the environment or a log; no pickle, and
unlike multiprocessing's spawn, the parent's `__main__` is never re-imported, so an unguarded script that builds
an `LLM` at top level still works), the parent's import path, file descriptors a child inherits, stopping a
child, and a child noticing that its parent is gone. Does not own: what a child does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence

from ignis.config import IgnisConfig


class Child:
    """One child process of ours."""

    def __init__(self, module: str, args: Sequence[str], cfg: IgnisConfig, pass_fds: Sequence[int] = (),
                 secret: str = "") -> None:
        env = dict(os.environ)
        # The child imports ignis from wherever this process does (an editable checkout, a test's sys.path).
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        cmd = [sys.executable, "-m", module, "--parent", str(os.getpid()), *args]
        self.module = module
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env, pass_fds=tuple(pass_fds))
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"config": cfg.as_dict(), "secret": secret}).encode())
        self.proc.stdin.close()
        self.pid = self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited after `timeout_s`. Idempotent."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def read_start() -> tuple[IgnisConfig, str]:
    """In the child: the config and the engine secret ("" for none) its parent wrote to stdin."""
    start = json.loads(sys.stdin.buffer.read())
    return IgnisConfig.from_dict(start["config"]), str(start["secret"])


def parent_gone(parent_pid: int) -> bool:
    """In the child: whether the process that started it has exited (the child was re-parented)."""
    return os.getppid() != parent_pid
