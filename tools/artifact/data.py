"""Token streams for target training: source files as documents, plus chat turns built from documented functions.

Owns: turning corpus files into one flat token stream per split, and the chat examples (a request made of a
function's docstring, answered by the function's source) that teach the model the ChatML turn format. Does not own:
which files exist (corpus.py), batching and training (train_target.py), held-out prompts (prompts.py).

Source text is encoded with special-token parsing off: a file that mentions "<|im_end|>" (tokenizer code does)
must not turn into a real turn end.
"""

from __future__ import annotations

import ast
import multiprocessing
from collections.abc import Iterable

import numpy as np
from tokenizers import Tokenizer

from tools.artifact.corpus import SourceFile
from tools.artifact.train_tokenizer import ENDOFTEXT_ID, IM_END_ID, IM_START_ID

# Functions longer than this make poor answers (mostly argument plumbing) and crowd out the code documents.
MAX_ANSWER_CHARS = 2400
MIN_SUMMARY_CHARS = 24
MAX_SUMMARY_CHARS = 320


def function_requests(text: str) -> list[tuple[str, str, int, str]]:
    """(request, answer, line, name) for each documented top-level function of a source file."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    lines = text.splitlines()
    out: list[tuple[str, str, int, str]] = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        # Whole lines from the first decorator: ast.get_source_segment rescans the file for every node.
        first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
        source = "\n".join(lines[first - 1 : node.end_lineno])
        if not doc or len(source) > MAX_ANSWER_CHARS:
            continue
        summary = " ".join(doc.strip().split("\n\n")[0].split())
        if not MIN_SUMMARY_CHARS <= len(summary) <= MAX_SUMMARY_CHARS:
            continue
        request = f"Write a Python function `{node.name}`: {summary}"
        out.append((request, f"```python\n{source}\n```", node.lineno, node.name))
    return out


def _requests_of(text: str) -> list[tuple[str, str]]:
    return [(request, answer) for request, answer, _, _ in function_requests(text)]


def chat_ids(tok: Tokenizer, request: str, answer: str) -> list[int]:
    """One ChatML exchange, token for token what the chat template renders and the tokenizer encodes."""
    return (
        [IM_START_ID] + tok.encode("user\n" + request).ids + [IM_END_ID] + tok.encode("\n").ids
        + [IM_START_ID] + tok.encode("assistant\n" + answer).ids + [IM_END_ID] + tok.encode("\n").ids
    )


def _encode_documents(tok: Tokenizer, texts: Iterable[str], batch: int = 512) -> list[np.ndarray]:
    pending: list[str] = []
    out: list[np.ndarray] = []
    for text in texts:
        pending.append(text)
        if len(pending) == batch:
            out.extend(np.asarray(e.ids + [ENDOFTEXT_ID], dtype=np.uint16) for e in tok.encode_batch(pending))
            pending = []
    if pending:
        out.extend(np.asarray(e.ids + [ENDOFTEXT_ID], dtype=np.uint16) for e in tok.encode_batch(pending))
    return out


def build_stream(
    tok: Tokenizer, files: list[SourceFile], with_chat: bool, seed: int, workers: int
) -> tuple[np.ndarray, dict[str, int]]:  # [N] uint16 token ids, host; counts
    """All documents (and chat exchanges) of files, each ended by <|endoftext|>, shuffled by document, flattened."""
    per_file: list[list[tuple[str, str]]] = []
    if with_chat:
        texts = [f.text for f in files]
        # Forked before the tokenizer's own threads start: a fork after them disables its parallelism.
        if workers > 1:
            with multiprocessing.get_context("fork").Pool(workers) as pool:
                per_file = pool.map(_requests_of, texts, chunksize=64)
        else:
            per_file = [_requests_of(t) for t in texts]
    tok.encode_special_tokens = True
    docs = _encode_documents(tok, (f.text for f in files))
    chats: list[np.ndarray] = []
    if with_chat:
        for requests in per_file:
            for request, answer in requests:
                chats.append(np.asarray(chat_ids(tok, request, answer) + [ENDOFTEXT_ID], dtype=np.uint16))
    tok.encode_special_tokens = False
    pieces = docs + chats
    # Shuffled by document so one batch mixes libraries instead of walking torch, then numpy, then scipy.
    order = np.random.default_rng(seed).permutation(len(pieces))
    stream = np.concatenate([pieces[i] for i in order]) if pieces else np.zeros(0, dtype=np.uint16)
    counts = {
        "documents": len(docs),
        "chat_exchanges": len(chats),
        "tokens": int(stream.size),
        "chat_tokens": int(sum(c.size for c in chats)),
    }
    return stream, counts
