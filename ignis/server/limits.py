"""Limits and the checks that relate a request's fields to each other and to the engine, in one place.

Owns: `Limits` (the `server.max_*` keys and the engine's context), the JSON nesting limit, and every check that
needs more than one field or the engine's shape: counts (choices, stop strings) within their limits, a text
prompt's length before it is tokenized, prompt + max_tokens within the context, stop token ids inside the
vocabulary. Each refusal is an InputError naming the field, raised before any work starts. Does not own: one
field's own range (ignis.params.SamplingParams, the request structs in ignis.server.schemas), the body size
(ignis.server.guard, which refuses before reading), or tokenizing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ignis.config import IgnisConfig
from ignis.errors import InputError
from ignis.params import SamplingParams

MAX_JSON_DEPTH = 64  # arrays and objects inside each other; OpenAI's deepest legitimate shapes need about 10
CHARS_PER_TOKEN = 64  # max_prompt_chars = 0: a text prompt longer than this many characters per position cannot fit


@dataclass(frozen=True)
class Limits:
    max_samples: int  # n x prompts
    max_stop: int
    max_stop_chars: int
    max_prompt_chars: int
    context: int

    @classmethod
    def of(cls, cfg: IgnisConfig, context: int) -> Limits:
        """The limits of a server whose engine runs `context` positions (engine.context may say 0, auto)."""
        s = cfg.server
        return cls(
            max_samples=s.max_samples,
            max_stop=s.max_stop,
            max_stop_chars=s.max_stop_chars,
            max_prompt_chars=s.max_prompt_chars or CHARS_PER_TOKEN * context,
            context=context,
        )

    def check_counts(self, *, n: int, prompts: int, stop: str | list[str] | None) -> None:
        """Choices and stop strings within their limits (before anything is tokenized or copied)."""
        if n * prompts > self.max_samples:
            field = "n" if prompts == 1 else "prompt"
            raise InputError(field, f"asks for {n * prompts} choices ({prompts} prompt(s) x n = {n}); at most "
                             f"{self.max_samples} per request (server.max_samples)")
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if len(stops) > self.max_stop:
            raise InputError("stop", f"has {len(stops)} stop strings; at most {self.max_stop} (server.max_stop)")
        for s in stops:
            if isinstance(s, str) and len(s) > self.max_stop_chars:
                raise InputError("stop", f"a stop string has {len(s)} characters; at most {self.max_stop_chars} "
                                 "(server.max_stop_chars)")

    def check_text(self, field: str, text: str) -> None:
        """A text prompt short enough to tokenize (a longer one could not fit in the context anyway)."""
        if len(text) > self.max_prompt_chars:
            raise InputError(field, f"has {len(text)} characters; at most {self.max_prompt_chars} "
                             "(server.max_prompt_chars)")


def check_fit(params: SamplingParams, prompt_tokens: int, *, context: int, field: str = "max_tokens") -> None:
    """prompt + max_tokens within the context, as vLLM refuses it, rather than a silently shortened answer."""
    if prompt_tokens + params.max_tokens > context:
        raise InputError(field, f"the context is {context} tokens, but {prompt_tokens} prompt tokens + "
                         f"{params.max_tokens} to generate is {prompt_tokens + params.max_tokens}; lower "
                         f"{field} or shorten the prompt")


def check_stop_ids(params: SamplingParams, vocab_size: int) -> None:
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise InputError("stop_token_ids", f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")


_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string, escapes included
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def check_depth(body: bytes, limit: int = MAX_JSON_DEPTH) -> None:
    """Refuse JSON nested deeper than `limit` before any parser recurses into it. Strings are cut out (a bracket
    inside one does not count), the rest reduced to its brackets, and the deepest point is a running sum."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return
    brackets = np.frombuffer(_STRING.sub(b"", body).translate(None, _NOT_BRACKETS), np.uint8)
    step = np.where(brackets <= ord("["), np.int32(1), np.int32(-1))  # "[" 91 and "{" 123 open; "]" 93, "}" 125 close
    step[brackets == ord("{")] = 1
    if int(np.cumsum(step).max(initial=0)) > limit:
        raise InputError("body", f"nests arrays and objects deeper than {limit} levels")
