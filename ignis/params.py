"""Sampling parameters: what a caller may ask of one generation, validated before any work starts.

Owns: `SamplingParams` (the vLLM-shaped user object, also the wire form). Does not own: how the parameters
shape logits (ignis.engine.sampling) or how stop strings are matched (ignis.client.output).
"""

from __future__ import annotations

import msgspec

from ignis.errors import InputError


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

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise InputError("n", f"must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InputError("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0.0:
            raise InputError("temperature", f"must be >= 0 (0 means greedy), got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise InputError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise InputError("top_k", f"must be an integer >= 0 (0 or -1 turn it off), got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InputError("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            raise InputError("seed", f"must be an integer in [0, 2**63), got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InputError("stop", "every stop string must be a non-empty string")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InputError("stop_token_ids", "every stop token id must be an integer >= 0")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20):
            raise InputError("logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
