"""The server's OpenAPI 3.1 document, served at `/openapi.json`, built from the request structs the routes decode.

Owns: the paths, their request bodies (the msgspec structs of ignis.server.schemas, so the document cannot drift
from what is parsed), and the statuses each route may answer with, errors in OpenAI's shape. Does not own: the
routes (ignis.server.app) or validation (the structs, ignis.server.limits). Schema-driven fuzzing
(schemathesis, in the tests) reads this document.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ignis.server.responses import ResponsesRequest
from ignis.server.schemas import ChatCompletionRequest, CompletionRequest


class TokenizeRequest(msgspec.Struct, kw_only=True):
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[int]


class _ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    error: _ErrorDetail


_REFUSALS = {
    "400": "bad input: the error's param names the field",
    "401": "no valid API key (server.api_key)",
    "403": "a browser Origin that is not allowed (server.cors_origins)",
    "404": "an unknown model",
    "413": "a body larger than server.max_body_bytes",
    "415": "a body that is not JSON",
    "503": "the queue is full, the engine is down or restarting, or the server drains (see Retry-After)",
}


def document(version: str) -> dict[str, Any]:
    structs = [CompletionRequest, ChatCompletionRequest, ResponsesRequest, TokenizeRequest, DetokenizeRequest,
               ErrorResponse]
    refs, components = msgspec.json.schema_components(structs, ref_template="#/components/schemas/{name}")
    completion, chat, responses_, tokenize, detokenize, error = refs

    def responses(ok: dict[str, Any], *codes: str) -> dict[str, Any]:
        out: dict[str, Any] = {"200": {"description": "OK", "content": ok}}
        for code in codes:
            out[code] = {"description": _REFUSALS[code], "content": {"application/json": {"schema": error}}}
        return out

    obj = {"application/json": {"schema": {"type": "object"}}}
    # A stream is server-sent events, each a chunk in `data` (the last one "[DONE]").
    event = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}
    generated = {**obj, "text/event-stream": {"schema": event}}
    guarded = ("400", "401", "403", "413", "415", "503")

    def post(summary: str, body: dict[str, Any], ok: dict[str, Any], *codes: str) -> dict[str, Any]:
        return {"post": {"summary": summary, "requestBody": {"required": True, "content": {"application/json": {
            "schema": body}}}, "responses": responses(ok, *codes)}}

    def get(summary: str, ok: dict[str, Any], *codes: str) -> dict[str, Any]:
        return {"get": {"summary": summary, "responses": responses(ok, *codes)}}

    return {
        "openapi": "3.1.0",
        "info": {"title": "ignis", "version": version},
        "paths": {
            "/v1/completions": post("Text completions", completion, generated, *guarded, "404"),
            "/v1/chat/completions": post("Chat completions", chat, generated, *guarded, "404"),
            "/v1/responses": post("Responses (stateless)", responses_, generated, *guarded, "404"),
            "/tokenize": post("Token ids of a prompt or conversation", tokenize, obj, *guarded),
            "/detokenize": post("Text of token ids", detokenize, obj, *guarded),
            "/v1/models": get("The served model", obj, "400", "401", "403", "503"),
            "/v1/models/{model_id}": {"get": {
                "summary": "One model", "parameters": [{"name": "model_id", "in": "path", "required": True,
                                                       "schema": {"type": "string"}}],
                "responses": responses(obj, "400", "401", "403", "404", "503")}},
            "/health": get("Whether the engine serves", obj, "400", "503"),
            "/metrics": get("Prometheus metrics", {"text/plain": {"schema": {"type": "string"}}},
                            "400", "401", "403", "503"),
        },
        "components": {"schemas": components},
    }
