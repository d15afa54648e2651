"""The front-end's ASGI app: OpenAI routes, tokenize/detokenize, health and metrics, over one AsyncLLM.

Owns: the routes (with the OpenAPI document at `/openapi.json`), the middleware stack (CORS when configured,
ignis.server.guard's checks and its last-resort 500), the app's lifespan (load the tokenizer, connect to the GPU
process without waiting for it, so `/health` can say 503 while it loads), and turning any ignis error into OpenAI's
error shape. FastAPI and
uvicorn because they are the standard Python ASGI stack every OpenAI-compatible server users know is built on.
Does not own: request/response shapes (ignis.server.openai), metric names (ignis.server.metrics), or the
process that runs the app (ignis.server.frontend).

A Playground, if the package has one, is a module `ignis.server.playground` exposing `router`; it is mounted
here and announced by `ignis serve`.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response

from ignis import __version__
from ignis.artifact import resolve_model_path
from ignis.client.async_client import AsyncEngineClient
from ignis.client.async_llm import AsyncLLM
from ignis.config import IgnisConfig
from ignis.errors import EngineDeadError, IgnisError, InputError
from ignis.server import chat, openai, responses
from ignis.server.errors import ModelNotFound, error_body, error_response
from ignis.server.generation import ClientGone
from ignis.server.openapi_schema import document
from ignis.server.guard import Access, Errors, Gate, Guard
from ignis.server.limits import Limits
from ignis.server.schemas import ChatCompletionRequest, decode_body
from ignis.server.metrics import CONTENT_TYPE, exposition
from ignis.tokenizer import Tokenizer

PLAYGROUND = "ignis.server.playground"


def has_playground() -> bool:
    return importlib.util.find_spec(PLAYGROUND) is not None


def _json(body: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json")


class _ServedBy:
    """Tags every response with the front-end that served it (`x-ignis-frontend`), for operators and tests."""

    def __init__(self, app: Any, frontend: int) -> None:
        self.app = app
        self.header = (b"x-ignis-frontend", str(frontend).encode())

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def tagged(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)

        await self.app(scope, receive, tagged)


def build_app(
    cfg: IgnisConfig, address: str, frontend: int = 0, on_ready: Callable[[], None] | None = None,
    gate: Gate | None = None, secret: str = "",
) -> FastAPI:
    """The app of front-end number `frontend`, talking to the GPU process at `address` (with its `secret`, for
    tcp); `on_ready` is called once the engine first answers; `gate` is how the process running it drains it."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = AsyncEngineClient(cfg, address, secret=secret)
        await client.start(wait=False)
        app.state.llm = AsyncLLM.from_parts(cfg, Tokenizer.from_dir(resolve_model_path(cfg)), client)

        async def announce() -> None:
            await client.until_ready()
            if on_ready is not None:
                on_ready()

        ready = asyncio.create_task(announce())
        try:
            yield
        finally:
            ready.cancel()
            await client.close()

    app = FastAPI(title="ignis", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    access = Access.of(cfg)
    app.state.gate = gate or Gate()
    app.add_middleware(Errors)  # innermost: what no handler took
    app.add_middleware(Guard, access=access, gate=app.state.gate)
    if access.origins:
        app.add_middleware(CORSMiddleware, allow_origins=sorted(access.origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], max_age=600)
    app.add_middleware(_ServedBy, frontend=frontend)

    @app.exception_handler(IgnisError)
    @app.exception_handler(ModelNotFound)
    async def _ignis_error(request: Request, exc: Exception) -> Response:
        return error_response(exc)

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: Exception) -> Response:
        return Response(status_code=499)  # nobody reads it; the requests are already aborted

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _json(error_body(exc.status_code, str(exc.detail), kind), exc.status_code)

    def llm(request: Request) -> AsyncLLM:
        return request.app.state.llm

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await openai.completions(request, llm(request))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await openai.chat_completions(request, llm(request))

    @app.post("/v1/responses")
    async def responses_route(request: Request) -> Response:
        return await responses.responses(request, llm(request))

    def model_card(request: Request) -> dict[str, Any]:
        info = llm(request).client.info
        return {"id": info.model_name, "object": "model", "created": int(time.time()), "owned_by": "ignis",
                "max_model_len": info.context, "backend": info.backend, "draft_tokens": info.draft_tokens}

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return _json({"object": "list", "data": [model_card(request)]})

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        card = model_card(request)
        if model_id != card["id"]:
            raise ModelNotFound(model_id, card["id"])
        return _json(card)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await _body(request)
        tok = llm(request).tokenizer
        limits = Limits.of(cfg, llm(request).client.info.context)
        if isinstance(body.get("messages"), list):
            messages = ChatCompletionRequest(messages=body["messages"]).conversation()
            limits.check_text("messages", "".join(m["content"] for m in messages))
            add = bool(body.get("add_generation_prompt", True))
            text = await asyncio.to_thread(tok.apply_chat_template, chat.template_messages(messages),
                                           add_generation_prompt=add)
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
            limits.check_text("prompt", text)
        else:
            raise InputError("prompt", "give a string 'prompt' or a list of chat 'messages'")
        ids = await asyncio.to_thread(tok.encode, text)
        return _json({"tokens": ids, "count": len(ids), "max_model_len": llm(request).client.info.context})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body = await _body(request)
        ids = body.get("tokens")
        if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
            raise InputError("tokens", "must be a list of token ids (integers >= 0)")
        tok = llm(request).tokenizer
        if any(t >= tok.vocab_size for t in ids):
            raise InputError("tokens", f"token ids must be below the vocabulary size {tok.vocab_size}")
        return _json({"prompt": tok.decode(ids, skip_special_tokens=False)})

    @app.get("/openapi.json")
    async def openapi_document(request: Request) -> Response:
        return _json(document(__version__))

    @app.get("/health")
    async def health(request: Request) -> Response:
        problem = llm(request).client.problem()
        if problem is not None:
            return error_response(EngineDeadError(problem))
        return _json({"status": "ok"})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        stats = await llm(request).client.stats()
        return Response(exposition(stats), media_type=CONTENT_TYPE)

    if has_playground():
        app.include_router(importlib.import_module(PLAYGROUND).router)
    return app


async def _body(request: Request) -> dict[str, Any]:
    body = decode_body(await request.body(), Any)
    if not isinstance(body, dict):
        raise InputError("body", "must be a JSON object")
    return body
