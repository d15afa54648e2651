"""`AsyncEngineClient`: the asyncio client of a GPU process, shared by front-ends and `ignis.AsyncLLM`.

Owns: one reader task that routes each delta to the queue of the request it belongs to, utility calls as futures,
failing every in-flight request promptly when the engine goes away (engine-dead frame, lost connection, a child
that exited, or no heartbeat within `server.engine_timeout_s`), and stopping a GPU process it started. Does not
own: text (ignis.client.output), HTTP (ignis.server) or liveness rules (ignis.client.link).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from typing import TypeAlias

import msgspec

from ignis.client.link import EngineLink, OwnedEngine, new_client_id, rejection_error
from ignis.config import IgnisConfig
from ignis.errors import EngineDeadError
from ignis.ipc.messages import Abort, Deltas, EngineInfo, EngineRequest, EngineStats, Rejected, RequestDelta, UtilityCall, UtilityReply
from ignis.ipc.queues import AsyncClientSocket
from ignis.logging import get_logger

log = get_logger(__name__)

POLL_S = 0.1  # how often the reader wakes without traffic, to run the watchdog

# What a request's queue receives: its deltas in order, or the error that ended it.
Item: TypeAlias = RequestDelta | BaseException


class AsyncEngineClient:
    """Connects to `address`, or starts a GPU process on a private address when none is given."""

    def __init__(self, config: IgnisConfig, address: str | None = None, *, secret: str = "") -> None:
        self.config = config
        self._owned = OwnedEngine(config, self) if address is None else None
        self.address: str = self._owned.address.address if self._owned is not None else str(address)
        self.client_id = new_client_id()
        self._link = EngineLink(self.client_id, config.server.engine_timeout_s, secret)
        self._sock: AsyncClientSocket | None = None
        self._reader: asyncio.Task[None] | None = None
        self._queues: dict[str, asyncio.Queue[Item]] = {}
        self._calls: dict[int, asyncio.Future[UtilityReply]] = {}
        self._call_ids = itertools.count(1)
        self._ready = asyncio.Event()

    async def start(self, wait: bool = True, timeout_s: float | None = None) -> None:
        """Connect and start reading. With `wait`, return once the engine is ready, or raise why it is not."""
        if self._sock is None:
            self._sock = AsyncClientSocket(self.address, self.client_id)
            self._reader = asyncio.create_task(self._read(), name="ignis-engine-reader")
        if not wait:
            return
        if timeout_s is None and self._owned is None:
            timeout_s = max(30.0, self.config.server.engine_timeout_s)
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while not self._link.ready:
            if self._link.failed or (self._owned is not None and self._owned.exit_reason()):
                raise self._link.start_error()
            if deadline is not None and loop.time() > deadline:
                raise EngineDeadError(f"no engine answered at {self.address} within {timeout_s:g} s")
            try:
                await asyncio.wait_for(self._ready.wait(), POLL_S)
            except TimeoutError:
                pass

    async def until_ready(self) -> None:
        """Return once the engine has answered (after `start(wait=False)`); waits through restarts."""
        await self._ready.wait()

    @property
    def started(self) -> bool:
        return self._sock is not None

    @property
    def ready(self) -> bool:
        return self._link.ready

    @property
    def down_reason(self) -> str | None:
        return self._link.down_reason

    def problem(self) -> str | None:
        """Why the engine cannot serve now (not ready, dead, silent, or stuck in a round), or None when healthy."""
        return self._link.problem()

    @property
    def info(self) -> EngineInfo:
        if self._link.info is None:
            raise EngineDeadError(self._link.down_reason or "the engine is not ready")
        return self._link.info

    def add(self, req: EngineRequest, queue: asyncio.Queue[Item]) -> None:
        """Send a request; its deltas (or the error that ends it) go to `queue`, which several requests may share."""
        if not self._link.ready or self._sock is None:
            raise EngineDeadError(self._link.down_reason or "the engine is not ready")
        self._sock.send(msgspec.structs.replace(req, client=self.client_id))
        self._queues[req.id] = queue

    def abort(self, ids: Sequence[str]) -> None:
        """Stop requests now; nothing more arrives on their queues."""
        ids = [i for i in ids if self._queues.pop(i, None) is not None]
        if ids and self._sock is not None and self._link.ready:
            self._sock.send(Abort(ids=ids))

    async def stats(self) -> EngineStats:
        if not self._link.ready or self._sock is None:
            raise EngineDeadError(self._link.down_reason or "the engine is not ready")
        call_id = next(self._call_ids)
        fut: asyncio.Future[UtilityReply] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        self._sock.send(UtilityCall(call_id=call_id, method="stats"))
        try:
            reply = await fut
        finally:
            self._calls.pop(call_id, None)
        if reply.stats is None:
            raise EngineDeadError(f"the engine could not report stats: {reply.error}")
        return reply.stats

    async def close(self) -> None:
        if self._queues and self._sock is not None and self._link.ready:
            self._sock.send(Abort(ids=list(self._queues)))
        self._fail(EngineDeadError("the client was closed"))
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except asyncio.CancelledError:
                pass
            self._reader = None
        if self._sock is not None:
            self._sock.close(linger_s=0.5 if self._link.ready else 0.0)
            self._sock = None
        if self._owned is not None:
            await asyncio.to_thread(self._owned.finalize)

    async def _read(self) -> None:
        assert self._sock is not None
        while True:
            try:
                items = await self._sock.recv(POLL_S)
                for item in items:
                    self._dispatch(item)
                self._link.check()
                if self._owned is not None and self._link.ready and (why := self._owned.exit_reason()):
                    self._link.mark_down(why)
                if (reason := self._link.take_down()) is not None:
                    self._ready.clear()
                    self._fail(EngineDeadError(reason))
                if self._link.ready:
                    self._ready.set()
            except asyncio.CancelledError:
                raise
            except Exception:  # the reader must outlive any one bad item, or every request would hang
                log.exception("ignis.client.reader_error")

    def _dispatch(self, item: object) -> None:
        assert self._sock is not None
        hello = self._link.feed(item)  # type: ignore[arg-type]
        if hello is not None:
            self._sock.send(hello)
        if isinstance(item, Deltas):
            for d in item.deltas:
                q = self._queues.pop(d.id, None) if d.finished else self._queues.get(d.id)
                if q is not None:
                    q.put_nowait(d)
                elif not d.finished:
                    self._sock.send(Abort(ids=[d.id]))  # a request this client already gave up on
        elif isinstance(item, Rejected):
            q = self._queues.pop(item.id, None)
            if q is not None:
                q.put_nowait(rejection_error(item))
        elif isinstance(item, UtilityReply):
            fut = self._calls.get(item.call_id)
            if fut is not None and not fut.done():
                fut.set_result(item)

    def _fail(self, error: EngineDeadError) -> None:
        queues, self._queues = self._queues, {}
        for q in {id(q): q for q in queues.values()}.values():
            q.put_nowait(error)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(error)
