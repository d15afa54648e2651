"""Per-request text on the client side: incremental detokenization and stop strings.

Owns: turning a request's stream of token deltas into text deltas, holding back text that may still turn out to
be the start of a stop string, and cutting at the first stop string. Does not own: the engine's stop tokens (the
engine stops on those itself) or transport.
"""

from __future__ import annotations

from dataclasses import dataclass

from ignis.ipc.messages import RequestDelta, RequestStats
from ignis.params import SamplingParams
from ignis.tokenizer import Tokenizer


@dataclass
class TextDelta:
    text: str  # text released since the previous delta
    token_ids: list[int]  # tokens received in this delta
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    stop_hit: bool  # a stop string matched: the caller must abort the request in the engine
    stats: RequestStats | None
    logprobs: list[dict[int, float]] | None


class OutputState:
    """Text of one request, decoded token by token (tokenizers' DecodeStream), so a delta costs what it adds, not
    what came before: a long answer stays linear. Only the unreleased tail is searched for stop strings: released
    text ends `hold` characters before the decoded end, so a stop string can never start inside it."""

    def __init__(self, request_id: str, params: SamplingParams, tokenizer: Tokenizer) -> None:
        self.request_id = request_id
        self.params = params
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.finished = False
        self._step = tokenizer.decode_stream(skip_special_tokens=params.skip_special_tokens)
        self._parts: list[str] = []  # released text, in order
        self._tail = ""  # decoded, not yet released (a possible stop string's start)
        self._hold = max((len(s) for s in params.stop), default=1) - 1

    @property
    def text(self) -> str:
        """Everything released so far (after a stop-string cut)."""
        return "".join(self._parts) + (self._tail if self.finished else "")

    def feed(self, delta: RequestDelta) -> TextDelta:
        self.token_ids.extend(delta.token_ids)
        visible = delta.token_ids
        stop_id = delta.stop_token_id if delta.finish_reason == "stop" else None
        if stop_id is not None and not self.params.include_stop_str_in_output and visible and visible[-1] == stop_id:
            visible = visible[:-1]
        for t in visible:
            piece = self._step(t)
            if piece:
                self._tail += piece
        finished, reason, stop_reason, hit = delta.finished, delta.finish_reason, stop_id, False
        cut = self._find_stop(self._tail)
        if cut is not None:
            end, stop = cut
            self._tail, finished, reason, stop_reason, hit = self._tail[:end], True, "stop", stop, True
        upto = len(self._tail) if finished else max(0, len(self._tail) - self._hold)
        out, self._tail = self._tail[:upto], self._tail[upto:]
        self._parts.append(out)
        self.finished = finished
        return TextDelta(out, list(delta.token_ids), finished, reason, stop_reason, hit, delta.stats, delta.logprobs)

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for s in self.params.stop:
            i = text.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        return (i + len(s) if self.params.include_stop_str_in_output else i), s
