"""What coding agents send, through the official openai client against `ignis serve` (built-in model, dflash2 at 7):
tool-call round trips streamed and not, forced tool_choice, JSON Schema output, penalties, and the endpoints around.

The built-in model is a tiny code model: it does not call tools on its own, so calls are forced by tool_choice
(whose grammar makes the model write a well-formed call) and parsed from what it wrote.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from agent_server import agents_url  # noqa: F401  (the shared server)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                        "days": {"type": "integer", "minimum": 1, "maximum": 9}},
                       "required": ["city", "days"], "additionalProperties": False},
    },
}
READ = {"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string", "maxLength": 30}}, "required": ["path"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "tags": {"type": "array", "items": {"enum": ["io", "cpu"]}, "maxItems": 3}},
          "required": ["name", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def url(agents_url: str) -> str:
    return agents_url


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _args(call: Any) -> dict:
    return json.loads(call.function.arguments)


def test_a_tool_call_round_trip(client: openai.OpenAI) -> None:
    """Request with tools -> parsed tool_calls -> a tool turn -> a final answer; required and named choices."""
    m = model(client)
    first = client.chat.completions.create(model=m, messages=ASK, tools=[WEATHER, READ], tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=60, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and calls[0].id.startswith("call_") and calls[0].type == "function"
    for c in calls:
        spec = WEATHER if c.function.name == "get_weather" else READ
        jsonschema.validate(_args(c), spec["function"]["parameters"])  # type: ignore[index]
    named = client.chat.completions.create(model=m, messages=ASK, tools=[WEATHER, READ], max_tokens=60, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "read_file"}},
                                           parallel_tool_calls=False)
    assert [c.function.name for c in named.choices[0].message.tool_calls] == ["read_file"]
    history = ASK + [choice.message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": json.dumps({"sky": "clear", "c": 21})} for c in calls]
    final = client.chat.completions.create(model=m, messages=history, tools=[WEATHER, READ], max_tokens=8,
                                           temperature=0)
    assert final.choices[0].message.tool_calls is None and final.choices[0].message.content
    assert final.choices[0].finish_reason in ("stop", "length")
    rendered = httpx.post(f"{client.base_url}".replace("/v1/", "/tokenize"),
                          json={"messages": history}).json()
    assert rendered["count"] > 0


def test_a_streamed_tool_call_round_trip(client: openai.OpenAI) -> None:
    m = model(client)
    stream = client.chat.completions.create(model=m, messages=ASK, tools=[WEATHER], tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=60, temperature=0, stream=True)
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in stream:
        for d in chunk.choices[0].delta.tool_calls or []:
            c = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            c["id"] += d.id or ""
            c["name"] += (d.function.name or "") if d.function else ""
            c["arguments"] += (d.function.arguments or "") if d.function else ""
        reasons.append(chunk.choices[0].finish_reason)
    assert reasons[-1] == "tool_calls" and calls[0]["name"] == "get_weather"
    unstreamed = client.chat.completions.create(model=m, messages=ASK, tools=[WEATHER], tool_choice="required",
                                                parallel_tool_calls=False, max_tokens=60, temperature=0)
    assert [json.loads(c["arguments"]) for c in calls.values()] == \
        [_args(c) for c in unstreamed.choices[0].message.tool_calls]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in calls.values()]}, {"role": "tool", "tool_call_id": calls[0]["id"], "content": "sunny"}]
    text = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model=m, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=8, temperature=0, stream=True))
    assert text


def test_json_schema_output_validates_at_temperature_0_and_1(client: openai.OpenAI) -> None:
    """(Equality with speculation off at temperature 0: tests/test_logits.py, on the engine.)"""
    m = model(client)
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}}
    msgs = [{"role": "user", "content": "Describe a module as JSON."}]
    greedy = client.chat.completions.create(model=m, messages=msgs, response_format=fmt, max_tokens=80, temperature=0)
    jsonschema.validate(json.loads(greedy.choices[0].message.content or ""), SCHEMA)
    assert greedy.choices[0].finish_reason == "stop"
    assert greedy.timings["draft_n_accepted"] > 0  # type: ignore[attr-defined]
    sampled = client.chat.completions.create(model=m, messages=msgs, response_format=fmt, max_tokens=80,
                                             temperature=1, seed=1)
    jsonschema.validate(json.loads(sampled.choices[0].message.content or ""), SCHEMA)
    obj = client.chat.completions.create(model=m, messages=msgs, response_format={"type": "json_object"},
                                         max_tokens=60, temperature=0, frequency_penalty=1.0)
    assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)


def test_penalties_change_the_output(client: openai.OpenAI) -> None:
    m = model(client)
    kw: dict[str, Any] = dict(model=m, prompt="def parse(line):", max_tokens=24, temperature=0)
    base = client.completions.create(**kw).choices[0].text
    for extra in ({"presence_penalty": 1.5}, {"extra_body": {"repetition_penalty": 1.6}}):
        assert client.completions.create(**kw, **extra).choices[0].text != base, extra
    kw["prompt"] = "def parse(line):\n"  # after the colon the first token is whitespace, the start of other tokens
    banned = client.completions.create(**{**kw, "max_tokens": 1}).choices[0]
    ids = httpx.post(f"{client.base_url}".replace("/v1/", "/tokenize"), json={"prompt": banned.text}).json()["tokens"]
    out = client.completions.create(**kw, logit_bias={str(ids[0]): -100}).choices[0].text
    assert not out.startswith(banned.text)


def test_the_500s_agents_hit_are_400s_or_work(client: openai.OpenAI, url: str) -> None:
    m = model(client)
    none = client.chat.completions.create(model=m, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=4)
    assert none.choices[0].message.tool_calls is None
    bare = client.chat.completions.create(model=m, messages=ASK, max_tokens=4,
                                          extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
    assert bare.choices[0].finish_reason in ("stop", "length")
    cases = [
        ({"messages": ASK, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"messages": [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
         "messages[0].tool_calls[0].function.arguments"),
        ({"messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
         "response_format"),
        ({"messages": ASK, "functions": [{"name": "f"}]}, "functions"),
        ({"messages": ASK, "logit_bias": {"x": 1}}, "logit_bias"),
        ({"messages": ASK, "presence_penalty": 7}, "presence_penalty"),
    ]
    for body, param in cases:
        r = httpx.post(f"{url}/v1/chat/completions", json={"max_tokens": 2, **body}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "echo": True}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
    ok = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "messages": ASK, "max_tokens": 2, "user": "u1", "metadata": {"k": "v"}, "store": False})
    assert ok.status_code == 200


def test_models_by_id_and_responses(client: openai.OpenAI, url: str) -> None:
    m = model(client)
    assert client.models.retrieve(m).id == m
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    r = client.responses.create(model=m, input="def add(a, b):", max_output_tokens=8, temperature=0)
    assert r.status in ("completed", "incomplete") and r.output_text and r.usage and r.usage.output_tokens > 0
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}  # type: ignore[index]
    called = client.responses.create(model=m, input=ASK, tools=[tool], tool_choice="required",  # type: ignore[arg-type, list-item]
                                     max_output_tokens=60, temperature=0)
    fc = [o for o in called.output if o.type == "function_call"]
    assert fc and fc[0].name == "get_weather" and "city" in json.loads(fc[0].arguments)
    answer = client.responses.create(model=m, tools=[tool], max_output_tokens=6, temperature=0, input=[  # type: ignore[list-item]
        *ASK, {"type": "function_call", "call_id": fc[0].call_id, "name": fc[0].name, "arguments": fc[0].arguments},
        {"type": "function_call_output", "call_id": fc[0].call_id, "output": "sunny"}])
    assert answer.output_text
    events = list(client.responses.create(model=m, input="def add(a, b):", max_output_tokens=8, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text
    refused = httpx.post(f"{url}/v1/responses", json={"input": "x", "previous_response_id": "resp_1"}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "previous_response_id"
