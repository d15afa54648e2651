"""Grammars for structured output, through llguidance (docs/adr/0003-grammar-engine.md says why that engine).

Owns: turning a `StructuredOutputs` into llguidance's grammar text (`grammar_text`, also used by front-ends to refuse
a bad schema with a 400 before anything is queued), and `Grammars`, which builds one matcher per request over the
artifact's tokenizer.json. Does not own: applying masks to logits (ignis.engine.logits). The GPU process reads the
vocabulary straight from tokenizer.json; it never imports ignis.tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import llguidance
import numpy as np
import torch

from ignis.errors import InputError
from ignis.params import StructuredOutputs


# JSON comes out in one canonical layout, `{"a": 1, "b": [2, 3]}` (Python's json.dumps): free whitespace lets a
# sampled model pad between tokens for as long as max_tokens allows instead of closing the value.
JSON_OPTIONS: dict = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(spec: StructuredOutputs, field: str = "structured_outputs") -> str:
    """llguidance grammar for `spec`; InputError naming `field` when it is not a valid schema, regex or grammar."""
    try:
        if spec.json is not None:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(spec.json, defaults=JSON_OPTIONS)
        elif spec.json_object:
            grammar = llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
        elif spec.regex is not None:
            grammar = llguidance.LLMatcher.grammar_from_regex(spec.regex)
        elif spec.choice is not None:
            grammar = llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
        else:
            assert spec.grammar is not None
            grammar = llguidance.LLMatcher.grammar_from_lark(spec.grammar)
    except ValueError as e:
        raise InputError(field, f"is not valid: {e}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InputError(field, f"is not valid: {error}")
    return grammar


class GrammarMatcher:
    """One request's position in its grammar (ignis.engine.logits.Matcher)."""

    def __init__(self, matcher: llguidance.LLMatcher, eos: list[int]) -> None:
        self._m = matcher
        self._eos = eos

    def consume(self, token: int) -> bool:
        if self._m.is_stopped() or self._m.validate_tokens([token]) != 1:
            return False  # consuming a forbidden token would put the matcher in its error state for good
        return self._m.consume_token(token)

    def rollback(self, n: int) -> None:
        self._m.rollback(n)

    def allowed(self, vocab: int) -> torch.Tensor:
        if self._m.is_stopped():  # the grammar is complete: only the end of the turn may follow
            allowed = torch.zeros(vocab, dtype=torch.bool)
            allowed[[t for t in self._eos if t < vocab]] = True
            return allowed
        bits = np.unpackbits(np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = torch.zeros(vocab, dtype=torch.bool)
        n = min(vocab, bits.shape[0])
        allowed[:n] = torch.from_numpy(bits[:n].astype(np.bool_))
        return allowed


class Grammars:
    """Matchers over one artifact's vocabulary; the tokenizer is read on the first structured request."""

    def __init__(self, tokenizer_json: Path, vocab: int, eos: list[int]) -> None:
        self.path = tokenizer_json
        self.vocab = vocab
        self.eos = eos
        self._tok: llguidance.LLTokenizer | None = None

    def matcher(self, spec: StructuredOutputs) -> GrammarMatcher:
        grammar = grammar_text(spec)
        if self._tok is None:
            if not self.path.is_file():
                raise InputError("structured_outputs", f"needs the model's tokenizer.json, which {self.path.parent} lacks")
            self._tok = llguidance.LLTokenizer(str(self.path), n_vocab=self.vocab, eos_token=self.eos)
        m = llguidance.LLMatcher(self._tok, grammar, log_level=0)
        if m.is_error():
            raise InputError("structured_outputs", f"is not valid: {m.get_error()}")
        return GrammarMatcher(m, self.eos)
