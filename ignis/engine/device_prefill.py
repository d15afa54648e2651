"""A prompt's prefill as device work only: aligned pieces of power-of-two rows, one CUDA graph per (rows, span).

Owns: `pieces` (where a prefill segment is cut), `PrefillBuffers` (a piece size's static inputs, with pinned host
mirrors), `DevicePrefill` (run a segment piece by piece, replaying each piece's graph or running it eagerly, the first
token chosen on the device and queued to the host after the prompt's last piece, read after the round's one sync) and
the capture of its graphs at start-up. Does not own: which lanes prefill and how many rows (ignis.engine.scheduler), the
host prefill that serves everything else (ignis.engine.round: exact mode, logits shaped on the host, teacher forcing,
prompts past the largest captured span), the layer math (ignis.model) or drafting (ignis.backends).

A piece is the model's static decode forward (`HybridModel.decode`) over one lane and C = 2^i columns with nothing
recorded: the Gated DeltaNet layers run their recurrence over the C columns and keep the state after the last one,
attention writes C keys and reads the lane's slots 0..span-1 under the causal mask. So a piece needs no kernel of its
own, and its shapes are fixed. A segment [s, e) is cut into aligned pieces (from s, the largest power of two P up to the
largest piece with s % P == 0 and s + P <= e): a prompt takes at most about two pieces per doubling of its length, and
where the scheduler splits it at multiples of the largest piece, the pieces are the same as unsplit. The last row's
logits choose the first token on the device: the argmax, or for a sampled request a draw from its shaped distribution at
the counter-based uniform of the last prompt position (a position no decode round of the request draws at). The backend
observes each piece's rows as a device round's kept rows.

Why: the host prefill is one eager forward, whose launches cost more than the work for short prompts (about 15 ms on
the built-in model for any prompt length, on the H200), and every other lane waits for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch

from ignis.backends.base import Committed, SpecBackend
from ignis.engine.device_round import capture_graphs, spans, synchronize
from ignis.engine.device_sampling import STREAM_BONUS, draw, shape_probs, uniforms
from ignis.engine.request import Request
from ignis.model.cache import LaneCache
from ignis.model.model import HybridModel

MAX_PIECE = 256  # rows of the largest piece
MAX_SPAN = 4096  # key slots of the largest captured span: longer prompts prefill on the host, where the work is large

_INTS = ("lane", "start", "next", "seed", "top_k", "greedy")
_FLOATS = ("temperature", "top_p", "min_p")


def pieces(start: int, end: int, largest: int = MAX_PIECE) -> list[tuple[int, int]]:
    """(first position, rows) of each piece covering [start, end): aligned powers of two, at most `largest`."""
    out = []
    s = start
    while s < end:
        p = largest
        while p > 1 and (s % p or s + p > end):
            p //= 2
        out.append((s, p))
        s += p
    return out


class PrefillBuffers:
    """One piece size's static device inputs (read by its graphs), with pinned host mirrors."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.rows = rows
        pin = device.type == "cuda"
        n = len(_INTS) + rows
        self.host_ints = torch.zeros(n, dtype=torch.int64, pin_memory=pin)  # [6 + C] int64, cpu: fields, tokens
        self.host_floats = torch.zeros(len(_FLOATS), dtype=torch.float32, pin_memory=pin)  # [3] f32, cpu
        self.ints = torch.zeros(n, dtype=torch.int64, device=device)  # [6 + C] int64, device
        self.floats = torch.zeros(len(_FLOATS), dtype=torch.float32, device=device)  # [3] f32, device
        self.uploaded = torch.cuda.Event() if pin else None  # the last upload from the host mirrors
        self._ints, self._floats = self.host_ints.numpy(), self.host_floats.numpy()

    def __getattr__(self, name: str) -> torch.Tensor:
        if name in _INTS:
            i = _INTS.index(name)
            return self.ints[i : i + 1]  # [1] int64, device
        if name in _FLOATS:
            i = _FLOATS.index(name)
            return self.floats[i : i + 1]  # [1] float32, device
        raise AttributeError(name)

    @property
    def tokens(self) -> torch.Tensor:
        return self.ints[len(_INTS) :][None]  # [1, C] int64, device

    def idle(self, scratch: int) -> None:
        """A piece of zeros at position 0 of the scratch lane, greedy: what the capture runs."""
        self._write(scratch, 0, 0, [0] * self.rows, 0, 0, True, (1.0, 1.0, 0.0))
        self.ints.copy_(self.host_ints)
        self.floats.copy_(self.host_floats)

    def load(self, r: Request, start: int, following: int) -> None:
        """Write one piece of `r`'s prompt (rows start..start+C-1 of tokens[:fill]; `following`: the token after them,
        -1 after the last) into the host mirrors and start the upload. Waits only while the last upload from these
        mirrors is still queued (a long prompt's repeated largest piece)."""
        if self.uploaded is not None:
            self.uploaded.synchronize()
        p = r.params
        self._write(r.lane, start, following, r.tokens[start : start + self.rows], r.seed, p.top_k, p.greedy,
                    (p.temperature, p.top_p, p.min_p))
        self.ints.copy_(self.host_ints, non_blocking=True)
        self.floats.copy_(self.host_floats, non_blocking=True)
        if self.uploaded is not None:
            self.uploaded.record()

    def _write(self, lane: int, start: int, following: int, tokens: list[int], seed: int, top_k: int, greedy: bool,
               floats: tuple[float, float, float]) -> None:
        self._ints[: len(_INTS)] = [lane, start, following, seed, top_k, int(greedy)]
        self._ints[len(_INTS) :] = tokens
        self._floats[:] = floats


class DevicePrefill:
    def __init__(self, model: HybridModel, cache: LaneCache, backend: SpecBackend, device: torch.device) -> None:
        self.model, self.cache, self.backend, self.device = model, cache, backend, device
        # A backend that keeps a ring of recent rows takes at most a ring's worth of rows in one observe.
        ring = getattr(backend, "observe_rows", MAX_PIECE)
        self.largest = 1 << (min(MAX_PIECE, ring, cache.context).bit_length() - 1)
        every = spans(cache.context + cache.max_cols)
        self.spans = [s for s in every if s <= MAX_SPAN] or every[:1]
        self.limit = self.spans[-1]  # a piece ends at or before this position
        self.sizes = [1 << i for i in range(self.largest.bit_length())]
        self.buffers = {c: PrefillBuffers(c, device) for c in self.sizes}
        self.offsets = torch.arange(self.largest, dtype=torch.int64, device=device)  # [C] int64, device
        self.kept = {c: torch.full((1,), c - 1, dtype=torch.int64, device=device) for c in self.sizes}  # [1] int64
        pin = device.type == "cuda"
        self.out = torch.zeros(1, dtype=torch.int64, device=device)  # [1] int64, device: the first token
        # [lanes + 1] int64, cpu: each lane's first token, copied there after its prompt's last piece (a lane finishes
        # at most one prompt a round, so the round's prompts need no sync of their own)
        self.host_out = torch.zeros(cache.scratch + 1, dtype=torch.int64, pin_memory=pin)
        self.kept_logits: dict[int, torch.Tensor] = {}  # lane -> [1, V] f32, device: last-row logits, for logprobs
        self.logits = torch.zeros((1, model.config.vocab_size), dtype=torch.float32, device=device)  # [1, V] f32
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}

    def takes(self, r: Request, length: int) -> bool:
        """Whether rows r.computed.. r.computed+length-1 of r's prompt prefill here."""
        return r.forced is None and not r.needs_logits and r.computed + length <= self.limit

    def run(self, r: Request, length: int) -> tuple[int, torch.Tensor | None] | None:
        """`start`, then after the prompt's last row the sync and `first`; else None."""
        if not self.start(r, length):
            return None
        synchronize(self.device)
        return self.first(r)

    def start(self, r: Request, length: int) -> bool:
        """Queue the pieces of `length` rows of r's prompt from r.computed (the caller advances r.computed). True when
        they end the prompt: its first token is then on its way to the host, for `first` after the caller's sync."""
        end = r.computed + length
        for start, c in pieces(r.computed, end, self.largest):
            buf = self.buffers[c]
            buf.load(r, start, r.tokens[start + c] if start + c < r.fill else -1)
            span = self.span(start + c)
            graph = self.graphs.get((c, span))
            if graph is not None:
                graph.replay()
            else:
                self.forward(buf, span)
        if end < r.fill:
            return False
        self.host_out[r.lane : r.lane + 1].copy_(self.out, non_blocking=True)
        if r.params.logprobs is not None:  # the next prompt's pieces overwrite self.logits
            self.kept_logits[r.lane] = self.logits.clone()
        return True

    def first(self, r: Request) -> tuple[int, torch.Tensor | None]:
        """(r's first token, its logits [1, V] float32 on the device if r asked for logprobs, else None), once the
        work `start` queued has run."""
        return int(self.host_out[r.lane]), self.kept_logits.pop(r.lane, None)

    @torch.inference_mode()
    def forward(self, buf: PrefillBuffers, span: int) -> None:
        """One piece as device work on `buf`'s inputs; writes self.out and self.logits."""
        model, c = self.model, buf.rows
        lanes, tokens = buf.lane, buf.tokens
        positions = buf.start[:, None] + self.offsets[:c]  # [1, C]
        step = model.decode_step(lanes, positions, span=span, record=False)
        hidden, taps = model.decode(tokens, step, self.cache, taps=self.backend.tap_layers)
        logits = model.logits(hidden[-1:], out=self.logits)  # [1, V] float32
        drawn = draw(shape_probs(logits, buf.temperature, buf.top_k, buf.top_p, buf.min_p),
                     uniforms(buf.seed, positions[:, -1], STREAM_BONUS, 1)[:, 0])
        first = torch.where(buf.greedy.bool(), logits.argmax(dim=-1), drawn)  # [1]
        after = torch.where(buf.next >= 0, buf.next, first)  # the token after the piece's last row
        following = torch.cat([tokens[:, 1:], after[:, None]], dim=1)
        self.backend.observe_lanes(
            Committed(lanes, positions, tokens, following, hidden.view(1, c, -1),
                      taps.view(1, c, -1) if taps is not None else None, self.kept[c], step),
            span,
        )
        self.out.copy_(first)

    def span(self, end: int) -> int:
        """The key span a piece ending before position `end` reads."""
        return next(s for s in self.spans if s >= end)

    def keys(self) -> list[tuple[int, int]]:
        """Every (rows, span) a piece can take, the largest first."""
        return [(c, s) for c in reversed(self.sizes) for s in self.spans if c <= s]

    def capture(self, pool: Any, keys: list[tuple[int, int]] | None = None) -> float:
        """Capture a graph for every key (default: all) into the graph memory pool `pool`; returns the seconds it
        took. Runs on the scratch lane only, so no lane's state changes."""
        t0 = time.perf_counter()

        def runs() -> Iterator[tuple[tuple[int, int], Callable[[], None]]]:
            for c, span in keys if keys is not None else self.keys():
                buf = self.buffers[c]
                buf.idle(self.cache.scratch)
                yield (c, span), partial(self.forward, buf, span)

        self.graphs.update(capture_graphs(runs(), pool, self.device))
        return time.perf_counter() - t0
