"""The engine: lanes, rounds and the model of one GPU, driven one round at a time.

Owns: loading the model and backend for a config, admitting requests (validated before any work starts), running
rounds and turning them into per-request deltas and stats. Does not own: processes or sockets
(ignis.engine.process), tokenizing (clients), or the round's mechanics (ignis.engine.round).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable

import torch

from ignis.artifact import model_name, resolve_device, resolve_dtype, resolve_exact, resolve_model_path
from ignis.backends.base import BackendContext
from ignis.backends.registry import load_backend
from ignis.config import MAX_DRAFT_TOKENS, IgnisConfig
from ignis.engine.defaults import cache_bytes, settle
from ignis.engine.device_prefill import DevicePrefill
from ignis.engine.device_round import DeviceRound, Launched
from ignis.engine.grammar import Grammars
from ignis.engine.lane_store import LaneStore
from ignis.engine.logits import LogitsShaper
from ignis.engine.pages import Pages
from ignis.engine.request import Request
from ignis.engine.retain import Retained
from ignis.engine.round import Emission, Runner
from ignis.engine.warmup import warm_prefill
from ignis.engine.sampling import make_generator
from ignis.engine.scheduler import Scheduler
from ignis.engine.telemetry import Telemetry
from ignis.errors import ConfigError, InputError, QueueFullError
from ignis.params import check_prompt
from ignis.ipc.messages import EngineInfo, EngineRequest, EngineStats, RequestDelta
from ignis.logging import get_logger
from ignis.model.cache import LaneCache
from ignis.model.loader import load_model
from ignis.model.pool import KVPool
from ignis.progress import Progress, StartupProgress, memory_probe

log = get_logger(__name__)

# Prefill row counts run at start-up on a GPU: about four a doubling, so every size class of the matrix kernels a
# prompt chunk can pick is loaded before ready (CUDA loads a kernel on its first use).
WARM_ROWS = [1, 2, 3, 5, 8, 12, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512]


class Engine:
    def __init__(self, config: IgnisConfig, progress: Progress | None = None) -> None:
        """Load the model, settle the defaults that depend on it (ignis.engine.defaults: `self.config` is the settled
        config), load the backend, allocate the caches and warm up (prefill, and the round's CUDA graphs on a GPU). Each
        phase reports to `progress` (default: a bar on a terminal, log lines otherwise)."""
        t0 = time.perf_counter()
        path = resolve_model_path(config)
        device = resolve_device(config)
        dtype = resolve_dtype(config, device)
        report = progress if progress is not None else StartupProgress(memory_probe(device.type))
        self.progress = report  # for start-up work done outside this constructor
        if device.type == "cpu" and config.engine.cpu_threads:
            # Many small ops a round: extra intra-op threads mostly synchronise, and stall badly on shared cores.
            torch.set_num_threads(config.engine.cpu_threads)
        self.model = load_model(path, device=device, dtype=dtype, exact=resolve_exact(config, device),
                                progress=lambda done, total: report("weights", done, total, unit="tensors"),
                                fp8=config.model.weights == "fp8", dummy=config.model.load_format == "dummy")
        config = settle(config, path, device, dtype, self.model.config)
        self.config = config
        ec = config.engine
        # The K/V pool's storage waits until the backend has added its layers (mtp's): its page count depends on them.
        pool = KVPool(self.model.config, lanes=ec.lanes, positions=ec.context + MAX_DRAFT_TOKENS + 1, pages=0,
                      device=device, dtype=dtype)
        ctx = BackendContext(self.model, config, path, ec.lanes, ec.context, device, dtype, kv=pool)
        report("drafter", 0, 1)
        self.backend = load_backend(config.spec.backend, ctx)
        settled = getattr(self.backend, "settled_spec", None)  # keys the backend settled from "auto" at load
        if settled:
            config = self.config = dataclasses.replace(config, spec=dataclasses.replace(config.spec, **settled))
        report("drafter", 1, 1, memory_bytes=self.backend.nbytes())
        k = self.backend.draft_tokens
        report("caches", 0, ec.lanes, unit="lanes")
        cache = LaneCache(self.model.config, lanes=ec.lanes, context=ec.context, max_cols=k + 1, device=device,
                          dtype=dtype, pool=pool)
        pages, lane_pages = ec.kv_memory // pool.page_bytes(), -(-(ec.context + k + 1) // pool.page)
        if pages < lane_pages:
            raise ConfigError("engine.kv_memory", f"{ec.kv_memory} bytes hold {pages} pages of {pool.page} positions "
                              f"in {len(pool.layers)} attention layers, fewer than one lane's context of {ec.context} "
                              f"and a round's {k + 1} columns: raise engine.kv_memory or lower engine.context")
        pool.allocate(pages)
        self._cache_bytes = cache.nbytes()
        report("caches", ec.lanes, ec.lanes, unit="lanes", memory_bytes=self._cache_bytes)
        self.telemetry = Telemetry(*cache_bytes(self.model.config, k, dtype))
        if not self.model.exact:  # every position a round can reach, tabulated once
            for rope in (self.model.rope, *([self.model.mtp.rope] if self.model.mtp is not None else [])):
                rope.precompute(ec.context + k + 2, device, dtype)
        sample_drafts = config.spec.draft_sampling == "sampled"
        started = time.perf_counter()
        report("warmup", 0, 1)
        most = min(ec.max_rows, ec.context)
        # On a GPU every row count class of the matrix kernels is loaded before ready; the CPU has nothing to load.
        ladder = WARM_ROWS if device.type == "cuda" else [2 * ec.prefill_chunk + 3, 1]
        warm_prefill(self.model, cache, self.backend, rows=sorted({min(n, most) for n in ladder}))
        device_round = device_prefill = None
        graphs = prefill_graphs = 0
        if not self.model.exact and getattr(self.backend, "graph_safe", False):
            device_round = DeviceRound(self.model, cache, self.backend, device, sample_drafts=sample_drafts,
                                       rounds_per_sync=ec.rounds_per_sync, verify=config.spec.verify)
            device_prefill = DevicePrefill(self.model, cache, self.backend, device)
            if device.type == "cuda" and ec.cuda_graphs:
                device_round.capture()
                device_prefill.capture(device_round.pool)
                graphs, prefill_graphs = len(device_round.graphs), len(device_prefill.graphs)
        report("warmup", 1, 1)
        self.store = LaneStore(cache, self.backend, device)
        self.runner = Runner(self.model, cache, self.backend, device, sample_drafts, device_round, self.store,
                             device_prefill, verify=config.spec.verify)
        retained = Retained(ec.retained_host_memory, self.store.state_bytes) if self.store.retains else None
        self.pages = Pages(pages=pool.pages, page=pool.page, lanes=ec.lanes, width=lane_pages)
        self.scheduler = Scheduler(
            rounds_per_sync=ec.rounds_per_sync if device_round is not None else 1,
            lanes=ec.lanes,
            max_rows=ec.max_rows,
            prefill_chunk=ec.prefill_chunk,
            max_waiting=ec.max_waiting,
            draft_tokens=k,
            context=ec.context,
            retained=retained,
            pages=self.pages,
        )
        self.info = EngineInfo(
            model_name=model_name(config, path),
            context=ec.context,
            lanes=ec.lanes,
            backend=self.backend.name,
            draft_tokens=k,
            vocab_size=self.model.config.vocab_size,
            eos_token_ids=list(self.model.config.eos_token_ids),
            draft_head=(settled or {}).get("draft_head", ""),
        )
        # a decode round queued and not yet read (engine.async_scheduling): the next step reads it
        self._pending: Launched | None = None
        self._async = ec.async_scheduling and device_round is not None
        self._stats = EngineStats(position_drafted=[0] * k, position_accepted=[0] * k)
        self._seeds = make_generator(ec.seed)
        self._grammars = Grammars(path / "tokenizer.json", self.model.config.vocab_size, list(self.model.config.eos_token_ids))
        log.info(
            "ignis.engine.ready",
            model=str(path),
            device=str(device),
            dtype=str(dtype).removeprefix("torch."),
            backend=self.backend.name,
            draft_tokens=k,
            lanes=ec.lanes,
            context=ec.context,
            cache_mib=round(self._cache_bytes / 2**20, 1),
            kv_pages=pool.pages,
            kv_positions=pool.pages * pool.page,
            kv_whole_contexts=pool.pages // lane_pages,  # lanes that can hold a whole context at once
            backend_mib=round(self.backend.nbytes() / 2**20, 1),
            round="device" if device_round is not None else "host",
            cuda_graphs=graphs,
            prefill_graphs=prefill_graphs,
            # rounds of up to this many rows ask for programmatic dependent launch (a 4-bit target's)
            pdl_rows=device_round.pdl_rows if device_round is not None else 0,
            warmup_s=round(time.perf_counter() - started, 2),
            startup_s=round(time.perf_counter() - t0, 2),
        )

    def add(self, req: EngineRequest, *, forced: list[int] | None = None) -> None:
        """Validate and queue one request. Raises InputError or QueueFullError; nothing is queued then.

        forced: teacher forcing for acceptance replay (tools.acceptance): the request emits exactly these tokens,
        while its stats count what the acceptance rule would have accepted at each round."""
        try:
            self._add(req, forced)
        except InputError:
            self.telemetry.refused("input")
            raise
        except QueueFullError:
            self.telemetry.refused("queue_full")
            raise

    def _add(self, req: EngineRequest, forced: list[int] | None) -> None:
        check_prompt(req.prompt_token_ids, context=self.config.engine.context, vocab_size=self.model.config.vocab_size)
        if self.scheduler.find(req.id) is not None:
            raise InputError("request_id", f"{req.id!r} is already running; use a unique id")
        if forced is not None and (not forced or len(forced) != req.params.max_tokens):
            raise InputError("forced", "needs one token per max_tokens (the recorded continuation)")
        shaper = self._shaper(req) if req.params.shapes_logits else None
        if self.scheduler.queue_full():
            raise QueueFullError(f"the queue is full ({self.config.engine.max_waiting} waiting); retry later")
        seed = req.params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (), generator=self._seeds).item())
        self.scheduler.add(
            Request(
                id=req.id,
                prompt=list(req.prompt_token_ids),
                params=req.params,
                stop_ids=frozenset(req.stop_token_ids),
                generator=make_generator(seed),
                seed=seed,
                client=req.client,
                forced=forced,
                shaper=shaper,
            )
        )
        self._stats.requests_total += 1
        self._stats.prompt_tokens_total += len(req.prompt_token_ids)
        if self.backend.draft_tokens > 0:
            self._stats.speculative_requests += 1

    def _shaper(self, req: EngineRequest) -> LogitsShaper:
        p, vocab = req.params, self.model.config.vocab_size
        bad = [t for t in (p.logit_bias or {}) if t >= vocab]
        if bad:
            raise InputError("logit_bias", f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        matcher = self._grammars.matcher(p.structured_outputs) if p.structured_outputs is not None else None
        return LogitsShaper(p, len(req.prompt_token_ids), matcher)

    def abort(self, ids: Iterable[str]) -> list[RequestDelta]:
        deltas = []
        for rid in ids:
            r = self.scheduler.find(rid)
            if r is None:
                continue
            self.scheduler.release(r)
            r.finish_reason = "abort"
            self.telemetry.finished(r, time.perf_counter())
            deltas.append(self._delta(r, []))
        return deltas

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting) or bool(self.scheduler.running) or self._pending is not None

    def step(self) -> list[RequestDelta]:
        """One round for every lane; a delta for each request that emitted tokens or finished. With
        engine.async_scheduling a round of decoding lanes only is queued and read by the next step, which first
        queues the lanes' next round where the scheduler lets it follow (`Scheduler.follow`): the host reads and
        streams round t while round t + 1 runs."""
        if self._pending is not None:
            return self._read_pending()
        plan = self.scheduler.plan()
        if plan.empty:
            return []
        if self._async and self.runner.defers(plan):
            self._pending = self.runner.start(plan)
            return []
        emissions = self.runner.run(plan)
        return [d for e in emissions if (d := self._finish(e)) is not None]

    def _read_pending(self) -> list[RequestDelta]:
        """Queue the pending round's lanes' next round where they may follow it, then read the pending round."""
        pending, self._pending = self._pending, None
        assert pending is not None
        pages = self.scheduler.follow(pending.decodes)
        following = self.runner.follow(pending, pages) if pages is not None else None
        emissions = self.runner.finish(pending)
        self._pending = following
        return [d for e in emissions if (d := self._finish(e)) is not None]

    def stats(self) -> EngineStats:
        s = self._stats
        s.running = len(self.scheduler.running)
        s.waiting = len(self.scheduler.waiting)
        self.telemetry.fill(s, self.scheduler.running, self.config.engine.lanes, self._cache_bytes)
        pages, kept = self.pages, self.scheduler.retained
        s.preemptions = self.scheduler.preemptions
        s.kv_pages, s.kv_pages_used, s.kv_page_positions = pages.total, pages.used, pages.page
        s.kv_pages_retained = self.scheduler.retained_pages()
        if kept is not None:
            s.retained_slots = len(kept.slots)
            s.retained_hits, s.retained_misses = kept.counts.hits, kept.counts.misses
            s.prompt_tokens_resumed_total = kept.counts.resumed_tokens
            s.retained_host_bytes = self.store.nbytes
        s.retained_host_capacity_bytes = self.config.engine.retained_host_memory if kept is not None else 0
        return s

    def _finish(self, e: Emission) -> RequestDelta | None:
        """Apply one round's tokens to its request; None for a chained round after the one its request stopped in
        (its tokens are not the request's: the lane ran on for nothing)."""
        r, now = e.request, time.perf_counter()
        if r.finish_reason is not None:
            return None
        if r.stats.rounds == 0 and r.generated == 0:
            r.t_first = now
            r.stats.prompt_tokens = len(r.prompt)
            r.stats.prompt_ms = 1000.0 * (now - r.t_admit)
            self.telemetry.first_token(r, now)
        else:
            self.telemetry.round(e.accepted + 1)
            r.stats.rounds += 1
            r.stats.drafted += e.drafted
            r.stats.accepted += e.accepted
            _count(r.stats.position_drafted, e.drafted)
            _count(r.stats.position_accepted, e.accepted)
            s = self._stats
            s.rounds += 1
            s.drafted += e.drafted
            s.accepted += e.accepted
            _count(s.position_drafted, e.drafted)
            _count(s.position_accepted, e.accepted)
        kept = r.emit(e.tokens, self.config.engine.context)
        self._stats.generation_tokens_total += len(kept)
        r.stats.decode_tokens = r.generated
        r.stats.decode_ms = 1000.0 * (now - r.t_first)
        if r.finish_reason is not None:
            self.scheduler.release(r)
            self.telemetry.finished(r, now)
        logprobs = e.logprobs[: len(kept)] if e.logprobs is not None else None
        return self._delta(r, kept, logprobs)

    @staticmethod
    def _delta(r: Request, tokens: list[int], logprobs: list[dict[int, float]] | None = None) -> RequestDelta:
        done = r.finish_reason is not None
        return RequestDelta(
            id=r.id,
            token_ids=tokens,
            finished=done,
            finish_reason=r.finish_reason,
            stop_token_id=r.stop_token_id,
            stats=r.stats if done else None,
            logprobs=logprobs,
        )


def _count(per_position: list[int], n: int) -> None:
    for i in range(n):
        if i < len(per_position):
            per_position[i] += 1
        else:
            per_position.append(1)


