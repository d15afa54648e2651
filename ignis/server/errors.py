"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, with the HTTP status that fits.

Owns: mapping ignis errors to statuses (bad input 400, unknown model 404, full queue or engine down 503) and the
same body as an SSE event for errors that happen after a stream has started; a 503 says when to retry
(Retry-After). Does not own: raising them.
"""

from __future__ import annotations

import msgspec
from starlette.responses import Response

from ignis.errors import ArtifactError, EngineDeadError, IgnisError, InputError, QueueFullError


RETRY_AFTER_S = 1  # what a 503 tells a client to wait: a full queue or a restarting engine clears in seconds


class PayloadTooLarge(IgnisError):
    """The request body is larger than server.max_body_bytes (HTTP 413)."""


class ModelNotFound(Exception):
    def __init__(self, asked: str, served: str) -> None:
        super().__init__(f"The model {asked!r} does not exist; this server serves {served!r}")


def error_body(status: int, message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def describe(exc: BaseException) -> tuple[int, dict]:
    """The status and body for an exception a handler let through."""
    if isinstance(exc, InputError):
        return 400, error_body(400, str(exc), "invalid_request_error", exc.field, "invalid_value")
    if isinstance(exc, PayloadTooLarge):
        return 413, error_body(413, str(exc), "invalid_request_error", "body", "body_too_large")
    if isinstance(exc, ModelNotFound):
        return 404, error_body(404, str(exc), "invalid_request_error", "model", "model_not_found")
    if isinstance(exc, QueueFullError):
        return 503, error_body(503, str(exc), "service_unavailable", None, "queue_full")
    if isinstance(exc, EngineDeadError):
        return 503, error_body(503, str(exc), "service_unavailable", None, "engine_unavailable")
    if isinstance(exc, ArtifactError):
        return 500, error_body(500, str(exc), "server_error", None, "artifact")
    return 500, error_body(500, f"internal error: {type(exc).__name__}: {exc}", "server_error", None, None)


def error_response(exc: BaseException) -> Response:
    status, body = describe(exc)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json", headers=headers)


def error_event(exc: BaseException) -> bytes:
    """An error after the 200 was sent: one SSE data event with the same body (the openai client raises on it)."""
    return b"data: " + msgspec.json.encode(describe(exc)[1]) + b"\n\n"
