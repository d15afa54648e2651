"""The Playground's pages and static files, read from the package (no network, no build step).

Owns: which paths serve which page (`/` and `/playground` the Chat, `/playground/monitor` the Monitor) and the
closed set of static files under `/playground/static/`. Does not own: what the pages do (their JS) or the data
they read (ignis.server.playground.monitor, .control).
"""

from __future__ import annotations

import importlib.resources
from functools import cache

from fastapi import APIRouter
from starlette.exceptions import HTTPException
from starlette.responses import Response

router = APIRouter()

_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
    ".txt": "text/plain; charset=utf-8",
}
# The pages are small and change only with the package; the browser may keep them for a minute.
_CACHE = {"Cache-Control": "max-age=60"}


@cache
def _files() -> dict[str, bytes]:
    """Every static file by name, read once per process."""
    root = importlib.resources.files(__package__).joinpath("static")
    return {f.name: f.read_bytes() for f in root.iterdir() if f.is_file() and _suffix(f.name) in _TYPES}


def _suffix(name: str) -> str:
    return name[name.rfind("."):] if "." in name else ""


def _serve(name: str) -> Response:
    body = _files().get(name)
    if body is None:
        raise HTTPException(404, f"no Playground file {name!r}")
    return Response(body, media_type=_TYPES[_suffix(name)], headers=_CACHE)


@router.get("/", include_in_schema=False)
@router.get("/playground", include_in_schema=False)
@router.get("/playground/", include_in_schema=False)
async def chat() -> Response:
    return _serve("chat.html")


@router.get("/playground/monitor", include_in_schema=False)
async def monitor() -> Response:
    return _serve("monitor.html")


@router.get("/playground/static/{name}", include_in_schema=False)
async def static(name: str) -> Response:
    return _serve(name)
