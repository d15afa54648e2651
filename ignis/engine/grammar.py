"""Grammar matchers for structured output, through llguidance (docs/adr/0003-grammar-engine.md says why that engine).

Owns: `Grammars`, which builds one matcher per request over the artifact's tokenizer.json, and the matcher's
masks. Does not own: the grammar text (ignis.structured) or applying masks to logits (ignis.engine.logits). The GPU
process reads the vocabulary straight from tokenizer.json; it never imports ignis.tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from ignis.errors import InputError
from ignis.params import StructuredOutputs

if TYPE_CHECKING:
    import llguidance  # imported where a grammar is first built: an engine that serves none never loads it


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
        import llguidance

        from ignis.structured import grammar_text

        grammar = grammar_text(spec)
        if self._tok is None:
            if not self.path.is_file():
                raise InputError("structured_outputs", f"needs the model's tokenizer.json, which {self.path.parent} lacks")
            self._tok = llguidance.LLTokenizer(str(self.path), n_vocab=self.vocab, eos_token=self.eos)
        m = llguidance.LLMatcher(self._tok, grammar, log_level=0)
        if m.is_error():
            raise InputError("structured_outputs", f"is not valid: {m.get_error()}")
        return GrammarMatcher(m, self.eos)
