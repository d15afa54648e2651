"""A decode/verify round for every decoding lane as device work only, captured as one CUDA graph per shape.

Owns: `RoundBuffers` (a bucket's static inputs and outputs, with pinned host mirrors), `DeviceRound` (prepare the
inputs, replay the bucket's graph or run it eagerly, queue the copy of the committed tokens to the host, read them after
the round's one sync), the graph capture of every bucket at start-up, and `capture_graphs` (which the device prefill's
capture shares). Does not own: which lanes decode (ignis.engine.scheduler), prefill (ignis.engine.device_prefill,
ignis.engine.round), the host reference round (ignis.engine.round), the layer math (ignis.model) or drafting
(ignis.backends).

Inside the device function, in order: propose (the backend's device form), verify (one static forward over B lanes x
K+1 columns), accept (greedy longest prefix, and rejection sampling with counter-based uniforms when a lane samples),
commit (each lane's recurrent state after its last kept column) and observe (the backend keeps the kept rows). Shapes
depend only on the key (B, span, sampling): B pads the lane count to a bucket (padding rows run on the scratch
lane), span is the number of key slots attention reads (the smallest rung of a ladder that covers every lane's
positions), sampling (`Sampling`) adds the probability shaping that greedy rounds skip: over the vocabulary, or,
where every sampling lane's top-k is at most device_sampling.CANDIDATES, over each row's largest logits (the same
tokens drawn at the same uniforms, so a request samples alike in either round).

Chained rounds (engine.rounds_per_sync): `start` may queue several rounds of the same lanes before the one sync, each
after the first taking its anchors and positions from the last one's outputs on the device (`RoundBuffers.advance`)
and replaying the same graph, each one's committed tokens copied to its own host slot. The device then never waits
for the host between them; the host reads them all at once.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import torch

from ignis.backends.base import Choice, Committed, SpecBackend
from ignis.engine.accept import Rule
from ignis.engine.device_sampling import (
    CANDIDATES,
    STREAM_ACCEPT,
    STREAM_BONUS,
    STREAM_DRAFT,
    accept_block,
    accept_sampled,
    shape_candidates,
    settle,
    shape_probs,
    uniforms,
)
from ignis.engine.request import Request
from ignis.engine.scheduler import Decode
from ignis.kernels.launch import PACKED_PDL_ROWS, dependent_launches
from ignis.logging import get_logger
from ignis.model.cache import LaneCache
from ignis.model.model import HybridModel
from ignis.model.ops import products_for
from ignis.quant.linear import repacked

log = get_logger(__name__)

MIN_SPAN = 256  # the shortest rung of the key-span ladder; each rung doubles up to the cache's slots


class Sampling:
    """A round's sampling, the third part of its graph key (ints, so False and True still name the first two)."""

    GREEDY = 0  # every lane greedy: argmax acceptance only
    VOCAB = 1  # some lane samples: p shaped over the whole vocabulary
    CANDIDATES = 2  # every sampling lane's top-k is 1..device_sampling.CANDIDATES: p held on the largest logits
    ALL = (GREEDY, VOCAB, CANDIDATES)

    @staticmethod
    def of(reqs: list[Request], vocab: int) -> int:
        """The sampling a round of these requests takes."""
        sampled = [r.params for r in reqs if not r.params.greedy]
        if not sampled:
            return Sampling.GREEDY
        width = min(CANDIDATES, vocab)
        return Sampling.CANDIDATES if all(1 <= p.top_k <= width for p in sampled) else Sampling.VOCAB


_INTS = ("lanes", "anchors", "positions", "allowed", "seeds", "top_k", "greedy")
_FLOATS = ("temperature", "top_p", "min_p", "draft_temperature")


def buckets(lanes: int) -> list[int]:
    """Lane counts a round is padded to: powers of two below `lanes`, and `lanes`."""
    out = [b for b in (2**i for i in range(lanes.bit_length())) if b < lanes]
    return out + [lanes]


def spans(slots: int) -> list[int]:
    """Key spans attention may read: MIN_SPAN doubling while below `slots`, then `slots`."""
    out: list[int] = []
    s = MIN_SPAN
    while s < slots:
        out.append(s)
        s *= 2
    return out + [slots]


class RoundBuffers:
    """One bucket's static device inputs (read by the captured graphs) and output, with pinned host mirrors."""

    def __init__(self, size: int, k: int, scratch: int, device: torch.device, rounds: int = 1) -> None:
        self.size = size
        self.scratch = scratch
        pin = device.type == "cuda"
        self.host_ints = torch.zeros((len(_INTS), size), dtype=torch.int64, pin_memory=pin)  # [7, B] int64, cpu
        self.host_floats = torch.zeros((len(_FLOATS), size), dtype=torch.float32, pin_memory=pin)  # [4, B] f32, cpu
        self.ints = torch.zeros((len(_INTS), size), dtype=torch.int64, device=device)  # [7, B] int64, device
        self.floats = torch.zeros((len(_FLOATS), size), dtype=torch.float32, device=device)  # [4, B] f32, device
        self.out = torch.zeros((size, k + 2), dtype=torch.int64, device=device)  # [B, K+2]: accepted, drafts, token
        # [R, B, K+2] int64, cpu: each of the rounds queued before one read (engine.rounds_per_sync)
        self.host_out = torch.zeros((rounds, size, k + 2), dtype=torch.int64, pin_memory=pin)
        self.logits = torch.empty(0, device=device)  # [B, K+1, V] float32, device: made by the first run
        self._ints, self._floats = self.host_ints.numpy(), self.host_floats.numpy()  # views: cheap host writes
        # one event a host slot, recorded after its copy (`record`): made once, not in every round (none on the CPU)
        self.copied = [torch.cuda.Event() for _ in range(rounds)] if device.type == "cuda" else []
        self.idle()

    def __getattr__(self, name: str) -> torch.Tensor:
        if name in _INTS:
            return self.ints[_INTS.index(name)]  # [B] int64, device
        if name in _FLOATS:
            return self.floats[_FLOATS.index(name)]  # [B] float32, device
        raise AttributeError(name)

    def idle(self) -> None:
        """Every row a padding row: scratch lane, greedy, no drafts kept."""
        self._fill_host([], False)
        self.ints.copy_(self.host_ints)
        self.floats.copy_(self.host_floats)

    def load(self, decodes: list[Decode], sample_drafts: bool) -> None:
        """Write this round's lanes into the host mirrors and start their upload (two small copies)."""
        self._fill_host(decodes, sample_drafts)
        self.ints.copy_(self.host_ints, non_blocking=True)
        self.floats.copy_(self.host_floats, non_blocking=True)

    def send(self, round_: int = 0) -> None:
        """Queue the one device-to-host copy of the last run's committed tokens into the host slot of the `round_`-th
        round queued since the last read (read them after the sync)."""
        self.host_out[round_].copy_(self.out, non_blocking=True)

    def record(self, slot: int) -> torch.cuda.Event | None:
        """The event of host slot `slot`, recorded now on the current stream, after the copy `send` queued into it:
        waiting for it waits for that slot's tokens alone (None on the CPU, where the copy is done when queued). A
        slot is written again only after it was read, so its event is never recorded twice while awaited."""
        if not self.copied:
            return None
        event = self.copied[slot]
        event.record(torch.cuda.current_stream(self.ints.device))
        return event

    def advance(self, n: int) -> None:
        """The next round's inputs for the first n rows from this round's outputs, on the device: each lane's anchor
        is its committed token and its position moves past the kept drafts and that token. The lanes, their draft
        counts and sampling stay."""
        k = self.out.shape[1] - 2
        self.ints[_INTS.index("anchors"), :n] = self.out[:n, k + 1]
        self.ints[_INTS.index("positions"), :n] += self.out[:n, 0] + 1

    def _fill_host(self, decodes: list[Decode], sample_drafts: bool) -> None:
        """sample_drafts False: every lane drafts at temperature 0 (one-hot q), whatever it samples at."""
        ints, floats = self._ints, self._floats
        ints[:] = 0
        floats[:] = 0.0
        ints[0] = self.scratch
        ints[6] = 1  # greedy
        floats[1] = 1.0  # top_p off
        n = len(decodes)
        if n:
            ints[:, :n] = [[d.request.lane for d in decodes], [d.request.anchor for d in decodes],
                           [len(d.request.tokens) - 1 for d in decodes], [d.drafts for d in decodes],
                           [d.request.seed for d in decodes], [d.request.params.top_k for d in decodes],
                           [int(d.request.params.greedy) for d in decodes]]
            floats[:, :n] = [[d.request.params.temperature for d in decodes], [d.request.params.top_p for d in decodes],
                             [d.request.params.min_p for d in decodes],
                             [d.request.params.temperature if sample_drafts else 0.0 for d in decodes]]


@dataclass
class Emitted:
    request: Request
    tokens: list[int]  # drafts kept, then the model's own token
    drafted: int
    accepted: int
    rows: torch.Tensor | None  # [K+1, V] float32, device: this lane's verify logits, when its request asks logprobs


@dataclass(frozen=True)
class Launched:
    """Rounds queued on the device: their lanes, the bucket whose host mirror receives their committed tokens, how
    many rounds (each starting from the last one's outputs), the first host slot they fill, and an event recorded
    after their tokens' copy (None on the CPU, where the work is done when it is queued)."""

    decodes: list[Decode]
    buffers: RoundBuffers
    rounds: int = 1
    slot: int = 0
    done: torch.cuda.Event | None = None


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on the device's current stream (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class DeviceRound:
    def __init__(
        self,
        model: HybridModel,
        cache: LaneCache,
        backend: SpecBackend,
        device: torch.device,
        *,
        sample_drafts: bool,
        rounds_per_sync: int = 1,
        verify: Rule = "block",
    ) -> None:
        """rounds_per_sync: the most rounds queued before one read (engine.rounds_per_sync); verify: how sampled lanes'
        drafts are judged (spec.verify)."""
        self.model, self.cache, self.backend, self.device = model, cache, backend, device
        self.sample_drafts = sample_drafts
        self.accept_sampled = accept_block if verify == "block" else accept_sampled
        self.k = backend.draft_tokens
        self.cols = self.k + 1
        self.offsets = torch.arange(self.cols, dtype=torch.int64, device=device)  # [C] int64, device
        self.buckets = buckets(cache.lanes)
        self.spans = spans(cache.context + cache.max_cols)
        # host slots: a chain's rounds, and at least two (a round read while the next one runs, `follow`)
        slots = max(rounds_per_sync, 2)
        self.buffers = {b: RoundBuffers(b, self.k, cache.scratch, device, slots) for b in self.buckets}
        self.graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self.pool: Any = None  # the graphs' shared memory pool (torch.cuda.graph_pool_handle())
        # the most rows of a round whose kernels launch programmatic-dependent (when launch.PDL leaves it to the round)
        self.pdl_rows = PACKED_PDL_ROWS if repacked(model) else 0

    def run(self, decodes: list[Decode], rounds: int = 1) -> list[Emitted]:
        """`rounds` rounds for these lanes (at most `cache.lanes`): their committed tokens, round by round."""
        launched = self.start(decodes, rounds)
        synchronize(self.device)
        return self.collect(launched)

    def start(self, decodes: list[Decode], rounds: int = 1) -> Launched:
        """Queue `rounds` rounds for these lanes (at most `cache.lanes`; rounds at most `max_rounds`), each after the
        first starting from the last one's outputs on the device (`RoundBuffers.advance`), and the copy of each one's
        committed tokens to the host; `collect` reads them after the caller's sync (or `wait`). Every lane must have
        room for `rounds` rounds of its drafts (the scheduler's chained plans)."""
        reqs = [d.request for d in decodes]
        size = next(b for b in self.buckets if b >= len(reqs))
        buf = self.buffers[size]
        buf.load(decodes, self.sample_drafts)
        self._replay(buf, reqs, rounds, 0, rounds)
        return Launched(decodes, buf, rounds, 0, buf.record(rounds - 1))

    def follow(self, launched: Launched) -> Launched:
        """Queue one more round of the same lanes after `launched` (engine.async_scheduling), before the host has
        read it: its inputs are the last queued round's outputs on the device, its tokens go to the next host slot.
        The lanes keep their drafts and sampling; each must have room for it (`Scheduler.follow`)."""
        reqs = [d.request for d in launched.decodes]
        slot = (launched.slot + launched.rounds) % self.max_rounds
        buf = launched.buffers
        buf.advance(len(reqs))
        # the host's tokens are a round behind the device's: the span covers the queued round's columns too
        self._replay(buf, reqs, 1, slot, 2)
        return Launched(launched.decodes, buf, 1, slot, buf.record(slot))

    def _replay(self, buf: RoundBuffers, reqs: list[Request], rounds: int, slot: int, span_rounds: int) -> None:
        """`rounds` rounds of these lanes from the inputs in `buf`, each after the first advancing them, under the key
        span of `span_rounds` rounds past the lanes' host-known tokens: each replays its key's graph (or runs eagerly)
        and copies its tokens to the next host slot from `slot` on."""
        span = self.span_for(max(len(r.tokens) for r in reqs), span_rounds)
        sampling = Sampling.of(reqs, self.model.config.vocab_size)
        graph = self.graphs.get((buf.size, span, sampling))
        for i in range(rounds):
            if i:
                buf.advance(len(reqs))
            if graph is not None:
                graph.replay()
            else:
                self.forward(buf, span, sampling)
            buf.send(slot + i)

    def wait(self, launched: Launched) -> None:
        """Wait until `launched`'s tokens are on the host, not for work queued after it."""
        if launched.done is not None:
            launched.done.synchronize()
        else:
            synchronize(self.device)

    def span_for(self, tokens: int, rounds: int = 1) -> int:
        """The key span of `rounds` chained rounds of lanes holding at most `tokens` tokens: the smallest rung that
        covers the last round's verify columns."""
        return next(s for s in self.spans if s >= tokens + self.k + (rounds - 1) * self.cols)

    @property
    def max_rounds(self) -> int:
        """The most rounds `start` queues before one read (the host slots each bucket holds)."""
        return self.buffers[self.buckets[0]].host_out.shape[0]

    def collect(self, launched: Launched) -> list[Emitted]:
        """The committed tokens of started rounds, round by round and in each in the lanes' order; the caller has
        synchronised since `start`. Verify logits (for logprobs) are the last round's only: a lane that asks for them
        runs one round at a time."""
        first = launched.slot
        out, k = launched.buffers.host_out[first : first + launched.rounds].tolist(), self.k
        logits = launched.buffers.logits
        emitted: list[Emitted] = []
        for rows_out in out:
            for i, (d, row) in enumerate(zip(launched.decodes, rows_out)):
                accepted = row[0]
                rows = logits[i] if d.request.params.logprobs is not None else None  # a view a lane costs, else unread
                emitted.append(Emitted(d.request, row[1 : 1 + accepted] + [row[k + 1]], d.drafts, accepted, rows))
        return emitted

    @torch.inference_mode()
    def forward(self, buf: RoundBuffers, span: int, sampling: int) -> None:
        """The round as device work on `buf`'s inputs; writes buf.out and buf.logits, the verify logits [B, C, V]
        (one buffer a bucket, shared by its graphs: memory does not grow with the number of spans). Its products
        take the BLAS library `products_for` picks for its rows, and its kernels launch programmatic-dependent where
        ignis.kernels.launch says rounds of its rows should."""
        rows = buf.size * self.cols
        with products_for(rows, self.device), dependent_launches(rows <= self.pdl_rows):
            self._forward(buf, span, sampling)

    def _forward(self, buf: RoundBuffers, span: int, sampling: int) -> None:
        model, backend, k, b = self.model, self.backend, self.k, buf.size
        lanes, anchors, start = buf.lanes, buf.anchors, buf.positions
        # 1. propose
        if k:
            # no uniforms where no lane draws its drafts (all greedy, or spec.draft_sampling = greedy): one-hot q
            u = uniforms(buf.seeds, start, STREAM_DRAFT, k) if sampling and self.sample_drafts else None
            # q cut as the request cuts p
            choice = Choice(buf.draft_temperature, u, buf.top_k, buf.top_p, buf.min_p, sampling == Sampling.GREEDY)
            proposal = backend.propose_lanes(lanes, anchors, start, k, choice, span)
            drafts, q = proposal.tokens, proposal.q
        else:
            drafts, q = anchors[:, None][:, :0], None
        tokens = torch.cat([anchors[:, None], drafts], dim=1) if k else anchors[:, None]  # [B, C]
        positions = start[:, None] + self.offsets  # [B, C]
        # 2. verify
        step = model.decode_step(lanes, positions, span=span, record=k > 0)
        hidden, taps = model.decode(tokens, step, self.cache, taps=backend.tap_layers)
        shape = (b, self.cols, model.config.vocab_size)
        if buf.logits.shape != shape:  # the first run of the bucket, before any capture
            buf.logits = torch.empty(shape, dtype=torch.float32, device=hidden.device)
        logits = model.logits(hidden, out=buf.logits)
        # 3. accept
        argmax, sampled = logits.argmax(dim=-1), None
        if sampling:
            c = self.cols
            temp, top_k, top_p, min_p = (t.repeat_interleave(c) for t in (buf.temperature, buf.top_k, buf.top_p,
                                                                           buf.min_p))
            cols = None
            if sampling == Sampling.CANDIDATES:
                cols, p = shape_candidates(logits.reshape(b * c, -1), temp, top_k, top_p, min_p,
                                           width=min(CANDIDATES, logits.shape[-1]))
                cols, p = cols.view(b, c, -1), p.view(b, c, -1)
            else:
                p = shape_probs(logits.reshape(b * c, -1), temp, top_k, top_p, min_p).view(b, c, -1)
            a_s, t_s = self.accept_sampled(drafts, p, q, uniforms(buf.seeds, start, STREAM_ACCEPT, k),
                                           uniforms(buf.seeds, start, STREAM_BONUS, 1)[:, 0], buf.allowed, cols)
            sampled = (a_s, t_s, buf.greedy)
        # the greedy prefix, the sampled lanes' results, the rows' following tokens and buf.out: one launch on CUDA
        accepted, _, following = settle(drafts, argmax, buf.allowed, buf.out, sampled)
        # 4. commit
        if k:
            self.cache.commit_lanes(lanes, accepted)
        backend.observe_lanes(
            Committed(lanes, positions, tokens, following, hidden.view(b, self.cols, -1),
                      taps.view(b, self.cols, -1) if taps is not None else None, accepted, step),
            span,
        )

    def keys(self) -> list[tuple[int, int, int]]:
        """Every (bucket, span, sampling) a round can take, the largest bucket first (its memory is then reused)."""
        return [(b, s, m) for b in reversed(self.buckets) for s in self.spans for m in Sampling.ALL]

    def sampling_of(self, decodes: list[Decode]) -> int:
        """The `Sampling` a round of these lanes takes (the third part of its graph key)."""
        return Sampling.of([d.request for d in decodes], self.model.config.vocab_size)

    def capture(self, keys: list[tuple[int, int, int]] | None = None) -> float:
        """Capture a graph for every key (default: all); returns the seconds it took. Runs on the scratch lane only,
        so no lane's state changes."""
        t0 = time.perf_counter()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()

        def runs() -> Iterator[tuple[tuple[int, int, int], Callable[[], None]]]:
            for size, span, sampling in keys if keys is not None else self.keys():
                buf = self.buffers[size]
                buf.idle()
                yield (size, span, sampling), partial(self.forward, buf, span, sampling)

        self.graphs.update(capture_graphs(runs(), self.pool, self.device))
        return time.perf_counter() - t0


K = TypeVar("K")


def capture_graphs(runs: Iterable[tuple[K, Callable[[], None]]], pool: Any, device: torch.device,
                   ) -> dict[K, torch.cuda.CUDAGraph]:
    """One CUDA graph per (key, device work): each run once on a side stream first (library handles, kernel loads and
    compiles), then captured into the graph memory pool `pool`. The inputs each run reads must be ready when the
    iterator yields it. No garbage collection runs while it captures (`collected`)."""
    graphs: dict[K, torch.cuda.CUDAGraph] = {}
    side = torch.cuda.Stream(device)
    with collected():
        for key, run in runs:
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                run()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=side):
                run()
            torch.cuda.current_stream(device).wait_stream(side)
            graphs[key] = graph
    torch.cuda.synchronize(device)
    return graphs


@contextmanager
def collected() -> Iterator[None]:
    """Garbage collected on entry and not again until exit. A dead reference cycle that holds CUDA objects (an earlier
    engine's graphs, their memory pool, its pinned buffers) is then freed before a capture begins, not by the
    automatic collector in the middle of one, where their release could invalidate the capture (torch stopped
    collecting on entering torch.cuda.graph)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
