"""Tool calls in the model's text: the Qwen family's formats, parsed whole or as the text streams, and forced by grammar.

Owns: the tool-call parser registry (entry-point group `ignis.tool_parsers`, like the speculation backends), the two
formats the Qwen3.5 family writes, both inside `<tool_call>...</tool_call>`:

    hermes     <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>            (Qwen2.5 / Qwen3)
    qwen3_xml  <tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>  (Qwen3.5, Qwen3-Coder)

`ToolStream`, which splits streamed text into content and complete calls, and each format's Lark grammar for a forced
call (`tool_choice` "required" or a named function). Does not own: rendering tools into the prompt (the chat
template) or the response shapes (ignis.server.chat).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Protocol

START, END = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's wire format carries it
    id: str = ""

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


class ToolParser(Protocol):
    name: str

    def parse(self, block: str, tools: dict[str, dict]) -> ToolCall | None:
        """One call from the text between <tool_call> and </tool_call>; None when it is not one."""

    def grammar(self, tools: list[dict], parallel: bool, think: bool) -> str:
        """A Lark grammar whose every sentence is one call (or several if `parallel`) of one of `tools`
        (OpenAI function objects); `think`: a reasoning block the prompt opened comes first."""


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _envelope(body: str, parallel: bool, think: bool) -> str:
    start = "start: think? calls\nthink: /[^<]*/ \"</think>\" /\\n*/\n" if think else "start: calls\n"
    calls = 'calls: call ("\\n" call)*\n' if parallel else "calls: call\n"
    return start + calls + f'call: "{START}\\n" body "\\n{END}"\n' + body


class HermesParser:
    name = "hermes"

    def parse(self, block: str, tools: dict[str, dict]) -> ToolCall | None:
        try:
            obj = json.loads(block)
        except json.JSONDecodeError:
            return None
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False), _call_id())

    def grammar(self, tools: list[dict], parallel: bool, think: bool) -> str:
        options = [
            {"type": "object", "properties": {"name": {"const": t["name"]},
                                              "arguments": t.get("parameters") or {"type": "object"}},
             "required": ["name", "arguments"], "additionalProperties": False}
            for t in tools
        ]
        schema = {"anyOf": options, "x-guidance": _COMPACT} if len(options) > 1 else {**options[0], "x-guidance": _COMPACT}
        return _envelope(f"body: %json {json.dumps(schema)}\n", parallel, think)


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


# A string parameter's text, with the newline before </parameter> (the lexer does not backtrack, so the text's
# lexeme takes that newline rather than leaving it to a literal).
_TEXT = r"/[^<]*/"


class Qwen3XmlParser:
    name = "qwen3_xml"

    def parse(self, block: str, tools: dict[str, dict]) -> ToolCall | None:
        m = _FUNCTION.search(block)
        if m is None:
            return None
        name = m.group(1).strip()
        props = (tools.get(name, {}).get("parameters") or {}).get("properties", {})
        args = {}
        for p in _PARAMETER.finditer(m.group(2)):
            key, raw = p.group(1).strip(), p.group(2)
            raw = raw[1:] if raw.startswith("\n") else raw
            raw = raw[:-1] if raw.endswith("\n") else raw
            args[key] = _typed(raw, props.get(key, {}))
        return ToolCall(name, json.dumps(args, ensure_ascii=False), _call_id())

    def grammar(self, tools: list[dict], parallel: bool, think: bool) -> str:
        rules, names = [], []
        for i, t in enumerate(tools):
            params = t.get("parameters") or {}
            parts = []
            for j, (key, schema) in enumerate((params.get("properties") or {}).items()):
                if schema.get("type", "string") == "string":
                    parts.append(f'"<parameter={key}>\\n" {_TEXT} "</parameter>\\n"')
                else:
                    rules.append(f"v{i}_{j}: %json {json.dumps({**schema, 'x-guidance': _COMPACT})}")
                    parts.append(f'"<parameter={key}>\\n" v{i}_{j} "\\n</parameter>\\n"')
            rules.append(f'f{i}: "<function={t["name"]}>\\n" {" ".join(parts)} "</function>"')
            names.append(f"f{i}")
        return _envelope("body: " + " | ".join(names) + "\n" + "\n".join(rules) + "\n", parallel, think)


def _typed(raw: str, schema: dict) -> Any:
    """A parameter's text as the JSON value its schema asks for (strings stay text)."""
    kind = schema.get("type")
    if kind in (None, "string") or (isinstance(kind, list) and "string" in kind):
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


BUILTIN_PARSERS: dict[str, type] = {"hermes": HermesParser, "qwen3_xml": Qwen3XmlParser}


def parser(name: str) -> ToolParser:
    """A parser by name: the built-ins, then installed `ignis.tool_parsers` entry points."""
    if name in BUILTIN_PARSERS:
        return BUILTIN_PARSERS[name]()
    for ep in entry_points(group="ignis.tool_parsers"):
        if ep.name == name:
            return ep.load()()
    raise KeyError(f"no tool parser {name!r}; built in: {', '.join(BUILTIN_PARSERS)}")


def parser_for_template(template: str | None) -> ToolParser:
    """The format a chat template writes its tool calls in: Qwen3.5's XML form when it renders `<function=`."""
    return parser("qwen3_xml" if template and "<function=" in template else "hermes")


class ToolStream:
    """Streamed text -> content deltas and complete calls. Text that may start `<tool_call>` is held back until it is
    known; a block is parsed when `</tool_call>` arrives; an unfinished or unparsable block ends up as content."""

    def __init__(self, parser: ToolParser, tools: list[dict]) -> None:
        self.parser = parser
        self.tools = {t["name"]: t for t in tools}
        self.calls: list[ToolCall] = []
        self._buf = ""
        self._in_call = False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        content, calls = "", []
        while True:
            if not self._in_call:
                i = self._buf.find(START)
                if i < 0:
                    keep = _partial_suffix(self._buf, START)
                    content += self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                content += self._buf[:i]
                self._buf, self._in_call = self._buf[i + len(START) :], True
            j = self._buf.find(END)
            if j < 0:
                break
            block, self._buf, self._in_call = self._buf[:j], self._buf[j + len(END) :], False
            call = self.parser.parse(block.strip(), self.tools)
            if call is None:
                content += START + block + END
            else:
                calls.append(call)
        self.calls += calls
        return content.strip("\n") if calls and not content.strip() else content, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left when the text ends: an unterminated block is parsed if it can be, else it is content."""
        rest, self._buf = self._buf, ""
        if self._in_call:
            self._in_call = False
            call = self.parser.parse(rest.strip(), self.tools)
            if call is not None:
                self.calls.append(call)
                return "", [call]
            return START + rest, []
        return rest, []


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def split_tool_calls(text: str, parser: ToolParser, tools: list[dict]) -> tuple[str, list[ToolCall]]:
    """The whole output at once: content (calls removed) and the calls in order."""
    stream = ToolStream(parser, tools)
    content, calls = stream.feed(text)
    rest, more = stream.finish()
    return (content + rest).strip() if calls or more else content + rest, calls + more
