"""The GPU process as one client sees it: connected or not, ready or not, alive or not, and why not.

Owns: the client side of the handshake (a Hello on every connect, ready on Ready), the heartbeat watchdog, the
reason a client gives its requests when the engine goes away, the mapping of refusals and engine-dead frames to
ignis errors, and the GPU process a client started itself (with its private address). Does not own: sockets
(ignis.ipc.queues) or request bookkeeping (ignis.client.process_client, ignis.client.async_client).
"""

from __future__ import annotations

import os
import secrets
import time
import weakref

from ignis.config import IgnisConfig
from ignis.errors import ArtifactError, ConfigError, EngineDeadError, IgnisError, InputError, QueueFullError
from ignis.ipc.addresses import EngineAddress, engine_address
from ignis.ipc.messages import EngineDead, EngineInfo, EngineMessage, Heartbeat, Hello, Ready, Rejected
from ignis.ipc.queues import Link
from ignis.logging import get_logger

log = get_logger(__name__)


def new_client_id() -> int:
    # Random, so a restarted front-end or a second embedded client never takes over another's routing id.
    return secrets.randbits(31)


class EngineLink:
    """Liveness of the engine for one client. Feed it everything the socket yields; ask it whether to serve."""

    def __init__(self, client: int, timeout_s: float, secret: str = "") -> None:
        self.client = client
        self.timeout_s = timeout_s
        self.secret = secret  # a tcp engine's per-start secret, said in every Hello
        self.refused: str | None = None  # why the engine would not take this client, if it said so
        self.info: EngineInfo | None = None
        self.ready = False
        self.down_reason: str | None = "the GPU process has not answered yet"
        self.dead: EngineDead | None = None  # the engine-dead frame, if the engine sent one
        self.last_seen = time.monotonic()
        self.round_s = 0.0  # how long the engine's round in progress had run, at its last heartbeat
        self._stalled = False  # down for silence only: a heartbeat brings it back
        self._fresh_down: str | None = None

    def feed(self, item: EngineMessage | Link) -> Hello | None:
        """Update from one socket item; returns a Hello when one must be sent (on every new connection)."""
        now = time.monotonic()
        if item is Link.CONNECTED:
            return Hello(client=self.client, pid=os.getpid(), secret=self.secret)
        if item is Link.DISCONNECTED:
            self.mark_down("the GPU process closed its connection (it exited or crashed)")
            return None
        self.last_seen = now
        if isinstance(item, Ready):
            self.info, self.ready, self.down_reason, self.dead, self._stalled = item.info, True, None, None, False
            self.round_s = 0.0
        elif isinstance(item, EngineDead):
            self.dead = item
            self.mark_down(f"the engine died: {item.reason}")
        elif isinstance(item, Rejected) and item.kind == "unauthenticated":
            self.refused = f"the engine refused this client: {item.message} (the secret of a tcp engine is handed " \
                           "only to the processes its starter made)"
            self.mark_down(self.refused)
        elif isinstance(item, Heartbeat):
            self.round_s = item.round_s
            if self._stalled:
                self.ready, self.down_reason, self._stalled = True, None, False
                log.info("ignis.client.engine_answering_again")
        return None

    def check(self) -> None:
        """The watchdog: a ready engine silent for longer than the timeout is stuck (or dead)."""
        if self.ready and time.monotonic() - self.last_seen > self.timeout_s:
            self.mark_down(f"no heartbeat from the GPU process for {self.timeout_s:g} s (server.engine_timeout_s)")
            self._stalled = True

    def problem(self) -> str | None:
        """Why the engine cannot serve now (down, or stuck in one round for longer than the timeout), or None."""
        if not self.ready:
            return self.down_reason or "the engine is not ready"
        if self.round_s > self.timeout_s:
            return f"the engine has been in one round for {self.round_s:.1f} s (server.engine_timeout_s)"
        return None

    def mark_down(self, reason: str) -> None:
        if self.ready or reason != self.down_reason:
            log.warning("ignis.client.engine_down", reason=reason)
        self.ready, self.down_reason, self._stalled = False, reason, False
        self._fresh_down = reason

    def take_down(self) -> str | None:
        """The reason the engine went down since the last call, once: in-flight requests fail with it."""
        reason, self._fresh_down = self._fresh_down, None
        return reason

    @property
    def failed(self) -> bool:
        """The engine said it will not serve this client (it died, failed to start, or refused it)."""
        return self.dead is not None or self.refused is not None

    def start_error(self) -> IgnisError:
        """The error to raise when the engine never became ready."""
        if self.refused is not None:
            return EngineDeadError(self.refused)
        if self.dead is not None:
            return dead_error(self.dead)
        return EngineDeadError(self.down_reason or "the GPU process did not become ready")


def dead_error(dead: EngineDead) -> IgnisError:
    if dead.kind == "artifact":
        return ArtifactError(dead.reason)
    if dead.kind == "config":
        return ConfigError(dead.key or "config", dead.reason)
    return EngineDeadError(f"the engine died: {dead.reason}")


def rejection_error(rej: Rejected) -> IgnisError:
    if rej.kind == "queue_full":
        return QueueFullError(rej.message)
    if rej.kind == "unauthenticated":
        return EngineDeadError(f"the engine refused this client: {rej.message}")
    return InputError(rej.field or "request", rej.message)


class OwnedEngine:
    """A GPU process a client started as its child, with the private address it listens on.

    Stopped by `close`, or when its owner is garbage-collected or the interpreter exits, whichever comes first.
    """

    def __init__(self, cfg: IgnisConfig, owner: object) -> None:
        from ignis.engine.process import EngineProcess

        self.address: EngineAddress = engine_address("ipc", "")
        self.process = EngineProcess(cfg, self.address.address)
        # Call to stop the child now; runs by itself when `owner` is collected or the interpreter exits.
        self.finalize = weakref.finalize(owner, self.close)

    def exit_reason(self) -> str | None:
        """Why the child is gone, or None while it runs."""
        if self.process.alive():
            return None
        return f"the GPU process exited with code {self.process.exitcode}; its log is above"

    def close(self) -> None:
        self.process.stop()
        self.address.close()

