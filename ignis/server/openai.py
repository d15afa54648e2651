"""`/v1/completions` and `/v1/chat/completions`: OpenAI's request and response shapes over AsyncLLM.

Owns: parsing and checking a request into prompts and SamplingParams, the JSON response and the SSE chunk
envelopes (with `usage` and llama.cpp-style `timings`), and when an error becomes a status (before the first
event) or an SSE error event (after). A streaming response starts only once the first output (or refusal) is
there, so a full queue or bad prompt is still a 400/503, not a broken stream. Does not own: merging, disconnects
and sums (ignis.server.generation), tools, reasoning and structured output (ignis.server.chat), or the routes' app
(ignis.server.app).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ignis.client.async_llm import AsyncLLM, StreamOutput
from ignis.errors import InputError, IgnisError
from ignis.server import chat
from ignis.server.errors import ModelNotFound, error_event
from ignis.server.generation import (
    Choice,
    chat_logprobs,
    collect,
    completion_logprobs,
    finish_reason,
    merged,
    timings,
    until_disconnect,
    usage,
)
from ignis.server.limits import Limits, check_fit, check_stop_ids
from ignis.server.schemas import ChatCompletionRequest, CompletionRequest, decode_body, sampling_params

Events = AsyncGenerator[tuple[int, StreamOutput], None]


def _json(body: dict) -> Response:
    return Response(msgspec.json.encode(body), media_type="application/json")


def _sse(body: dict) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


def check_model(llm: AsyncLLM, asked: str | None) -> str:
    served = llm.client.info.model_name
    if asked and asked != served:
        raise ModelNotFound(asked, served)
    return served


async def completions(request: Request, llm: AsyncLLM) -> Response:
    req = decode_body(await request.body(), CompletionRequest)
    req.check()
    model = check_model(llm, req.model)
    given, limits = req.prompts(), Limits.of(llm.config, llm.client.info.context)
    limits.check_counts(n=req.n, prompts=len(given), stop=req.stop)
    params = sampling_params(req, max_tokens=16 if req.max_tokens is None else req.max_tokens, logprobs=req.logprobs,
                             structured=chat.structured(None, req.structured_outputs, False))
    check_stop_ids(params, llm.client.info.vocab_size)
    prompts = []
    for i, p in enumerate(given):
        field = "prompt" if len(given) == 1 else f"prompt[{i}]"
        try:
            if isinstance(p, str):
                limits.check_text(field, p)
            prompts.append(await asyncio.to_thread(llm.prompt_ids, p))  # a long prompt must not stall other streams
        except InputError as e:
            raise InputError(e.field if len(given) == 1 else field, e.message) from None
        check_fit(params, len(prompts[-1]), context=llm.client.info.context)
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": model}
    count = len(prompts) * params.n
    offsets = [0] * count

    def logprobs_of(index: int, token_ids: list[int], lps: list[dict[int, float]]) -> dict | None:
        if params.logprobs is None:
            return None
        out = completion_logprobs(llm.tokenizer, token_ids, lps, params.logprobs, offsets[index])
        offsets[index] += sum(len(t) for t in out["tokens"])
        return out

    if not req.stream:
        choices = await until_disconnect(request, collect(merged(llm, prompts, params), count))
        return _json({
            **head,
            "choices": [
                {"index": i, "text": c.text, "logprobs": logprobs_of(i, c.token_ids, c.logprobs),
                 "finish_reason": c.finish_reason}
                for i, c in enumerate(choices)
            ],
            "usage": usage(prompts, sum(len(c.token_ids) for c in choices), [c.stats for c in choices]),
            "timings": timings(prompts, [c.stats for c in choices]),
        })

    def chunk(index: int, o: StreamOutput) -> dict | None:
        if not o.text and not o.finished:
            return None  # text held back (a possible stop string, a split character): nothing to say yet
        body: dict[str, Any] = {
            **head,
            "choices": [{"index": index, "text": o.text, "logprobs": logprobs_of(index, o.token_ids, o.logprobs or []),
                         "finish_reason": finish_reason(o.finish_reason) if o.finished else None}],
        }
        if o.finished:
            body["timings"] = timings([prompts[index // params.n]], [o.stats])
        return body

    return await _stream(request, merged(llm, prompts, params), chunk, head, prompts, count,
                         req.stream_options is not None and req.stream_options.include_usage)


async def chat_completions(request: Request, llm: AsyncLLM) -> Response:
    req = decode_body(await request.body(), ChatCompletionRequest)
    req.check()
    model = check_model(llm, req.model)
    limits = Limits.of(llm.config, llm.client.info.context)
    limits.check_counts(n=req.n, prompts=1, stop=req.stop)
    limits.check_text("messages", "".join(m["content"] for m in req.conversation()))
    # Rendering and tokenizing a long conversation must not stall the other streams of this front-end.
    p = await asyncio.to_thread(chat.plan, req, llm.tokenizer)
    ids = await asyncio.to_thread(llm.prompt_ids, p.prompt)
    given = next(((f, m) for f, m in (("max_completion_tokens", req.max_completion_tokens),
                                      ("max_tokens", req.max_tokens)) if m is not None), None)
    limit = given[1] if given else llm.client.info.context - len(ids)  # unset: up to the end of the context
    top = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, max_tokens=limit, logprobs=top, structured=p.structured)
    check_stop_ids(params, llm.client.info.vocab_size)
    check_fit(params, len(ids), context=llm.client.info.context, field=given[0] if given else "messages")
    prompts = [ids]
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model}

    def logprobs_of(token_ids: list[int], lps: list[dict[int, float]]) -> dict | None:
        return None if top is None else chat_logprobs(llm.tokenizer, token_ids, lps, top)

    if not req.stream:
        choices = await until_disconnect(request, collect(merged(llm, prompts, params), params.n))
        messages = [chat.message(p, c.text, c.finish_reason) for c in choices]
        return _json({
            **head, "object": "chat.completion",
            "choices": [
                {"index": i, "message": msg, "logprobs": logprobs_of(c.token_ids, c.logprobs), "finish_reason": reason}
                for i, (c, (msg, reason)) in enumerate(zip(choices, messages))
            ],
            "usage": usage(prompts, sum(len(c.token_ids) for c in choices), [c.stats for c in choices]),
            "timings": timings(prompts, [c.stats for c in choices]),
        })

    streams: dict[int, chat.DeltaStream] = {}

    def chunk(index: int, o: StreamOutput) -> dict | None:
        ds = streams.setdefault(index, chat.DeltaStream(p))
        delta = ds.feed(o.text, o.finished)
        if delta is None and not o.finished:
            return None
        body: dict[str, Any] = {
            **head, "object": "chat.completion.chunk",
            "choices": [{"index": index, "delta": delta or {}, "logprobs": logprobs_of(o.token_ids, o.logprobs or []),
                         "finish_reason": ds.finish_reason(finish_reason(o.finish_reason)) if o.finished else None}],
        }
        if o.finished:
            body["timings"] = timings(prompts, [o.stats])
        return body

    return await _stream(request, merged(llm, prompts, params), chunk, {**head, "object": "chat.completion.chunk"},
                         prompts, params.n, req.stream_options is not None and req.stream_options.include_usage)


async def _stream(
    request: Request,
    events: Events,
    chunk: Callable[[int, StreamOutput], dict | None],
    head: dict,
    prompts: list[list[int]],
    count: int,
    include_usage: bool,
) -> Response:
    """SSE once the first output is there; errors before it are plain error responses, after it SSE events."""
    try:
        first = await until_disconnect(request, anext(events))
    except BaseException:
        await events.aclose()
        raise
    choices = [Choice() for _ in range(count)]

    async def body() -> AsyncIterator[bytes]:
        try:
            item: tuple[int, StreamOutput] | None = first
            while item is not None:
                index, o = item
                choices[index].add(o)
                c = chunk(index, o)
                if c is not None:
                    yield _sse(c)
                item = await anext(events, None)
            if include_usage:
                yield _sse({**head, "choices": [],
                            "usage": usage(prompts, sum(len(c.token_ids) for c in choices), [c.stats for c in choices]),
                            "timings": timings(prompts, [c.stats for c in choices])})
        except IgnisError as e:
            yield error_event(e)
        finally:
            await events.aclose()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
