"""Held-out prompts for measuring acceptance: code cut at function and class starts, and chat requests, from
held-out files only.

Owns: choosing the prompts (deterministically) and their JSONL form. Does not own: the split (corpus.py) or the
measurement (the acceptance tool reads these files).

heldout_prompts.jsonl, one object a line: {"id", "file", "line", "prompt", "reference"}: the prompt is the file's
text up to the end of a def/class header (and its docstring), with up to CONTEXT_CHARS of what precedes it; the
reference is what the file really says next, from the header's line break on.
heldout_chat.jsonl: {"id", "file", "line", "messages", "reference"}.
"""

from __future__ import annotations

import ast
import hashlib
import json
from pathlib import Path

from tools.artifact.corpus import SourceFile
from tools.artifact.data import function_requests

CONTEXT_CHARS = 1200
REFERENCE_CHARS = 1200
MIN_REFERENCE_CHARS = 160


def _rank(rel: str, line: int) -> bytes:
    return hashlib.sha256(f"{rel}:{line}".encode()).digest()


def _header_end(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> int:
    """0-based index of the last line that belongs in the prompt: the header, and the docstring if there is one."""
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return (first.end_lineno or first.lineno) - 1
    return first.lineno - 2


def _code_candidates(f: SourceFile) -> list[tuple[bytes, dict[str, object]]]:
    try:
        tree = ast.parse(f.text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    lines = f.text.splitlines(keepends=True)
    out: list[tuple[bytes, dict[str, object]]] = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        end = _header_end(node)
        if end < node.lineno - 1 or end + 1 >= len(lines):
            continue
        prompt_start = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
        # Whole lines of preceding context, as many as fit, so the prompt reads like the middle of a real file.
        while prompt_start > 0 and sum(len(x) for x in lines[prompt_start - 1 : end + 1]) <= CONTEXT_CHARS:
            prompt_start -= 1
        prompt = "".join(lines[prompt_start : end + 1])
        rest = "".join(lines[end + 1 : (node.end_lineno or end + 1)])
        if len(rest[:REFERENCE_CHARS].strip()) < MIN_REFERENCE_CHARS or len(prompt) > 4 * CONTEXT_CHARS:
            continue
        # The header's line break goes to the reference: the tokenizer joins a line break with the indentation
        # after it, so a prompt ending in a bare line break is a split the model never saw in training.
        body = prompt.rstrip("\r\n")
        prompt, reference = body, (prompt[len(body) :] + rest)[:REFERENCE_CHARS]
        out.append(
            (_rank(f.rel, node.lineno), {"file": f.rel, "line": node.lineno, "prompt": prompt, "reference": reference})
        )
    return out


def _pick(candidates: list[tuple[bytes, dict[str, object]]], count: int) -> list[dict[str, object]]:
    """The count lowest-ranked candidates, at most one per file, so no single file dominates."""
    chosen: list[dict[str, object]] = []
    files: set[object] = set()
    for _, item in sorted(candidates, key=lambda c: c[0]):
        if item["file"] in files:
            continue
        files.add(item["file"])
        chosen.append({"id": len(chosen), **item})
        if len(chosen) == count:
            break
    return chosen


def _some(held: list[SourceFile], count: int) -> list[SourceFile]:
    """A fixed sample of files, enough for count prompts at one per file; parsing every held-out file is slow."""
    return sorted(held, key=lambda f: _rank(f.rel, 0))[: 8 * count]


def code_prompts(held: list[SourceFile], count: int) -> list[dict[str, object]]:
    return _pick([c for f in _some(held, count) for c in _code_candidates(f)], count)


def chat_prompts(held: list[SourceFile], count: int) -> list[dict[str, object]]:
    candidates: list[tuple[bytes, dict[str, object]]] = []
    for f in _some(held, 4 * count):
        for request, answer, line, _ in function_requests(f.text):
            item = {"file": f.rel, "line": line, "messages": [{"role": "user", "content": request}],
                    "reference": answer}
            candidates.append((_rank(f.rel, line), item))
    return _pick(candidates, count)


def write_jsonl(path: Path, items: list[dict[str, object]]) -> None:
    path.write_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items))
