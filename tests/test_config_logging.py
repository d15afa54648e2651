"""Logging as configured from `log.level` and `log.format`: JSON lines or console text, stdlib routed through."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys

import pytest

from ignis.config import load_config
from ignis.logging import configure, get_logger, log_resolved


pytestmark = pytest.mark.usefixtures("restore_logging")  # tests/conftest.py


def lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_carry_event_level_logger_and_fields() -> None:
    out = io.StringIO()
    log = get_logger("ignis.engine")  # made before configure, as module-level loggers are
    configure("info", "json", stream=out)
    log.info("ignis.engine.started", lanes=4)
    log.debug("ignis.engine.round", n=1)  # below the level: dropped
    logging.getLogger("uvicorn.error").warning("Started server process [%d]", 42)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("ignis.engine.failed")
    first, second, third = lines(out)
    assert first["event"] == "ignis.engine.started" and first["lanes"] == 4
    assert (first["level"], first["logger"]) == ("info", "ignis.engine") and "timestamp" in first
    assert (second["event"], second["level"], second["logger"]) == ("Started server process [42]", "warning", "uvicorn.error")
    assert third["exception"][0]["exc_type"] == "RuntimeError"  # type: ignore[index]
    assert "locals" not in third["exception"][0]["frames"][0]  # type: ignore[index]


def test_console_format_is_for_people_and_level_is_honoured() -> None:
    out = io.StringIO()
    configure("debug", "console", stream=out)
    get_logger("ignis.x").debug("ignis.x.detail", k=7)
    logging.getLogger("other").info("plain %s", "line")
    text = out.getvalue()
    assert "ignis.x.detail" in text and "k=7" in text and "plain line" in text and "{" not in text


def test_reconfigure_replaces_only_its_own_handler() -> None:
    foreign = logging.NullHandler()
    logging.getLogger().addHandler(foreign)
    first, second = io.StringIO(), io.StringIO()
    configure("info", "json", stream=first)
    configure("warning", "json", stream=second)
    get_logger("ignis.t").info("ignis.t.quiet")
    get_logger("ignis.t").warning("ignis.t.loud")
    assert first.getvalue() == "" and [e["event"] for e in lines(second)] == ["ignis.t.loud"]
    assert foreign in logging.getLogger().handlers


def test_log_resolved_records_the_whole_config() -> None:
    out = io.StringIO()
    configure("info", "json", stream=out)
    cfg = load_config(profile="cpu", overrides={"spec.backend": "mtp"})
    log_resolved(cfg)
    (event,) = lines(out)
    assert event["event"] == "ignis.config.resolved" and event["config"] == cfg.as_dict()


def test_bad_level_or_format_is_refused() -> None:
    with pytest.raises(ValueError, match="trace"):
        configure("trace", "json")
    with pytest.raises(ValueError, match="xml"):
        configure("info", "xml")


def test_importing_configures_nothing() -> None:
    code = "import logging, ignis.logging, ignis.cli, ignis.config; print(len(logging.getLogger().handlers))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "0", proc.stderr
