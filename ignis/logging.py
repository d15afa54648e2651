"""Logging for every ignis process: structlog events, rendered for people (console) or machines (JSON lines).

Owns: `configure` (called once at process start, never at import), `get_logger`, and `log_resolved`, the one
event that records the resolved config. Stdlib loggers (uvicorn, asyncio, third-party libraries) are routed
through the same renderer, so a process writes one format to stderr. Does not own: what gets logged where;
events are dotted names, `log.info("ignis.config.resolved", config=...)`, with data as keyword fields.

uvicorn installs its own handlers unless started with `log_config=None`; pass that so its lines come here.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any, TextIO

import structlog

if TYPE_CHECKING:
    from ignis.config import IgnisConfig

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
FORMATS = ("console", "json")
_OURS = "_ignis_handler"  # marks the handler `configure` installed, so a second call replaces only that one


def configure(level: str = "info", fmt: str = "console", stream: TextIO | None = None) -> None:
    """Route structlog and stdlib logging at `level` to `stream` (stderr) as console text or JSON lines.

    Safe to call again (e.g. after the config is resolved): the previous ignis handler is replaced, other
    handlers on the root logger are left alone.
    """
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, got {level!r}")
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    out = stream if stream is not None else sys.stderr
    renderer: Any
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
        # Locals off: a frame's locals can hold tensors whose repr would flood the log.
        no_locals = structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
        tail: list[Any] = [structlog.processors.ExceptionRenderer(no_locals)]
    else:
        colors = hasattr(out, "isatty") and out.isatty()
        renderer = structlog.dev.ConsoleRenderer(colors=colors, exception_formatter=structlog.dev.plain_traceback)
        tail = []
    structlog.configure(
        processors=[*shared, structlog.processors.StackInfoRenderer(),
                    structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        # Filtering in the bound logger makes a disabled debug call cost one method lookup.
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        cache_logger_on_first_use=False,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.ExtraAdder()],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *tail, renderer],
    )
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter)
    setattr(handler, _OURS, True)
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _OURS, False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(LEVELS[level])
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        # uvicorn's own handlers would print a second, differently formatted copy of each line.
        lg = logging.getLogger(name)
        lg.handlers.clear()
        lg.propagate = True


def get_logger(name: str | None = None) -> Any:
    """A structlog logger; cheap to create at module level, since it binds to the configuration on first use."""
    return structlog.get_logger(name)


def log_resolved(cfg: IgnisConfig) -> None:
    """Log the resolved config, once per process start, as the event `ignis.config.resolved`."""
    get_logger("ignis.config").info("ignis.config.resolved", config=cfg.redacted())
