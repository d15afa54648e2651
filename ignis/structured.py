"""Structured output as llguidance grammar text, shared by front-ends (a bad schema is a 400 before anything is
queued) and the GPU process (which compiles it into a matcher, ignis.engine.grammar).

Owns: `grammar_text` and the JSON layout generated JSON follows. Does not own: masks or tokenizers; this module
imports neither torch nor the tokenizer.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import llguidance

from ignis.errors import InputError
from ignis.params import StructuredOutputs

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# JSON comes out in one canonical layout, `{"a": 1, "b": [2, 3]}` (Python's json.dumps): free whitespace lets a
# sampled model pad between tokens for as long as max_tokens allows instead of closing the value.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


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


