"""The Playground: a Chat page and a Monitor page served by every front-end, beside the OpenAI API.

Owns: the `router` that ignis.server.app mounts when this package is installed: the pages and their static files
(ignis.server.playground.pages), the Monitor's JSON snapshot of the engine's counters (.monitor) and the control
endpoints that describe the running config and turn a wanted change into an `ignis serve` line (.control).
Does not own: generation (the pages call the server's own /v1/chat/completions), the counters (the engine) or
/metrics (ignis.server.metrics). Everything the pages need ships in the package: nothing is fetched from the
network at install or run time.
"""

from __future__ import annotations

from fastapi import APIRouter

from ignis.server.playground import control, monitor, pages

router = APIRouter()
router.include_router(pages.router)
router.include_router(monitor.router)
router.include_router(control.router)

__all__ = ["router"]
