"""Sampling parameters: what a caller may ask of one generation, validated before any work starts.

Owns: `SamplingParams` (the vLLM-shaped user object, also the wire form) and `StructuredOutputs` (a grammar the
output must follow). Does not own: how the parameters shape logits (ignis.engine.sampling, ignis.engine.logits) or
how stop strings are matched (ignis.client.output).
"""

from __future__ import annotations

import math

import msgspec

from ignis.errors import InputError

MAX_INT = 2**31 - 1  # counts and token ids: beyond this an int cannot be a real length or id (nor cross the wire)
GREEDY_BELOW = 1e-5  # a temperature (or top_p) below this is greedy, as in vLLM


class StructuredOutputs(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What the output must match; exactly one field is set (vLLM's `structured_outputs`)."""

    json: str | None = None  # a JSON Schema, as JSON text
    json_object: bool = False  # any JSON object
    regex: str | None = None
    grammar: str | None = None  # a Lark grammar (llguidance's dialect)
    choice: tuple[str, ...] | None = None  # one of these strings exactly

    def __post_init__(self) -> None:
        given = [self.json is not None, self.json_object, self.regex is not None, self.grammar is not None,
                 self.choice is not None]
        if sum(given) != 1:
            raise InputError("structured_outputs", "set exactly one of json, json_object, regex, grammar, choice")
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) or not c for c in self.choice)):
            raise InputError("structured_outputs.choice", "must be a non-empty list of non-empty strings")


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Per-request generation settings. Defaults follow vLLM: temperature 1.0, max_tokens 16."""

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of tokens in prompt or output
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_INT:
            raise InputError("n", f"must be an integer from 1 to {MAX_INT}, got {self.n!r}")
        if not isinstance(self.max_tokens, int) or not 1 <= self.max_tokens <= MAX_INT:
            raise InputError("max_tokens", f"must be an integer from 1 to {MAX_INT}, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature < math.inf:
            raise InputError("temperature", f"must be a finite number >= 0 (0 means greedy), got {self.temperature!r}")
        if self.temperature < GREEDY_BELOW:
            # logits / 1e-300 overflow to inf and the draw turns to noise; the limit of a tiny temperature is greedy.
            msgspec.structs.force_setattr(self, "temperature", 0.0)
        if not 0.0 < self.top_p <= 1.0:
            raise InputError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if self.top_p < GREEDY_BELOW:
            # Only the most likely token reaches so small a mass; as float32 (the device's) 1e-300 would read as 0
            # and drop every token.
            msgspec.structs.force_setattr(self, "top_p", 1.0)
            msgspec.structs.force_setattr(self, "top_k", 1)
        if not isinstance(self.top_k, int) or not -1 <= self.top_k <= MAX_INT:
            raise InputError("top_k", f"must be an integer >= 0 (0 or -1 turn it off), got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InputError("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            raise InputError("seed", f"must be an integer in [0, 2**63), got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InputError("stop", "every stop string must be a non-empty string")
        if any(not isinstance(t, int) or not 0 <= t <= MAX_INT for t in self.stop_token_ids):
            raise InputError("stop_token_ids", f"every stop token id must be an integer from 0 to {MAX_INT}")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20):
            raise InputError("logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and -2.0 <= value <= 2.0):
                raise InputError(name, f"must be a number in [-2, 2], got {value!r}")
        if not (isinstance(self.repetition_penalty, (int, float)) and 0.0 < self.repetition_penalty <= 10.0):
            raise InputError("repetition_penalty", f"must be in (0, 10] (1 turns it off), got {self.repetition_penalty!r}")
        for t, b in (self.logit_bias or {}).items():
            if not (isinstance(t, int) and t >= 0):
                raise InputError("logit_bias", f"keys must be token ids (integers >= 0), got {t!r}")
            if not (isinstance(b, (int, float)) and -100.0 <= b <= 100.0):
                raise InputError("logit_bias", f"biases must be numbers in [-100, 100], got {b!r} for token {t}")

    def for_engine(self) -> SamplingParams:
        """What crosses to the engine: stop strings stay with the client that matches them (ignis.client.output),
        so a request's long stop strings are never copied into the GPU process."""
        return msgspec.structs.replace(self, stop=()) if self.stop else self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def shapes_logits(self) -> bool:
        """Whether the model's logits are changed per request (penalties, bias, grammar) before choosing."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or bool(self.logit_bias)
            or self.structured_outputs is not None
        )


def check_prompt(token_ids: list[int], *, context: int, vocab_size: int) -> None:
    """Refuse a prompt the engine could not run: empty, not shorter than the context, or ids outside the vocabulary."""
    if not token_ids:
        raise InputError("prompt", "is empty; give at least one token")
    if len(token_ids) >= context:
        raise InputError(
            "prompt",
            f"has {len(token_ids)} tokens but the context is {context} (engine.context); "
            "shorten the prompt or raise engine.context",
        )
    for t in token_ids:
        if not (isinstance(t, int) and 0 <= t < vocab_size):
            raise InputError("prompt_token_ids", f"token id {t!r} is outside the vocabulary [0, {vocab_size})")
