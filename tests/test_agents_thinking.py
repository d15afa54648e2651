"""A thinking model's template (Qwen3.5 style: it opens <think> itself, calls tools in the XML form) behind
`ignis serve`, through the official openai client: reasoning_content split out, streamed and not, enable_thinking
passed to the template, and an XML tool call parsed. The model's text is scripted with structured_outputs (a regex
the built-in model must follow), so the split is checked on known output end to end."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from agent_server import builtin_with_template, serve

TEMPLATE = (Path(__file__).parent / "templates" / "qwen35_style.jinja").read_text()
SCRIPT = r"The user wants a sum\. 2 \+ 2 is 4\.\n</think>\n\nThe answer is 4\."
ASK = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    base = tmp_path_factory.mktemp("thinking")
    model = builtin_with_template(base / "model", TEMPLATE)
    with serve(base / "serve.log", "--set", f"model.path={model}") as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def test_reasoning_is_split_from_the_answer_streamed_and_not(client: openai.OpenAI) -> None:
    m = client.models.list().data[0].id
    kw = dict(model=m, messages=ASK, max_tokens=60, temperature=0, extra_body={"structured_outputs": {"regex": SCRIPT}})
    whole = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    msg = whole.choices[0].message
    assert msg.reasoning_content == "The user wants a sum. 2 + 2 is 4.\n"  # type: ignore[attr-defined]
    assert msg.content == "The answer is 4." and whole.choices[0].finish_reason == "stop"
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(**kw, stream=True):  # type: ignore[call-overload]
        d = chunk.choices[0].delta
        reasoning += getattr(d, "reasoning_content", None) or ""
        content += d.content or ""
    assert (reasoning, content) == (msg.reasoning_content, msg.content)  # type: ignore[attr-defined]


def test_enable_thinking_false_reaches_the_template(client: openai.OpenAI) -> None:
    m = client.models.list().data[0].id
    out = client.chat.completions.create(model=m, messages=ASK, max_tokens=12, temperature=0, extra_body={
        "chat_template_kwargs": {"enable_thinking": False}, "structured_outputs": {"regex": r"The answer is 4\."}})
    assert out.choices[0].message.content == "The answer is 4."
    assert out.choices[0].message.reasoning_content is None  # type: ignore[attr-defined]


def test_an_xml_tool_call_after_thinking(client: openai.OpenAI) -> None:
    m = client.models.list().data[0].id
    tool = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "maximum": 99}, "b": {"type": "integer", "maximum": 99}},
        "required": ["a", "b"]}}}
    out = client.chat.completions.create(model=m, messages=ASK, tools=[tool], parallel_tool_calls=False,  # type: ignore[list-item]
                                         max_tokens=60, temperature=0,
                                         tool_choice={"type": "function", "function": {"name": "add"}},
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    call = out.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "add" and set(json.loads(call.function.arguments)) == {"a", "b"}
    assert out.choices[0].finish_reason == "tool_calls"
