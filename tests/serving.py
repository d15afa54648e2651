"""Helpers for tests of the GPU process, the clients and the server: a tiny artifact with a real tokenizer, and
`ignis serve` started as a user starts it."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ignis.artifact import BUILTIN
from ignis.config import IgnisConfig, load_config
from tiny import tiny_checkpoint


def tiny_artifact(path: Path, seed: int = 2) -> Path:
    """A tiny random checkpoint with the built-in tokenizer beside it (vocabulary 8192, like the tokenizer's)."""
    tiny_checkpoint(path, seed=seed, mtp=True, vocab_size=8192)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUILTIN / name, path / name)
    return path


def config(model: Path, **overrides: Any) -> IgnisConfig:
    # Plain decoding unless a test asks for a backend: the default ("auto") would follow what the artifact carries.
    base: dict[str, Any] = {"model.path": str(model), "log.level": "warning", "engine.context": 512,
                            "spec.backend": "off"}
    base.update(overrides)
    return load_config(profile="cpu", overrides=base)


@dataclass
class Launched:
    proc: subprocess.Popen
    url: str  # http://host:port
    log: Path  # the server's stderr
    banner: list[str]  # what it printed up to the URL


@contextmanager
def launch(args: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[Launched]:
    """`ignis serve ARGS` in a real process tree, stderr to `log`; yields once the banner names the API's URL, and
    stops it (SIGTERM, then SIGKILL) at the end unless the test already did."""
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "ignis.cli", "serve", *args], stdout=subprocess.PIPE,
                                stderr=err, text=True, env=env)
    banner: list[str] = []
    try:
        url = None
        assert proc.stdout is not None
        for line in proc.stdout:
            banner.append(line)
            if m := re.search(r"OpenAI API\s+(http://\S+)/v1", line):
                url = m.group(1)
                break
        assert url, f"ignis serve did not start:\n{log.read_text()[-3000:]}"
        yield Launched(proc, url, log, banner)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
