"""`/metrics.json`: the engine's counters as one JSON snapshot, for the Monitor page (and any script).

Owns: the snapshot's shape: `time` (server clock, seconds), `stats` (every field of the engine's EngineStats,
the numbers /metrics exposes, fetched from the engine the same way on every call, so every front-end answers the
same) and `engine` (what the engine runs: model, backend, draft tokens, lanes, context). Rates (tokens/s,
rounds/s) and tokens per round over time are differences between snapshots, computed by the reader. Does not own:
the Prometheus exposition (ignis.server.metrics) or the counting (the engine).
"""

from __future__ import annotations

import time

import msgspec
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

router = APIRouter()


@router.get("/metrics.json")
async def snapshot(request: Request) -> Response:
    client = request.app.state.llm.client
    stats = await client.stats()  # raises EngineDeadError (503) while the engine is down
    body = {
        "time": time.time(),
        "stats": msgspec.structs.asdict(stats),
        "engine": msgspec.structs.asdict(client.info),
    }
    return Response(msgspec.json.encode(body), media_type="application/json", headers={"Cache-Control": "no-store"})
