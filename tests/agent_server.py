"""One `ignis serve` per test module, for the agents' API tests: started as users start it, stopped at the end."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from ignis.artifact import BUILTIN
from serving import launch


@contextmanager
def serve(log: Path, *args: str) -> Iterator[str]:
    """The base URL (http://host:port) of a server started with `args`."""
    with launch(["--profile", "cpu", "--port", "0", *args, "--set", "log.format=json", "--set", "engine.lanes=4"],
                log) as s:
        yield s.url


def builtin_with_template(path: Path, template: str) -> Path:
    """The built-in model and drafter (linked, not copied) under another chat template."""
    import json

    path.mkdir(parents=True, exist_ok=True)
    for f in BUILTIN.iterdir():
        if f.name != "tokenizer_config.json" and not f.name.startswith("__"):
            (path / f.name).symlink_to(f)
    cfg = json.loads((BUILTIN / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    return path


@pytest.fixture(scope="session")
def agents_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The built-in model with its drafter (dflash2 at 7), shared by the agents' API modules."""
    log = tmp_path_factory.mktemp("agents") / "serve.log"
    with serve(log, "--set", "spec.backend=dflash2", "--set", "spec.draft_tokens=7") as u:
        yield u
