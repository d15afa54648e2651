"""Per-request logits shaping: penalties, logit_bias and a grammar's token mask, for every verify column at once.

Owns: `LogitsShaper`, which turns the model's raw logits at a lane's columns into the logits the request chooses
from. Column j sees the lane's tokens plus the drafts before it (d_0..d_{j-1}), so a column's shaped logits are the
ones plain decoding would compute at that position had those drafts been its own tokens: greedy output with
penalties stays equal across backends, and a draft the grammar forbids has logit -inf at its column, so it is
rejected exactly as if the model had not picked it. Does not own: which rows are verified (ignis.engine.round),
temperature / top-k / top-p (ignis.engine.sampling), or compiling grammars (ignis.engine.grammar).

Semantics follow vLLM and OpenAI: presence and frequency penalties count the generated tokens only; the repetition
penalty applies to every token seen in the prompt or the output (positive logits divided, negative multiplied);
logit_bias is added last before the grammar mask.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ignis.params import SamplingParams


class Matcher(Protocol):
    """A grammar's state over the generated tokens (ignis.engine.grammar implements it)."""

    def consume(self, token: int) -> bool:
        """Advance over one token; False (and no change) when the grammar forbids it."""

    def rollback(self, n: int) -> None:
        """Undo the last n consumed tokens."""

    def allowed(self, vocab: int) -> torch.Tensor:
        """Which tokens may come next: [vocab] bool, cpu."""


class LogitsShaper:
    def __init__(self, params: SamplingParams, prompt_len: int, matcher: Matcher | None = None) -> None:
        self.params = params
        self.prompt_len = prompt_len
        self.matcher = matcher
        self._bias = sorted((params.logit_bias or {}).items())
        self._upto = 0  # tokens of the request already counted (and consumed by the matcher, past the prompt)
        self._counts: torch.Tensor | None = None  # [V] float32: occurrences of each token in the output
        self._seen: torch.Tensor | None = None  # [V] bool: token appears in prompt or output

    def shape(self, logits: torch.Tensor, tokens: list[int], drafts: list[int]) -> torch.Tensor:
        """logits: [cols, V] raw, column j predicting the token after tokens + drafts[:j]. Returns [cols, V] float32.

        `tokens` is the request's prompt + committed output; what was committed since the last call is taken in
        here, so the shaper needs no separate commit step."""
        cols, vocab = logits.shape
        self._catch_up(tokens, vocab, logits.device)
        x = logits.float().clone()
        p = self.params
        if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0:
            assert self._counts is not None and self._seen is not None
            ahead = torch.zeros((cols, vocab), dtype=torch.float32, device=x.device)  # drafts before each column
            for j, d in enumerate(drafts[: cols - 1]):
                ahead[j + 1 :, d] += 1.0
            if p.repetition_penalty != 1.0:
                seen = self._seen[None, :] | (ahead > 0)
                penalised = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
                x = torch.where(seen, penalised, x)
            counts = self._counts[None, :] + ahead
            if p.frequency_penalty:
                x = x - p.frequency_penalty * counts
            if p.presence_penalty:
                x = x - p.presence_penalty * (counts > 0).float()
        for t, b in self._bias:
            if t < vocab:
                x[:, t] += b
        if self.matcher is not None:
            self._mask(x, drafts)
        return x

    def _mask(self, x: torch.Tensor, drafts: list[int]) -> None:
        """-inf on every token the grammar forbids at each column. Past a forbidden draft the columns are left
        unmasked: that draft is rejected at its own column, so nothing after it is ever chosen."""
        assert self.matcher is not None
        cols, vocab = x.shape
        taken = 0
        for j in range(cols):
            allowed = self.matcher.allowed(vocab).to(x.device)
            x[j].masked_fill_(~allowed, float("-inf"))
            if j >= len(drafts) or not self.matcher.consume(drafts[j]):
                break
            taken += 1
        if taken:
            self.matcher.rollback(taken)

    def _catch_up(self, tokens: list[int], vocab: int, device: torch.device) -> None:
        if self._counts is None:
            self._counts = torch.zeros(vocab, dtype=torch.float32, device=device)
            self._seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            self._upto = 0
        assert self._seen is not None
        new = tokens[self._upto :]
        if new:
            ids = torch.tensor([t for t in new if t < vocab], dtype=torch.long, device=device)
            self._seen[ids] = True
            out = [t for t in tokens[max(self._upto, self.prompt_len) :] if t < vocab]
            if out:
                self._counts.index_add_(0, torch.tensor(out, dtype=torch.long, device=device), torch.ones(len(out), device=device))
            if self.matcher is not None:
                for t in tokens[max(self._upto, self.prompt_len) :]:
                    self.matcher.consume(t)
            self._upto = len(tokens)
