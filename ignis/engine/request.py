"""One request as the engine tracks it: its tokens, how far the lane has run them, its generator and its stats.

Owns: per-request bookkeeping, the stop rules (stop token, max_tokens, context) and what a preempted request must
prefill again. Does not own: lanes, rows or pages (ignis.engine.scheduler) or tensors (ignis.engine.round).

A request preempted to free K/V pages (ignis.engine.scheduler) keeps every token it emitted; it is prefilled again
from all of them (`fill` = its prompt and output so far), and the logits of the last one choose its next token, as a
decode round would have. Nothing it emitted is emitted again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ignis.engine.logits import LogitsShaper
from ignis.ipc.messages import RequestStats
from ignis.params import SamplingParams


@dataclass
class Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    generator: torch.Generator  # the host round's draws
    seed: int = 0  # the device round's counter-based draws
    client: int = 0
    forced: list[int] | None = None  # teacher forcing (acceptance replay): the tokens this request must emit
    shaper: LogitsShaper | None = None  # penalties, logit_bias, grammar: set when params.shapes_logits
    tokens: list[int] = field(default_factory=list)  # prompt + generated; the last generated one is the anchor
    computed: int = 0  # positions 0..computed-1 are in the lane's caches
    resumed: int = 0  # of those, the positions a retained slot held when the request took its lane
    refill: int = 0  # after a preemption: tokens[:refill] to prefill again (0: the prompt)
    unemitted: list[int] = field(default_factory=list)  # committed by the model after a stop rule ended the output
    ahead: int = 0  # decode rounds queued on the device for its lane that the host has not read yet
    lane: int = -1
    stats: RequestStats = field(default_factory=RequestStats)
    finish_reason: str | None = None
    stop_token_id: int | None = None
    t_arrival: float = field(default_factory=time.perf_counter)
    t_admit: float = 0.0
    t_first: float = 0.0

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt)

    @property
    def fill(self) -> int:
        """Tokens prefilled before decoding: the prompt, or after a preemption everything up to the last emitted."""
        return self.refill or len(self.prompt)

    @property
    def prefilling(self) -> bool:
        return self.computed < self.fill

    def preempt(self) -> None:
        """The request leaves its lane and pages to wait for new ones; it will prefill tokens[:fill] again."""
        self.refill = len(self.tokens)
        self.computed = self.resumed = 0
        self.lane = -1
        self.stats.preemptions += 1

    @property
    def needs_logits(self) -> bool:
        """Its logits are shaped on the host per column (penalties, bias, grammar) before acceptance."""
        return self.shaper is not None

    @property
    def chains(self) -> bool:
        """Its decode rounds may run back to back on the device, each from the last one's outputs, before the host
        reads them: no teacher forcing, no logits shaped on the host, no logprobs (a round's verify logits last until
        the next round)."""
        return self.forced is None and self.shaper is None and self.params.logprobs is None

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def anchor(self) -> int:
        return self.tokens[-1]

    def emit(self, tokens: list[int], context: int) -> list[int]:
        """Append the model's committed tokens, stopping at the first stop rule; returns what was kept."""
        kept: list[int] = []
        for i, t in enumerate(tokens):
            self.tokens.append(t)
            kept.append(t)
            if t in self.stop_ids:
                self.finish_reason, self.stop_token_id = "stop", t
            elif self.generated >= self.params.max_tokens or len(self.tokens) >= context:
                self.finish_reason = "length"
            if self.finish_reason is not None:
                self.unemitted = tokens[i + 1 :]
                break
        return kept

    def state_ids(self) -> list[int] | None:
        """Tokens 0..computed: the positions its lane's state covers and the token after them (ignis.engine.retain);
        None when the state is not worth keeping (nothing computed, or teacher forcing, whose rows the lane may not
        have committed as they were emitted) or not known (a round the host has not read runs on its lane)."""
        if self.computed == 0 or self.forced is not None or self.ahead:
            return None
        ids = (self.tokens + self.unemitted)[: self.computed + 1]
        return ids if len(ids) == self.computed + 1 else None

    def drafts_allowed(self, k: int, context: int) -> int:
        """Drafts worth verifying this round: never past max_tokens or the lane's context."""
        remaining = self.params.max_tokens - self.generated
        return max(0, min(k, remaining - 1, context - len(self.tokens) - 1))
