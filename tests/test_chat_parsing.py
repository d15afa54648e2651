"""Tool calls, reasoning and templates on scripted model outputs: the tiny built-in model cannot write them itself."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import llguidance
import pytest

from ignis.artifact import BUILTIN
from ignis.errors import InputError
from ignis.server import chat
from ignis.server.reasoning import split_reasoning
from ignis.server.toolcalls import HermesParser, Qwen3XmlParser, parser_for_template, split_tool_calls
from ignis.structured import grammar_text
from ignis.tokenizer import Tokenizer

QWEN35 = (Path(__file__).parent / "templates" / "qwen35_style.jinja").read_text()
BUILTIN_TOK = Tokenizer.from_dir(BUILTIN)
TOOLS = [
    {"name": "get_weather", "description": "Weather of a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                    "required": ["city", "days"]}},
    {"name": "read_file", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}},
]
HERMES_TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
               '<tool_call>\n{"name": "read_file", "arguments": {"path": "a <b>.txt"}}\n</tool_call>')
XML_TEXT = ('<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n'
            '</parameter>\n</function>\n</tool_call>')
WANT = [("get_weather", {"city": "Paris", "days": 3}), ("read_file", {"path": "a <b>.txt"})]


def qwen35_tokenizer() -> Tokenizer:
    return Tokenizer(BUILTIN_TOK._tok, {**BUILTIN_TOK.config, "chat_template": QWEN35}, BUILTIN_TOK.eos_token_ids)


def chunks(text: str, seed: int) -> list[str]:
    rng, out, i = random.Random(seed), [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        out.append(text[i : i + n])
        i += n
    return out


def streamed(p: chat.ChatPlan, text: str, seed: int) -> tuple[str, str, list[dict]]:
    ds = chat.DeltaStream(p)
    reasoning, content, calls = "", "", []
    pieces = chunks(text, seed)
    for k, piece in enumerate(pieces):
        d = ds.feed(piece, k == len(pieces) - 1) or {}
        reasoning += d.get("reasoning_content", "")
        content += d.get("content", "")
        calls += d.get("tool_calls", [])
    return reasoning, content, calls


def plan(tools: list[dict] | None = None, *, reasoning: bool = False, think_open: bool = False,
         parser: Any = None) -> chat.ChatPlan:
    return chat.ChatPlan("", tools or TOOLS, True, parser or HermesParser(), reasoning, think_open, None)


def test_hermes_calls_parse_whole_and_streamed_in_any_chunking() -> None:
    content, calls = split_tool_calls(HERMES_TEXT, HermesParser(), TOOLS)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == WANT
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    p = plan()
    msg, reason = chat.message(p, HERMES_TEXT, "stop")
    assert reason == "tool_calls" and msg["content"] == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == WANT
    for seed in range(20):
        _, text, deltas = streamed(p, HERMES_TEXT, seed)
        assert text.strip() == "Let me check."
        assert [(d["index"], d["function"]["name"], json.loads(d["function"]["arguments"])) for d in deltas] == \
            [(i, n, a) for i, (n, a) in enumerate(WANT)]


def test_text_that_only_looks_like_a_call_stays_content() -> None:
    for text in ("a < b and <tool_ is not a call", "<tool_call>\nnot json\n</tool_call> after", "x <tool_call>{\"name\""):
        content, calls = split_tool_calls(text, HermesParser(), TOOLS)
        assert calls == [] and content == text, text
        for seed in range(5):
            assert streamed(plan(), text, seed)[1:] == (text, [])


def test_qwen35_xml_calls_parse_with_typed_arguments() -> None:
    content, calls = split_tool_calls("Sure." + XML_TEXT, Qwen3XmlParser(), TOOLS)
    assert content == "Sure." and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "New York", "days": 3}
    p = plan(parser=Qwen3XmlParser())
    for seed in range(10):
        _, _, deltas = streamed(p, XML_TEXT, seed)
        assert json.loads(deltas[0]["function"]["arguments"]) == {"city": "New York", "days": 3}
    assert isinstance(parser_for_template(QWEN35), Qwen3XmlParser)
    assert isinstance(parser_for_template(BUILTIN_TOK.chat_template), HermesParser)


def test_reasoning_is_split_whole_and_streamed() -> None:
    answer = "I should look it up.\nTwo steps.\n</think>\n\nThe answer is 4."
    assert split_reasoning(answer, True) == ("I should look it up.\nTwo steps.\n", "The answer is 4.")
    assert split_reasoning("<think>hmm</think>ok", False) == ("hmm", "ok")
    assert split_reasoning("no thinking here", False) == ("", "no thinking here")
    for seed in range(20):
        r, c, _ = streamed(plan(reasoning=True, think_open=True), answer, seed)
        assert (r, c) == ("I should look it up.\nTwo steps.\n", "The answer is 4.")
        r, c, calls = streamed(plan(reasoning=True, think_open=True), "plan it</think>\n\n" + HERMES_TEXT, seed)
        assert r == "plan it" and c.strip() == "Let me check." and len(calls) == 2


def test_forced_call_grammars_accept_exactly_calls_of_the_named_tools() -> None:
    tok = llguidance.LLTokenizer(str(BUILTIN / "tokenizer.json"), n_vocab=8192, eos_token=[2])
    from ignis.params import StructuredOutputs

    def accepts(grammar: str, text: str) -> bool:
        m = llguidance.LLMatcher(tok, grammar_text(StructuredOutputs(grammar=grammar)))
        return m.consume_tokens(tok.tokenize_str(text)) and m.is_accepting()

    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    assert accepts(HermesParser().grammar(TOOLS, True, False), one)
    assert accepts(HermesParser().grammar(TOOLS, True, False), HERMES_TEXT[len("Let me check.\n"):])
    assert not accepts(HermesParser().grammar(TOOLS[1:], True, False), one)  # named: read_file only
    assert not accepts(HermesParser().grammar(TOOLS, True, False), one.replace('"days": 3', '"days": "3"'))
    assert accepts(HermesParser().grammar(TOOLS, False, True), "think first</think>\n\n" + one)
    assert accepts(Qwen3XmlParser().grammar(TOOLS, False, False), XML_TEXT)


def request(**kw: Any) -> Any:
    base: dict[str, Any] = dict(tools=None, tool_choice=None, chat_template_kwargs=None, add_generation_prompt=True,
                                response_format=None, structured_outputs=None, parallel_tool_calls=None)
    base.update(kw)
    messages = base.pop("messages")
    return SimpleNamespace(conversation=lambda: messages, **base)


HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


def test_a_qwen35_template_renders_tool_history_sent_as_json_strings() -> None:
    # Before: "Can only get item pairs from a mapping" (a 500), as `arguments|items` met OpenAI's JSON string.
    tools = [{"type": "function", "function": t} for t in TOOLS]
    p = chat.plan(request(messages=[{**m, "content": m["content"] or ""} for m in HISTORY], tools=tools), qwen35_tokenizer())
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>" in p.prompt
    assert "<tool_response>\nsunny\n</tool_response>" in p.prompt and '"name": "read_file"' in p.prompt
    assert p.prompt.endswith("<think>\n") and p.think_open and p.reasoning
    off = chat.plan(request(messages=HISTORY[:1], chat_template_kwargs={"enable_thinking": False}), qwen35_tokenizer())
    assert off.prompt.endswith("<think>\n\n</think>\n\n") and not off.think_open
    bare = chat.plan(request(messages=HISTORY[:1], chat_template_kwargs={"add_generation_prompt": False}), BUILTIN_TOK)
    assert bare.prompt == "<|im_start|>user\nWeather in Paris?<|im_end|>\n"


def test_template_and_tool_errors_are_input_errors_naming_the_field() -> None:
    bad = [
        (dict(messages=[{"role": "user", "content": "x"}], chat_template_kwargs={"messages": []}), "chat_template_kwargs"),
        (dict(messages=[{"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "f", "arguments": "{not json"}}]}]), "messages[0].tool_calls[0].function.arguments"),
        (dict(messages=[{"role": "user", "content": "x"}], tools=[{"type": "function"}]), "tools[0]"),
        (dict(messages=[{"role": "user", "content": "x"}], tool_choice="required"), "tool_choice"),
        (dict(messages=[{"role": "user", "content": "x"}], tools=[{"type": "function", "function": TOOLS[0]}],
              tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(messages=[{"role": "user", "content": "x"}], response_format={"type": "json_schema",
              "json_schema": {"name": "x", "schema": {"type": "objectx"}}}), "response_format"),
    ]
    for kw, field in bad:
        with pytest.raises(InputError) as e:
            chat.plan(request(**kw), BUILTIN_TOK)
        assert e.value.field == field, (kw, e.value)
    broken = Tokenizer(BUILTIN_TOK._tok, {**BUILTIN_TOK.config, "chat_template": "{% for k, v in messages[0].content | items %}{{ k }}{% endfor %}"}, (2,))
    with pytest.raises(InputError, match="could not render"):
        broken.apply_chat_template([{"role": "user", "content": "x"}])
