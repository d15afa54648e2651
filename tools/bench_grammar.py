"""Grammar engines side by side: compile time and token-mask time per token on a JSON schema (docs/adr/0003).

Walks a valid JSON document through each engine token by token (the built-in tokenizer), computing the full
vocabulary mask before every token, as ignis does for each verify column. Run: python -m tools.bench_grammar
(each engine is optional; the ones not installed are skipped).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "arguments": {
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "line": {"type": "integer"},
                "flags": {"type": "array", "items": {"type": "string", "enum": ["read", "write", "exec"]}},
                "recursive": {"type": "boolean"},
            },
            "required": ["path", "line", "flags", "recursive"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
DOC = json.dumps({"name": "open_file", "arguments": {"path": "src/ignis/engine/round.py", "line": 128,
                                                      "flags": ["read", "write"], "recursive": False}})


def tokenizer_path() -> Path:
    return Path(__file__).resolve().parents[1] / "ignis" / "builtin" / "tokenizer.json"


def bench_llguidance(ids: list[int], vocab: int) -> tuple[float, list[float]]:
    import llguidance
    import llguidance.numpy

    tok = llguidance.LLTokenizer(str(tokenizer_path()), n_vocab=vocab, eos_token=2)
    t0 = time.perf_counter()
    m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA)))
    compile_s = time.perf_counter() - t0
    assert not m.is_error(), m.get_error()
    mask = llguidance.numpy.allocate_token_bitmask(1, vocab)
    per = []
    for t in ids:
        t0 = time.perf_counter()
        llguidance.numpy.fill_next_token_bitmask(m, mask)
        per.append(time.perf_counter() - t0)
        assert m.consume_token(t), m.get_error()
    return compile_s, per


def bench_xgrammar(ids: list[int], vocab: int) -> tuple[float, list[float]]:
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_path()))
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[2])
    t0 = time.perf_counter()
    compiled = xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    m = xgrammar.GrammarMatcher(compiled)
    compile_s = time.perf_counter() - t0
    mask = xgrammar.allocate_token_bitmask(1, vocab)
    per = []
    for t in ids:
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(mask)
        per.append(time.perf_counter() - t0)
        assert m.accept_token(t)
    return compile_s, per


def main() -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path()))
    ids, vocab = tok.encode(DOC).ids, tok.get_vocab_size()
    for name, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        try:
            compile_s, per = fn(ids, vocab)
        except ImportError:
            print(f"{name}: not installed")
            continue
        us = [1e6 * x for x in per]
        print(f"{name}: compile {1e3 * compile_s:.2f} ms, mask per token mean {statistics.mean(us):.1f} us, "
              f"median {statistics.median(us):.1f} us, max {max(us):.1f} us over {len(ids)} tokens (vocab {vocab})")


if __name__ == "__main__":
    main()
