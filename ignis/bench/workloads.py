"""The requests a benchmark sends: built-in workloads or a JSONL file.

Owns: the built-in workloads (`code`: greedy completions of held-out code, the built-in model's own domain; `prose`:
greedy completions of English prose; `chat`: sampled chat turns asking for code) and reading a workload file, one
JSON object a line with `prompt` (a completion) or `messages` (a chat turn), and optionally `max_tokens` and
`temperature`. Does not own: sending them (ignis.bench.load).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ignis.errors import InputError

BUILTIN = Path(__file__).resolve().parent.parent / "builtin"
WORKLOADS = ("code", "prose", "chat")

_PROSE = [
    "The history of the lighthouse begins in the ancient world, where",
    "When the river finally froze that winter, the people of the valley",
    "A good recipe for bread asks for very little: flour, water, salt and",
    "The committee met on a Tuesday to discuss the budget, and the first item",
    "Long before the railway reached the town, travellers arrived by",
    "Scientists who study the deep ocean have learned that",
    "My grandmother kept a notebook of everything she planted, and in it",
    "The museum's new wing opened to the public last spring with",
]


@dataclass(frozen=True)
class Item:
    """One request: a completion (`prompt`) or a chat turn (`messages`)."""

    prompt: str | None
    messages: list[dict[str, Any]] | None
    max_tokens: int
    temperature: float

    def body(self, model: str, ignore_eos: bool = False) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "max_tokens": self.max_tokens, "temperature": self.temperature,
                                "stream": True, "stream_options": {"include_usage": True}}
        if ignore_eos:
            body["ignore_eos"] = True  # ignis, vLLM and llama.cpp take it; OpenAI's own API does not
        if self.messages is not None:
            body["messages"] = self.messages
        else:
            body["prompt"] = self.prompt
        return body

    @property
    def path(self) -> str:
        return "/chat/completions" if self.messages is not None else "/completions"


def load(name: str, max_tokens: int) -> list[Item]:
    """The items of built-in workload `name`, or of the JSONL file at `name`."""
    if name == "code":
        rows = _jsonl(BUILTIN / "heldout_prompts.jsonl")
        return [Item(r["prompt"], None, max_tokens, 0.0) for r in rows]
    if name == "prose":
        return [Item(p, None, max_tokens, 0.0) for p in _PROSE]
    if name == "chat":
        rows = _jsonl(BUILTIN / "heldout_chat.jsonl")
        return [Item(None, r["messages"], max_tokens, 0.7) for r in rows]
    path = Path(name)
    if not path.is_file():
        raise InputError("--workload", f"{name!r} is neither a built-in workload ({', '.join(WORKLOADS)}) nor a file")
    items = []
    for i, row in enumerate(_jsonl(path)):
        usable = isinstance(row, dict) and (isinstance(row.get("prompt"), str) or isinstance(row.get("messages"), list))
        if not usable:
            raise InputError("--workload", f"{path} line {i + 1}: expected an object with 'prompt' or 'messages'")
        items.append(Item(row.get("prompt") if "messages" not in row else None, row.get("messages"),
                          int(row.get("max_tokens", max_tokens)), float(row.get("temperature", 0.0))))
    if not items:
        raise InputError("--workload", f"{path} holds no requests")
    return items


def _jsonl(path: Path) -> list[Any]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as e:
        raise InputError("--workload", f"{path}: not readable JSON lines ({e})") from None
