"""`ProcessClient`: the blocking EngineClient over a socket, to a GPU process it starts or one already running.

Owns: the request bookkeeping of a synchronous client (which ids are live, deltas and replies that arrived
while waiting for something else), failing live requests when the engine goes away, and stopping what it
started on close. Does not own: liveness rules (ignis.client.link) or the wire (ignis.ipc).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

import msgspec

from ignis.client.link import EngineLink, OwnedEngine, new_client_id, rejection_error
from ignis.config import IgnisConfig
from ignis.errors import EngineDeadError
from ignis.ipc.messages import (
    Abort,
    Deltas,
    EngineInfo,
    EngineRequest,
    EngineStats,
    Rejected,
    RequestDelta,
    UtilityCall,
    UtilityReply,
)
from ignis.ipc.queues import ClientSocket
from ignis.params import check_prompt

POLL_S = 0.1  # the longest a blocked call goes without checking the watchdog and the child process


class ProcessClient:
    """EngineClient over ZeroMQ. With no `address` it starts the GPU process as a child on a private address."""

    info: EngineInfo

    def __init__(self, config: IgnisConfig, address: str | None = None, *, start_timeout_s: float | None = None) -> None:
        self.config = config
        self._owned = OwnedEngine(config, self) if address is None else None
        self.address: str = self._owned.address.address if self._owned is not None else str(address)
        self.client_id = new_client_id()
        # Ids on the wire carry the client's prefix, so callers of different clients may reuse the same ids.
        self._prefix = f"{self.client_id:08x}-"
        self._sock = ClientSocket(self.address, self.client_id)
        self._link = EngineLink(self.client_id, config.server.engine_timeout_s)
        self._live: set[str] = set()
        self._pending: list[RequestDelta] = []
        self._refused: list[Rejected] = []
        self._replies: dict[int, UtilityReply] = {}
        self._calls = itertools.count(1)
        try:
            self.wait_ready(start_timeout_s)
        except BaseException:
            self.close()
            raise
        assert self._link.info is not None
        self.info = self._link.info

    @property
    def ready(self) -> bool:
        return self._link.ready

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Block until the engine answers. A child that dies first, or silence past the timeout, raises.

        Without a timeout a child is waited for as long as it runs (loading a large model takes minutes);
        a running engine reached by address gets max(30 s, server.engine_timeout_s).
        """
        if timeout_s is None and self._owned is None:
            timeout_s = max(30.0, self.config.server.engine_timeout_s)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._link.ready:
            self._pump(POLL_S)
            if self._link.failed or (self._owned is not None and self._owned.exit_reason()):
                raise self._link.start_error()
            if deadline is not None and time.monotonic() > deadline:
                raise EngineDeadError(f"no engine answered at {self.address} within {timeout_s:g} s")
        self._link.take_down()

    def add(self, req: EngineRequest) -> None:
        self._pump(0.0)
        self._raise_if_down()
        check_prompt(req.prompt_token_ids, context=self.info.context, vocab_size=self.info.vocab_size)
        self._sock.send(msgspec.structs.replace(req, id=self._prefix + req.id, client=self.client_id))
        self._live.add(req.id)

    def abort(self, ids: Sequence[str]) -> None:
        wire = [self._prefix + i for i in ids if i in self._live]
        if wire:
            self._sock.send(Abort(ids=wire))

    def get_deltas(self, timeout: float | None = None) -> list[RequestDelta]:
        """Deltas since the last call. Raises EngineDeadError for live requests of an engine that went away,
        and the refusal (InputError, QueueFullError) of a request the engine did not take."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = POLL_S if deadline is None else min(POLL_S, max(0.0, deadline - time.monotonic()))
            self._pump(0.0 if self._pending else left)
            if self._refused:
                raise rejection_error(self._refused.pop(0))
            self._raise_if_down()
            if self._pending or (deadline is not None and time.monotonic() >= deadline):
                out, self._pending = self._pending, []
                return out

    def stats(self) -> EngineStats:
        call_id = next(self._calls)
        self._raise_if_down()
        self._sock.send(UtilityCall(call_id=call_id, method="stats"))
        while call_id not in self._replies:
            self._pump(POLL_S)
            self._raise_if_down()
        reply = self._replies.pop(call_id)
        if reply.stats is None:
            raise EngineDeadError(f"the engine could not report stats: {reply.error}")
        return reply.stats

    def close(self) -> None:
        if self._live and self._link.ready:
            self._sock.send(Abort(ids=[self._prefix + i for i in sorted(self._live)]))
        self._live.clear()
        if hasattr(self, "_sock"):
            self._sock.close(linger_s=0.5 if self._link.ready else 0.0)
        if self._owned is not None:
            self._owned.finalize()

    def __enter__(self) -> ProcessClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _pump(self, timeout_s: float) -> None:
        for item in self._sock.recv(timeout_s):
            hello = self._link.feed(item)
            if hello is not None:
                self._sock.send(hello)
            if isinstance(item, Deltas):
                for d in item.deltas:
                    rid = d.id.removeprefix(self._prefix)
                    if rid in self._live:
                        self._pending.append(msgspec.structs.replace(d, id=rid))
                        if d.finished:
                            self._live.discard(rid)
                    elif not d.finished:
                        self._sock.send(Abort(ids=[d.id]))  # a request this client already gave up on
            elif isinstance(item, Rejected) and (rid := item.id.removeprefix(self._prefix)) in self._live:
                self._live.discard(rid)
                self._refused.append(msgspec.structs.replace(item, id=rid))
            elif isinstance(item, UtilityReply):
                self._replies[item.call_id] = item
        self._link.check()
        if self._owned is not None and self._link.ready and (why := self._owned.exit_reason()):
            self._link.mark_down(why)

    def _raise_if_down(self) -> None:
        reason = self._link.take_down() or (None if self._link.ready else self._link.down_reason)
        if reason is not None:
            self._live.clear()
            self._pending.clear()
            raise EngineDeadError(reason)
