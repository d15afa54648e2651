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
    def __init__(self, request_id: str, params: SamplingParams, tokenizer: Tokenizer) -> None:
        self.request_id = request_id
        self.params = params
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.text = ""  # decoded so far (before any stop-string cut)
        self.released = 0  # characters of `text` already handed out
        self.finished = False
        self._hold = max((len(s) for s in params.stop), default=1) - 1

    def feed(self, delta: RequestDelta) -> TextDelta:
        self.token_ids.extend(delta.token_ids)
        visible = self.token_ids
        stop_id = delta.stop_token_id if delta.finish_reason == "stop" else None
        if stop_id is not None and not self.params.include_stop_str_in_output and visible and visible[-1] == stop_id:
            visible = visible[:-1]
        text = self.tokenizer.decode(visible, skip_special_tokens=self.params.skip_special_tokens)
        finished, reason, stop_reason, hit = delta.finished, delta.finish_reason, stop_id, False
        if not finished and text.endswith("\ufffd"):
            text = text[: len(text) - 1]  # an incomplete UTF-8 sequence: wait for its next byte
        cut = self._find_stop(text)
        if cut is not None:
            end, stop = cut
            text, finished, reason, stop_reason, hit = text[:end], True, "stop", stop, True
        self.text = text
        upto = len(text) if finished else max(self.released, len(text) - self._hold)
        out = text[self.released : upto]
        self.released = max(self.released, upto)
        self.finished = finished
        return TextDelta(out, list(delta.token_ids), finished, reason, stop_reason, hit, delta.stats, delta.logprobs)

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        if not self.params.stop:
            return None
        begin = max(0, self.released - self._hold)
        best: tuple[int, str] | None = None
        for s in self.params.stop:
            i = text.find(s, begin)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        return (i + len(s) if self.params.include_stop_str_in_output else i), s
