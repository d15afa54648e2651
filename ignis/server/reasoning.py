"""Reasoning text split out of a thinking model's answer: `<think>...</think>`, whole or as the text streams.

Owns: `ReasoningStream`, which turns output text into (reasoning, content) deltas. A template may open the think
block itself (Qwen3.5 ends its generation prompt with `<think>\\n`), so the output starts inside it and only
`</think>` marks the change; otherwise an output that begins with `<think>` opens it. Text that could be the start
of a marker is held back until it is known. Does not own: deciding whether a model thinks (ignis.server.chat) or
the response shapes.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def prompt_opens_think(prompt: str) -> bool:
    """The rendered prompt leaves a think block open for the model to continue."""
    return prompt.rfind(OPEN) > prompt.rfind(CLOSE)


class ReasoningStream:
    def __init__(self, open_at_start: bool) -> None:
        self._thinking = open_at_start
        self._start = not open_at_start  # still at the output's start, where <think> may open a block
        self._buf = ""
        self._trim = False  # just after </think>: the newlines that separate it from the answer are dropped

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning, content = "", ""
        if self._start:
            stripped = self._buf.lstrip()
            if OPEN.startswith(stripped) and len(stripped) < len(OPEN):
                return "", ""  # could still become <think>
            self._start = False
            if stripped.startswith(OPEN):
                self._thinking, self._buf = True, stripped[len(OPEN) :]
        if self._thinking:
            i = self._buf.find(CLOSE)
            if i < 0:
                keep = _partial(self._buf, CLOSE)
                reasoning, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
                return reasoning, ""
            reasoning, self._buf, self._thinking, self._trim = self._buf[:i], self._buf[i + len(CLOSE) :], False, True
        if self._trim:
            self._buf = self._buf.lstrip("\n")
            self._trim = not self._buf
        content, self._buf = self._buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self._buf = self._buf, ""
        if self._thinking:
            return rest, ""
        return "", rest


def _partial(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def split_reasoning(text: str, open_at_start: bool) -> tuple[str, str]:
    s = ReasoningStream(open_at_start)
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    return r1 + r2, c1 + c2
