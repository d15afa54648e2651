"""The GPU process: one engine behind one socket, and the handle a parent uses to start and stop it.

Owns: the process's entry point (`python -m ignis.engine.process`, `run`), its loop (`serve`: take messages ->
round -> send deltas, with eager aborts), the heartbeat thread, which client owns which request, freeing the
lanes of a client that vanished, the engine-dead frame on an unrecoverable error, who may talk to it (a tcp
engine's per-start secret, checked before any request is taken), and `EngineProcess`, a parent's handle on it.
Does not own: the round (ignis.engine.core), the wire (ignis.ipc), tokenizing or HTTP
(front-ends), or restarting a dead process (its parent).

A client is detected as gone by the socket (ignis.ipc.queues): a disconnect makes the engine probe its clients,
and the unreachable one is gone; its requests are aborted and their lanes freed before the next round.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import os
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING

import msgspec

from ignis.config import IgnisConfig
from ignis.errors import ArtifactError, ConfigError, InputError, QueueFullError
from ignis.ipc.messages import (
    Abort,
    ClientMessage,
    Deltas,
    EngineDead,
    EngineRequest,
    Hello,
    Ready,
    Rejected,
    RequestDelta,
    UtilityCall,
    UtilityReply,
)
from ignis.ipc.queues import EngineSocket
from ignis.ipc.spawn import Child, parent_gone, read_start
from ignis.logging import configure, get_logger

if TYPE_CHECKING:
    from ignis.engine.core import Engine

log = get_logger("ignis.engine.process")  # not __name__: this module runs as __main__

START_FAILURE_GRACE_S = 1.0  # after a failed start, answer late hellos with the reason for this long


def run(cfg: IgnisConfig, address: str, parent_pid: int, secret: str = "") -> None:
    """Entry point of the spawned GPU process. Exits 0 when told to stop (SIGTERM), 1 after engine-dead."""
    configure(cfg.log.level, cfg.log.format)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the parent decides
    sock = EngineSocket(address, max_frame_bytes(cfg))
    try:
        from ignis.engine.core import Engine

        engine = Engine(cfg)
    except Exception as e:
        log.exception("ignis.engine.start_failed")
        _refuse_start(sock, _dead(e))
        raise SystemExit(1) from None
    serve(engine, sock, cfg.server.heartbeat_s, stop, parent_pid, secret)


def max_frame_bytes(cfg: IgnisConfig) -> int:
    """The largest frame a client may send: a whole-context prompt and as many stop ids, with room to spare.
    Front-ends refuse anything larger before it is tokenized; this guards the engine from other senders."""
    return 2**20 + 16 * cfg.engine.context


def serve(engine: Engine, sock: EngineSocket, heartbeat_s: float, stop: threading.Event, parent_pid: int = 0,
          secret: str = "") -> None:
    """Serve until `stop` is set (or the parent is gone), then close the socket. On an unrecoverable error every
    client is sent engine-dead first, and SystemExit(1) is raised. With a `secret`, a client is served only after
    a Hello that carries it."""
    owners: dict[str, int] = {}  # request id -> client that added it
    ready = Ready(info=engine.info, pid=os.getpid(), heartbeat_s=heartbeat_s)
    beat = _Heartbeat(sock, heartbeat_s)
    door = _Door(secret)
    try:
        _loop(engine, sock, owners, ready, beat, stop, parent_pid, door)
    except Exception as e:
        beat.stop()
        log.exception("ignis.engine.dead")
        sock.broadcast(_dead(e))
        sock.close(linger_s=2.0)
        raise SystemExit(1) from None
    beat.stop()
    log.info("ignis.engine.stopped")
    sock.close(linger_s=1.0)


def _loop(engine: Engine, sock: EngineSocket, owners: dict[str, int], ready: Ready, beat: _Heartbeat,
          stop: threading.Event, parent_pid: int, door: _Door) -> None:
    """The loop: take every message (aborts take effect at once), run one round, send each client its deltas."""
    next_check = 0.0
    while not stop.is_set():
        messages = sock.recv(0.0 if engine.has_work() else 1.0)
        for client in sock.take_gone():
            ids = [rid for rid, c in owners.items() if c == client]
            engine.abort(ids)  # nobody to tell: the deltas would go to the departed client
            for rid in ids:
                del owners[rid]
            log.info("ignis.engine.client_gone", client=client, aborted=len(ids))
        for client, msg in messages:
            if door.lets_in(sock, client, msg):
                _take(engine, sock, owners, ready, client, msg)
        if engine.has_work():
            with beat.round():
                deltas = engine.step()
            _send(sock, owners, deltas)
        if time.monotonic() >= next_check:
            next_check = time.monotonic() + 1.0
            if parent_pid and parent_gone(parent_pid):
                log.warning("ignis.engine.orphaned", parent=parent_pid)
                return


def _take(engine: Engine, sock: EngineSocket, owners: dict[str, int], ready: Ready, client: int, msg: ClientMessage) -> None:
    if isinstance(msg, EngineRequest):
        try:
            # The socket names the sender; the client field in the frame is not trusted.
            engine.add(msgspec.structs.replace(msg, client=client))
            owners[msg.id] = client
        except InputError as e:
            sock.send(client, Rejected(id=msg.id, kind="input", message=e.message, field=e.field))
        except QueueFullError as e:
            sock.send(client, Rejected(id=msg.id, kind="queue_full", message=str(e)))
    elif isinstance(msg, Abort):
        # Only the owner may abort a request; the freed lanes are free for the very next round.
        _send(sock, owners, engine.abort([rid for rid in msg.ids if owners.get(rid) == client]))
    elif isinstance(msg, Hello):
        sock.send(client, ready)
    elif isinstance(msg, UtilityCall):
        sock.send(client, UtilityReply(call_id=msg.call_id, stats=engine.stats()))


def _send(sock: EngineSocket, owners: dict[str, int], deltas: list[RequestDelta]) -> None:
    by_client: dict[int, list[RequestDelta]] = defaultdict(list)
    for d in deltas:
        client = owners.pop(d.id, None) if d.finished else owners.get(d.id)
        if client is not None:
            by_client[client].append(d)
    for client, ds in by_client.items():
        sock.send(client, Deltas(deltas=ds))


def _dead(e: BaseException) -> EngineDead:
    if isinstance(e, ConfigError):
        return EngineDead(reason=e.message, kind="config", key=e.key)
    if isinstance(e, ArtifactError):
        return EngineDead(reason=str(e), kind="artifact")
    return EngineDead(reason=f"{type(e).__name__}: {e}", kind="internal")


def _refuse_start(sock: EngineSocket, dead: EngineDead) -> None:
    """Tell every client that connects in the next moment why there is no engine, then close."""
    sock.broadcast(dead)
    deadline = time.monotonic() + START_FAILURE_GRACE_S
    while time.monotonic() < deadline:
        for client, _ in sock.recv(0.05):
            sock.send(client, dead)
    sock.close(linger_s=1.0)


class _Door:
    """Who may talk to the engine: everyone when there is no secret (an ipc socket in a 0700 directory); else only
    a client whose Hello carried the secret (a tcp port any local user can reach). Everything else is answered
    with Rejected "unauthenticated" and never reaches the engine."""

    def __init__(self, secret: str) -> None:
        self._secret = secret.encode()
        self._in: set[int] = set()

    def lets_in(self, sock: EngineSocket, client: int, msg: ClientMessage) -> bool:
        if not self._secret or client in self._in:
            return True
        if isinstance(msg, Hello) and hmac.compare_digest(msg.secret.encode(), self._secret):
            self._in.add(client)
            return True
        log.warning("ignis.engine.unauthenticated", client=client, kind=type(msg).__name__)
        sock.send(client, Rejected(id=getattr(msg, "id", ""), kind="unauthenticated",
                                   message="this engine takes frames only from clients that hold its secret"))
        sock.clients.discard(client)  # no heartbeats or broadcasts for it either
        return False


class _Heartbeat:
    """Beats every `every_s` from its own thread, so a long round does not look like a dead process; each beat
    says how long the round in progress has run, which is how clients tell a stuck engine from a busy one."""

    def __init__(self, sock: EngineSocket, every_s: float) -> None:
        self._sock = sock
        self._every_s = every_s
        self._round_started: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ignis-heartbeat", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def round(self) -> Iterator[None]:
        self._round_started = time.monotonic()
        try:
            yield
        finally:
            self._round_started = None

    def _run(self) -> None:
        while True:
            started = self._round_started
            self._sock.beat(round_s=0.0 if started is None else time.monotonic() - started)
            if self._stop.wait(self._every_s):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class EngineProcess:
    """A parent's handle on one GPU process it started (a fresh interpreter, so CUDA never sees a forked parent)."""

    def __init__(self, cfg: IgnisConfig, address: str, secret: str = "") -> None:
        self.address = address
        self._child = Child("ignis.engine.process", ["--address", address], cfg, secret=secret)
        self.pid = self._child.pid

    def alive(self) -> bool:
        return self._child.alive()

    @property
    def exitcode(self) -> int | None:
        return self._child.exitcode

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (the loop ends after its round), then SIGKILL if it does not exit in time. Idempotent."""
        self._child.stop(timeout_s)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ignis.engine.process", description="the GPU process (started by ignis)")
    parser.add_argument("--address", required=True)
    parser.add_argument("--parent", type=int, required=True)
    args = parser.parse_args(argv)
    cfg, secret = read_start()
    run(cfg, args.address, args.parent, secret)


if __name__ == "__main__":
    main()
