"""What a generation returns to Python callers (vLLM-shaped): `RequestOutput` holding `CompletionOutput`s."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, Any] = field(default_factory=dict)
    # prompt_tokens, prompt_tokens_resumed (held by a retained slot, not prefilled), prompt_ms, decode_tokens,
    # decode_ms, tokens_per_s, rounds, drafted, accepted, position_drafted, position_accepted, preemptions (times it
    # gave its K/V pages up and was prefilled again) (summed over the n samples)
