"""`/v1/responses`, the stateless subset: text, function tools and streaming, over the chat pipeline.

Owns: the Responses request (input items, instructions, function tools, tool_choice, text.format) turned into a chat
request, and the response object and its stream of typed events (`response.created` ... `response.completed`).
Left out, and refused with a 400 rather than ignored: `previous_response_id` and `conversation` (nothing is stored;
send the whole input each time), `background`, built-in tools (web search, file search, code interpreter, ...),
prompt templates (`prompt`), and non-text input parts. `store` and `metadata` are accepted; nothing is kept.
Does not own: templates, parsing or grammars (ignis.server.chat) or sampling (ignis.server.schemas).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ignis.client.async_llm import AsyncLLM
from ignis.errors import IgnisError, InputError
from ignis.ipc.messages import RequestStats
from ignis.server import chat
from ignis.server.errors import describe
from ignis.server.openai import check_model
from ignis.server.generation import collect, merged, until_disconnect, usage
from ignis.server.limits import Limits, check_fit, check_stop_ids
from ignis.server.schemas import ChatCompletionRequest, decode_body, sampling_params


class ResponsesRequest(msgspec.Struct, kw_only=True):
    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    truncation: str | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    reasoning: dict[str, Any] | None = None

    def check(self) -> None:
        for name in ("previous_response_id", "conversation", "prompt"):
            if getattr(self, name) is not None:
                raise InputError(name, "is not supported: ignis keeps no state; send the whole conversation as input")
        if self.background:
            raise InputError("background", "is not supported by ignis")
        if self.truncation not in (None, "disabled"):
            raise InputError("truncation", "only 'disabled' is supported")

    def as_chat(self) -> ChatCompletionRequest:
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        for i, item in enumerate(items):
            kind = item.get("type", "message")
            if kind == "message":
                role = item.get("role")
                if role not in ("user", "assistant", "system", "developer"):
                    raise InputError(f"input[{i}].role", "must be user, assistant, system or developer")
                messages.append({"role": "system" if role == "developer" else role, "content": _text(item, i)})
            elif kind == "function_call":
                call = {"id": item.get("call_id"), "type": "function",
                        "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                    last["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif kind == "function_call_output":
                out = item.get("output")
                messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                                 "content": out if isinstance(out, str) else msgspec.json.encode(out).decode()})
            elif kind == "reasoning":
                continue  # earlier reasoning is not replayed into the prompt
            else:
                raise InputError(f"input[{i}].type", f"{kind!r} is not supported (message, function_call, "
                                                     "function_call_output)")
        tools = []
        for i, t in enumerate(self.tools or []):
            if t.get("type") != "function":
                raise InputError(f"tools[{i}].type", f"{t.get('type')!r} is not supported; only function tools")
            tools.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                           if k in t}})
        choice = self.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function":
            choice = {"type": "function", "function": {"name": choice.get("name")}}
        fmt = (self.text or {}).get("format")
        response_format = None
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            response_format = {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}
        elif isinstance(fmt, dict):
            response_format = {"type": fmt.get("type", "text")}
        return ChatCompletionRequest(
            messages=messages, model=self.model, tools=tools or None, tool_choice=choice,
            parallel_tool_calls=self.parallel_tool_calls, max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature, top_p=self.top_p, response_format=response_format, user=self.user,
        )


def _text(item: dict[str, Any], i: int) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    parts = []
    for part in content or []:
        if not (isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text")):
            raise InputError(f"input[{i}].content", "only text parts are supported")
        parts.append(part.get("text", ""))
    return "".join(parts)


def _items(msg: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if msg.get("reasoning_content"):
        out.append({"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                    "content": [{"type": "reasoning_text", "text": msg["reasoning_content"]}]})
    if msg.get("content"):
        out.append(_message(msg["content"]))
    for c in msg.get("tool_calls") or []:
        out.append(_call(c))
    return out


def _message(text: str) -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call(c: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": c["id"], "name": c["function"]["name"],
            "arguments": c["function"]["arguments"], "status": "completed"}


async def responses(request: Request, llm: AsyncLLM) -> Response:
    req = decode_body(await request.body(), ResponsesRequest)
    req.check()
    creq = req.as_chat()
    creq.check()
    model = check_model(llm, req.model)
    limits = Limits.of(llm.config, llm.client.info.context)
    limits.check_counts(n=creq.n, prompts=1, stop=creq.stop)
    limits.check_text("input", "".join(m["content"] for m in creq.conversation()))
    p = await asyncio.to_thread(chat.plan, creq, llm.tokenizer)  # off the event loop, as chat does
    ids = await asyncio.to_thread(llm.prompt_ids, p.prompt)
    limit = req.max_output_tokens if req.max_output_tokens is not None else llm.client.info.context - len(ids)
    params = sampling_params(creq, max_tokens=limit, logprobs=None, structured=p.structured)
    check_stop_ids(params, llm.client.info.vocab_size)
    check_fit(params, len(ids), context=llm.client.info.context, field="max_output_tokens")
    head: dict[str, Any] = {
        "id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()), "model": model,
        "instructions": req.instructions, "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
        "parallel_tool_calls": req.parallel_tool_calls is not False, "temperature": req.temperature,
        "top_p": req.top_p, "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {},
        "text": req.text or {"format": {"type": "text"}}, "store": False, "error": None,
    }

    def final(output: list[dict], reason: str | None, completion_tokens: int,
              stats: RequestStats | None) -> dict[str, Any]:
        u = usage([ids], completion_tokens, [stats])
        return {**head, "status": "incomplete" if reason == "length" else "completed", "output": output,
                "incomplete_details": {"reason": "max_output_tokens"} if reason == "length" else None,
                "usage": {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
                          "total_tokens": u["total_tokens"], "input_tokens_details": u["prompt_tokens_details"],
                          "output_tokens_details": {"reasoning_tokens": 0}}}

    if not req.stream:
        c = (await until_disconnect(request, collect(merged(llm, [ids], params), 1)))[0]
        msg, reason = chat.message(p, c.text, c.finish_reason)
        return Response(msgspec.json.encode(final(_items(msg), reason, len(c.token_ids), c.stats)), media_type="application/json")

    events = merged(llm, [ids], params)
    try:
        first = await until_disconnect(request, anext(events))
    except BaseException:
        await events.aclose()
        raise
    return StreamingResponse(_events(first, events, p, head, final), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def _events(first: Any, events: Any, p: chat.ChatPlan, head: dict, final: Any) -> AsyncIterator[bytes]:
    """Typed events: each output item is opened, filled with deltas and closed in turn."""
    seq = 0
    output: list[dict] = []
    open_item: dict[str, Any] | None = None
    text = ""

    def event(kind: str, **body: Any) -> bytes:
        nonlocal seq
        seq += 1
        data = {"type": kind, "sequence_number": seq - 1, **body}
        return f"event: {kind}\n".encode() + b"data: " + msgspec.json.encode(data) + b"\n\n"

    def close() -> list[bytes]:
        nonlocal open_item, text
        if open_item is None:
            return []
        idx, item, out = len(output), open_item, []
        if item["type"] == "message":
            item["content"] = [{"type": "output_text", "text": text, "annotations": []}]
            out += [event("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0, text=text),
                    event("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0,
                          part=item["content"][0])]
        else:
            item["content"] = [{"type": "reasoning_text", "text": text}]
            out.append(event("response.reasoning_text.done", item_id=item["id"], output_index=idx, content_index=0,
                             text=text))
        item["status"] = "completed"
        out.append(event("response.output_item.done", output_index=idx, item=item))
        output.append(item)
        open_item, text = None, ""
        return out

    def add(kind: str, piece: str) -> list[bytes]:
        nonlocal open_item, text
        out: list[bytes] = []
        if open_item is not None and open_item["type"] != kind:
            out += close()
        idx = len(output)
        if open_item is None:
            if kind == "message":
                open_item = {**_message(""), "status": "in_progress", "content": []}
                out += [event("response.output_item.added", output_index=idx, item=open_item),
                        event("response.content_part.added", item_id=open_item["id"], output_index=idx,
                              content_index=0, part={"type": "output_text", "text": "", "annotations": []})]
            else:
                open_item = {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [], "content": []}
                out.append(event("response.output_item.added", output_index=idx, item=open_item))
        text += piece
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        out.append(event(name, item_id=open_item["id"], output_index=idx, content_index=0, delta=piece))
        return out

    yield event("response.created", response={**head, "status": "in_progress", "output": []})
    yield event("response.in_progress", response={**head, "status": "in_progress", "output": []})
    ds, tokens, reason, stats = chat.DeltaStream(p), 0, None, None
    try:
        item = first
        while item is not None:
            _, o = item
            tokens += len(o.token_ids)
            delta = ds.feed(o.text, o.finished) or {}
            for b in add("reasoning", delta["reasoning_content"]) if delta.get("reasoning_content") else []:
                yield b
            for b in add("message", delta["content"]) if delta.get("content") else []:
                yield b
            for call in delta.get("tool_calls") or []:
                for b in close():
                    yield b
                fc, idx = _call(call), len(output)
                yield event("response.output_item.added", output_index=idx, item={**fc, "arguments": "", "status": "in_progress"})
                yield event("response.function_call_arguments.delta", item_id=fc["id"], output_index=idx,
                            delta=fc["arguments"])
                yield event("response.function_call_arguments.done", item_id=fc["id"], output_index=idx,
                            arguments=fc["arguments"])
                yield event("response.output_item.done", output_index=idx, item=fc)
                output.append(fc)
            if o.finished:
                reason, stats = o.finish_reason, o.stats
            item = await anext(events, None)
        for b in close():
            yield b
        done = final(output, "length" if reason == "length" else "stop", tokens, stats)
        kind = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
        yield event(kind, response=done)
    except IgnisError as e:
        yield event("error", **describe(e)[1]["error"])
    finally:
        await events.aclose()
