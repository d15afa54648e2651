"""Prompts for drafter training, read from the user's files: text, a prompts JSONL or a chat JSONL.

Owns: reading `--data` paths into token-id prompts (deterministically), and the held-out split. Does not own: the
completions (ignis.train.generate) or the tokenizer (ignis.tokenizer).

A `.jsonl` file holds one object a line with one of:
  "prompt_token_ids": [ids]        used as given
  "prompt": "text"                 encoded as is (a completion prompt)
  "messages": [{"role", "content"}]  a chat: trailing assistant turns are dropped and the chat template adds the
                                   assistant header, so the target writes the answer the drafter learns from
  "text": "a document"             cut into windows like a text file
Any other file (or every file under a directory) is text: each document is cut into windows of `window` tokens, one
every `window + stride` tokens, so a long file gives many prompts and a short one its opening.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ignis.errors import InputError
from ignis.tokenizer import Tokenizer

JSONL_KEYS = ("prompt_token_ids", "prompt", "messages", "text")


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]
    source: str  # file and line or window, for messages


def read_prompts(paths: list[Path], tok: Tokenizer, *, window: int, stride: int, vocab: int) -> list[Prompt]:
    """Every prompt the files hold, in a fixed order (files sorted under each directory)."""
    out: list[Prompt] = []
    for path in paths:
        if not path.exists():
            raise InputError("--data", f"{path} does not exist")
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for f in files:
            out.extend(_jsonl(f, tok, window, stride) if f.suffix == ".jsonl" else _text_windows(f, tok, window, stride))
    if not out:
        raise InputError("--data", f"no prompts in {', '.join(map(str, paths))}: give text files, a prompts JSONL "
                                   f"or a chat JSONL (one object a line with one of {', '.join(JSONL_KEYS)})")
    for p in out:
        bad = [i for i in p.ids if not 0 <= i < vocab]
        if bad:
            raise InputError("--data", f"{p.source}: token id {bad[0]} is outside the model's vocabulary [0, {vocab})")
    return out


def split(prompts: list[Prompt], held_out: int, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    """(train, held_out): `held_out` prompts drawn with `seed` (at most a tenth of them), the rest in file order."""
    n = min(held_out, len(prompts) // 10 if len(prompts) >= 20 else len(prompts) // 2)
    chosen = set(random.Random(seed).sample(range(len(prompts)), n))
    return ([p for i, p in enumerate(prompts) if i not in chosen],
            [p for i, p in enumerate(prompts) if i in chosen])


def _jsonl(path: Path, tok: Tokenizer, window: int, stride: int) -> Iterator[Prompt]:
    for n, line in enumerate(_read(path).splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise InputError("--data", f"{where}: not JSON ({e})") from e
        if not isinstance(rec, dict) or not any(k in rec for k in JSONL_KEYS):
            raise InputError("--data", f"{where}: expected an object with one of {', '.join(JSONL_KEYS)}")
        if "prompt_token_ids" in rec:
            ids = rec["prompt_token_ids"]
            if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
                raise InputError("--data", f"{where}: prompt_token_ids must be a non-empty list of integers")
            yield Prompt(tuple(ids), where)
        elif "messages" in rec:
            yield Prompt(tuple(tok.encode(tok.apply_chat_template(_ask(rec["messages"], where)))), where)
        elif "prompt" in rec:
            text = _string(rec["prompt"], where, "prompt")
            yield Prompt(tuple(tok.encode(text)), where)
        else:
            yield from _windows(_string(rec["text"], where, "text"), tok, window, stride, where)


def _ask(messages: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise InputError("--data", f"{where}: messages must be a list of {{\"role\", \"content\"}} objects")
    end = len(messages)
    while end and messages[end - 1]["role"] == "assistant":
        end -= 1
    if end == 0:
        raise InputError("--data", f"{where}: the chat has no turn before the assistant's")
    return messages[:end]


def _string(value: Any, where: str, key: str) -> str:
    if not isinstance(value, str) or not value:
        raise InputError("--data", f"{where}: {key} must be a non-empty string")
    return value


def _text_windows(path: Path, tok: Tokenizer, window: int, stride: int) -> Iterator[Prompt]:
    text = _read(path, text_only=True)
    if text.strip():
        yield from _windows(text, tok, window, stride, str(path))


def _windows(text: str, tok: Tokenizer, window: int, stride: int, where: str) -> Iterator[Prompt]:
    """Windows of `window` tokens of the encoded text, one every window + stride tokens (the text between is what
    the target's completion of the previous window would have had to say)."""
    ids = tok.encode(text)
    for first in range(0, max(1, len(ids) - window // 2), window + stride):
        yield Prompt(tuple(ids[first : first + window]), f"{where}@{first}")


def _read(path: Path, *, text_only: bool = False) -> str:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise InputError("--data", f"{path}: cannot be read ({e})") from e
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        if text_only:
            return ""  # a binary file under a data directory: not text, nothing to learn from
        raise InputError("--data", f"{path}: not UTF-8 text ({e})") from e
