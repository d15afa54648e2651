"""What a chat request means beyond its messages: tools, tool_choice, reasoning and structured output.

Owns: checking `tools` / `tool_choice` / `response_format` / `structured_outputs`, preparing the conversation for the
template (tool-call arguments sent as JSON strings become mappings, as templates iterate them), rendering the prompt
with `chat_template_kwargs` as template variables, the grammar a forced tool call or a JSON response follows, and
turning the model's text into OpenAI's message and stream deltas (`reasoning_content`, `content`, `tool_calls`).
Does not own: HTTP envelopes and streaming (ignis.server.openai), the formats themselves (ignis.server.toolcalls,
ignis.server.reasoning) or grammars' compilation (ignis.engine.grammar).
"""

from __future__ import annotations

import json

import msgspec
from dataclasses import dataclass, field
from typing import Any

from ignis.structured import JSON_OPTIONS, grammar_text
from ignis.errors import InputError
from ignis.params import StructuredOutputs
from ignis.server.reasoning import OPEN, ReasoningStream, prompt_opens_think, split_reasoning
from ignis.server.toolcalls import ToolCall, ToolParser, ToolStream, parser_for_template, split_tool_calls
from ignis.tokenizer import Tokenizer


@dataclass
class ChatPlan:
    prompt: str
    tools: list[dict]  # function objects: {"name", "description", "parameters"}
    parse_tools: bool  # tool_choice is not "none"
    parser: ToolParser
    reasoning: bool  # the template is a thinking model's: split <think> out of the answer
    think_open: bool  # the prompt ends inside a think block the template opened
    structured: StructuredOutputs | None


def functions(tools: list[Any] | None) -> list[dict]:
    out = []
    for i, t in enumerate(tools or []):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(fn, dict)
                and isinstance(fn.get("name"), str) and fn["name"]):
            raise InputError(f"tools[{i}]", "must be {'type': 'function', 'function': {'name': ..., 'parameters': {...}}}")
        if not isinstance(fn.get("parameters", {}), dict):
            raise InputError(f"tools[{i}].function.parameters", "must be a JSON Schema object")
        out.append(fn)
    return out


def chosen(tool_choice: Any, tools: list[dict]) -> tuple[str, list[dict]]:
    """(mode, tools a forced call may use): mode is none | auto | forced."""
    if tool_choice is None:
        return ("auto" if tools else "none"), tools
    if tool_choice in ("none", "auto"):
        return tool_choice, tools
    if tool_choice == "required":
        if not tools:
            raise InputError("tool_choice", "'required' needs at least one tool in 'tools'")
        return "forced", tools
    if isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        named = [t for t in tools if t["name"] == name]
        if not named:
            raise InputError("tool_choice", f"names function {name!r}, which is not in 'tools'")
        return "forced", named
    raise InputError("tool_choice", "must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}")


def template_messages(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant tool calls with their arguments as mappings (OpenAI sends JSON text; templates iterate items)."""
    out = []
    for i, m in enumerate(conversation):
        calls = m.get("tool_calls")
        if calls is None:
            out.append(m)
            continue
        if not isinstance(calls, list):
            raise InputError(f"messages[{i}].tool_calls", "must be a list")
        fixed = []
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
                raise InputError(f"messages[{i}].tool_calls[{j}]", "must have a function with a name")
            args = fn.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError as e:
                    raise InputError(f"messages[{i}].tool_calls[{j}].function.arguments", f"is not JSON: {e}") from None
            if not isinstance(args, dict):
                raise InputError(f"messages[{i}].tool_calls[{j}].function.arguments", "must be a JSON object")
            fixed.append({**c, "function": {**fn, "arguments": args}, "name": fn["name"], "arguments": args})
        out.append({**m, "tool_calls": fixed})
    return out


def structured(response_format: dict | None, extra: dict | None, think: bool) -> StructuredOutputs | None:
    """response_format (json_object, json_schema) or vLLM's structured_outputs, as one StructuredOutputs; a bad
    schema, regex or grammar is refused here, naming the field the caller used."""
    spec = None
    if response_format is not None:
        kind = response_format.get("type", "text")
        if kind == "json_object":
            spec = StructuredOutputs(json_object=True)
        elif kind == "json_schema":
            js = response_format.get("json_schema")
            schema = js.get("schema") if isinstance(js, dict) else None
            if not isinstance(schema, dict):
                raise InputError("response_format.json_schema.schema", "must be a JSON Schema object")
            spec = StructuredOutputs(json=json.dumps(schema))
        elif kind != "text":
            raise InputError("response_format.type", "must be 'text', 'json_object' or 'json_schema'")
    if extra is not None:
        if spec is not None:
            raise InputError("structured_outputs", "give either response_format or structured_outputs, not both")
        unknown = set(extra) - set(StructuredOutputs.__struct_fields__)
        if unknown:
            raise InputError("structured_outputs", f"has unknown fields {sorted(unknown)}; known: "
                                                   f"{', '.join(StructuredOutputs.__struct_fields__)}")
        try:
            spec = msgspec.convert(extra, StructuredOutputs)
        except msgspec.ValidationError as e:
            raise InputError("structured_outputs", str(e).removeprefix("structured_outputs: ")) from None
    if spec is not None:
        grammar_text(spec, "response_format" if response_format is not None else "structured_outputs")
    if spec is not None and think and (spec.json is not None or spec.json_object):
        schema = json.loads(spec.json) if spec.json is not None else {"type": "object"}
        spec = StructuredOutputs(grammar=_after_think(f"%json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}"))
    return spec


def _after_think(body: str) -> str:
    return f'start: think? body\nthink: /[^<]*/ "</think>" /\\n*/\nbody: {body}\n'


def plan(req: Any, tok: Tokenizer) -> ChatPlan:
    tools = functions(req.tools)
    mode, forced_tools = chosen(req.tool_choice, tools)
    kwargs = dict(req.chat_template_kwargs or {})
    generation_prompt = kwargs.pop("add_generation_prompt", req.add_generation_prompt)
    if tools and "tools" not in kwargs:
        kwargs["tools"] = [{"type": "function", "function": t} for t in tools]
    prompt = tok.apply_chat_template(template_messages(req.conversation()),
                                     add_generation_prompt=bool(generation_prompt), **kwargs)
    template = tok.chat_template or ""
    reasoning = "</think>" in template or OPEN in template
    think_open = reasoning and prompt_opens_think(prompt)
    parser = parser_for_template(template)
    spec = structured(req.response_format, req.structured_outputs, think_open)
    if mode == "forced":
        if spec is not None:
            raise InputError("tool_choice", "a forced tool call cannot be combined with response_format")
        spec = StructuredOutputs(grammar=parser.grammar(forced_tools, req.parallel_tool_calls is not False, think_open))
        grammar_text(spec, "tools")
    return ChatPlan(prompt, tools, mode != "none", parser, reasoning, think_open, spec)


def message(p: ChatPlan, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
    """The whole output as OpenAI's assistant message, and the finish reason ("tool_calls" when it called)."""
    reasoning, content = split_reasoning(text, p.think_open) if p.reasoning else ("", text)
    calls: list[ToolCall] = []
    if p.parse_tools:
        content, calls = split_tool_calls(content, p.parser, p.tools)
    msg: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if p.reasoning:
        msg["reasoning_content"] = reasoning or None
    if calls:
        msg["tool_calls"] = [c.as_openai() for c in calls]
    return msg, ("tool_calls" if calls and finish_reason == "stop" else finish_reason)


@dataclass
class DeltaStream:
    """One choice's text deltas -> OpenAI delta objects."""

    plan: ChatPlan
    reasoning: ReasoningStream | None = None
    tools: ToolStream | None = None
    calls: int = 0
    started: bool = False
    pending: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.plan.reasoning:
            self.reasoning = ReasoningStream(self.plan.think_open)
        if self.plan.parse_tools:
            self.tools = ToolStream(self.plan.parser, self.plan.tools)

    def feed(self, text: str, finished: bool) -> dict[str, Any] | None:
        """The delta for this much new text (None: nothing to say yet); on the last one, everything held back."""
        r, c = self.reasoning.feed(text) if self.reasoning is not None else ("", text)
        if finished and self.reasoning is not None:
            r2, c2 = self.reasoning.finish()
            r, c = r + r2, c + c2
        calls: list[ToolCall] = []
        if self.tools is not None:
            c, calls = self.tools.feed(c)
            if finished:
                c2, more = self.tools.finish()
                c, calls = c + c2, calls + more
        delta: dict[str, Any] = {}
        if not self.started:
            delta["role"] = "assistant"
            self.started = True
        if r:
            delta["reasoning_content"] = r
        if c or (not r and not calls and "role" in delta):
            delta["content"] = c
        if calls:
            delta["tool_calls"] = [call.as_openai(self.calls + i) for i, call in enumerate(calls)]
            self.calls += len(calls)
        return delta if delta else None

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.calls and reason == "stop" else reason
