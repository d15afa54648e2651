"""What every HTTP request passes before a route sees it, and what catches whatever a route lets slip.

Owns: `Guard` (in order: the Host allow-list, the drain's 503, the API key, the Origin of browser requests, the
content type, the body size) with `Gate` (draining or not, requests in flight), `Access` (the resolved key, origins
and hosts), and `Errors` (an unexpected exception becomes a 500 in OpenAI's shape on a connection that stays
usable, logged once with the request id every response carries in `x-request-id`). Does not own: CORS headers
(Starlette's CORSMiddleware, mounted by the app when `server.cors_origins` is set), errors ignis raises on purpose
(ignis.server.errors) or when a front-end drains (ignis.server.frontend decides; the Gate only says so).

Why a browser's Origin and the content type are checked even with CORS off: CORS only stops a page from reading
the answer, not a "simple" cross-origin POST (text/plain, no preflight) from running a generation.
"""

from __future__ import annotations

import hmac
import re
import secrets
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from ignis.config import IgnisConfig
from ignis.errors import ConfigError
from ignis.logging import get_logger
from ignis.server.errors import RETRY_AFTER_S, PayloadTooLarge, error_body

log = get_logger(__name__)

# Answered without a key: /health (load balancers and supervisors probe it) and the Playground's pages, which hold
# no data (HTML, scripts, styles); what a page fetches needs the key like any other client's request.
OPEN_PATHS = frozenset({"/health", "/", "/playground", "/playground/", "/playground/monitor"})
OPEN_PREFIXES = ("/playground/static/",)
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")

Scope = dict[str, Any]


@dataclass(frozen=True)
class Access:
    api_key: bytes | None
    origins: frozenset[str]  # "*" = any
    hosts: tuple[str, ...]  # empty = any; "*.example.com" matches subdomains
    max_body_bytes: int

    @classmethod
    def of(cls, cfg: IgnisConfig) -> Access:
        s = cfg.server
        key = s.api_key
        if not key and s.api_key_file:
            try:
                key = Path(s.api_key_file).read_text().strip()
            except OSError as e:
                raise ConfigError("server.api_key_file", f"cannot be read: {e}") from None
            if not key:
                raise ConfigError("server.api_key_file", f"{s.api_key_file} is empty")
        return cls(
            api_key=key.encode() if key else None,
            origins=frozenset(o.strip().rstrip("/") for o in s.cors_origins.split(",") if o.strip()),
            hosts=tuple(h.strip().lower() for h in s.allowed_hosts.split(",") if h.strip()),
            max_body_bytes=s.max_body_bytes,
        )

    def host_allowed(self, host: str) -> bool:
        if not self.hosts:
            return True
        name = host.lower()
        name = name.rsplit(":", 1)[0] if not name.endswith("]") else name  # drop the port; keep [v6]
        for h in self.hosts:
            if h == "*" or h == name or (h.startswith("*.") and name.endswith(h[1:])):
                return True
        return False

    def origin_allowed(self, origin: str, host: str) -> bool:
        if "*" in self.origins or origin.rstrip("/") in self.origins:
            return True
        return origin.split("://", 1)[-1].rstrip("/").lower() == host.lower()  # the page came from this server

    def key_ok(self, authorization: str) -> bool:
        if self.api_key is None:
            return True
        scheme, _, given = authorization.partition(" ")
        # Compare in constant time, and compare something even when the scheme is wrong.
        return hmac.compare_digest(given.strip().encode(), self.api_key) and scheme.lower() == "bearer"


class Gate:
    """A front-end's state as requests see it: draining (new requests get 503) and how many are in flight."""

    def __init__(self) -> None:
        self.draining = False
        self.inflight = 0


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


async def _refuse(send: Any, status: int, message: str, type_: str, code: str, param: str | None = None,
                  extra: list[tuple[bytes, bytes]] | None = None) -> None:
    body = msgspec.json.encode(error_body(status, message, type_, param, code))
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Guard:
    def __init__(self, app: Any, access: Access, gate: Gate) -> None:
        self.app = app
        self.access = access
        self.gate = gate

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        h = _headers(scope)
        host = h.get("host", "")
        if not self.access.host_allowed(host):
            return await _refuse(send, 400, f"the Host {host!r} is not served here (server.allowed_hosts)",
                                 "invalid_request_error", "invalid_host", "Host")
        if self.gate.draining:
            return await _refuse(send, 503, "this server is shutting down; retry in a moment", "service_unavailable",
                                 "draining", None, [(b"retry-after", str(RETRY_AFTER_S).encode()),
                                                    (b"connection", b"close")])
        path = scope["path"]
        open_path = path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)
        if not open_path and not self.access.key_ok(h.get("authorization", "")):
            return await _refuse(send, 401, "a valid API key is required: send 'Authorization: Bearer KEY'",
                                 "invalid_request_error", "invalid_api_key", None, [(b"www-authenticate", b"Bearer")])
        origin = h.get("origin")
        if origin is not None and not self.access.origin_allowed(origin, host):
            return await _refuse(send, 403, f"requests from the origin {origin!r} are not allowed "
                                 "(server.cors_origins)", "invalid_request_error", "origin_not_allowed", "Origin")
        if scope["method"] in ("POST", "PUT", "PATCH"):
            kind = h.get("content-type", "").split(";", 1)[0].strip().lower()
            if kind and kind != "application/json" and not kind.endswith("+json"):
                return await _refuse(send, 415, f"the body must be JSON (Content-Type: application/json), got "
                                     f"{kind!r}", "invalid_request_error", "unsupported_media_type", "Content-Type")
            length = h.get("content-length", "")
            if length.isdigit() and int(length) > self.access.max_body_bytes:
                return await _refuse(send, 413, self._too_large(), "invalid_request_error", "body_too_large", "body")
        self.gate.inflight += 1
        try:
            await self.app(scope, self._bounded(receive), send)
        finally:
            self.gate.inflight -= 1

    def _too_large(self) -> str:
        return f"the request body is larger than {self.access.max_body_bytes} bytes (server.max_body_bytes)"

    def _bounded(self, receive: Any) -> Any:
        """A chunked body (no Content-Length) is counted as it arrives and refused at the limit."""
        seen = 0

        async def bounded() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.access.max_body_bytes:
                    raise PayloadTooLarge(self._too_large())
            return message

        return bounded


class Errors:
    """The innermost net: an exception no handler took becomes a 500 in OpenAI's shape, and the connection stays
    open (Starlette's own last-resort handler re-raises, and uvicorn then drops the connection)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = _headers(scope).get("x-request-id", "")
        rid = given if _REQUEST_ID.fullmatch(given) else secrets.token_hex(8)
        started = False

        async def tagged(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            await send(message)

        try:
            await self.app(scope, receive, tagged)
        except Exception as e:
            where = traceback.extract_tb(e.__traceback__)[-1]
            log.error("ignis.server.internal_error", request_id=rid, path=scope["path"],
                      error=f"{type(e).__name__}: {e}"[:500], where=f"{where.filename}:{where.lineno}")
            if not started:
                await _refuse(tagged, 500, f"internal error (request id {rid}); the server log has the details",
                              "server_error", "internal_error")
