"""Errors a user can act on. Each names the field at fault and what would be accepted instead.

Owns: the exception types raised for bad input, bad config and a dead engine. Does not own: where they are
raised (validation lives beside the data it checks) or how the server maps them to HTTP (ignis.server).
"""

from __future__ import annotations


class IgnisError(Exception):
    """Base of every error ignis raises on purpose."""


class InputError(IgnisError, ValueError):
    """A request field is out of range or malformed. Raised before any work starts."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ConfigError(IgnisError, ValueError):
    """A config key, profile or override is unknown, mistyped or out of range."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"config {key}: {message}")
        self.key = key
        self.message = message


class ArtifactError(IgnisError, ValueError):
    """A model directory is missing a file or tensor, holds a wrong shape, or is another architecture."""


class EngineDeadError(IgnisError, RuntimeError):
    """The GPU process died or stopped answering; in-flight requests fail with this."""


class QueueFullError(IgnisError, RuntimeError):
    """The waiting queue is at its limit; the request was not accepted (HTTP 503)."""
