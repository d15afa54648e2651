"""ZeroMQ queues between clients and the GPU process, behind three small classes.

Owns: the sockets, their options, the monitor that reports connects and disconnects, and turning frames into
typed messages (via ignis.ipc.codec). Does not own: what a message means (ignis.engine.process on the engine
side, ignis.client.link on the client side) or the choice of address (ignis.ipc.addresses).

Why ROUTER/DEALER rather than PUSH/PULL: the GPU process binds one ROUTER and every client connects one DEALER
whose routing id is its client number, so one address carries both directions. The ROUTER names the sender of
every frame, so the engine routes deltas to the client that added the request and a client cannot act for
another. With ROUTER_MANDATORY a send to a client whose connection is gone fails at once; the engine uses that
to notice a dead front-end quickly: a disconnect event from the socket monitor makes it probe every known
client with heartbeats for a short window, and whichever is unreachable is gone (the monitor reports a file
descriptor, not a routing id, so the probe is what names the peer). PUSH/PULL would need an address per client
and reports no per-peer failure. High-water marks are off: a frame is never dropped silently for being queued.
"""

from __future__ import annotations

import enum
import os
import stat
import threading
import time
import weakref

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from ignis.ipc.codec import client_decoder, encode, engine_decoder, refusal_of
from ignis.ipc.messages import ClientMessage, EngineMessage, Heartbeat, Rejected
from ignis.logging import get_logger

log = get_logger(__name__)

PROBE_WINDOW_S = 0.5  # how long after a disconnect event the engine keeps probing its clients
PROBE_EVERY_S = 0.02
PROBE_SETTLE_S = 0.01
MAX_WAIT_S = 0.05  # the engine's longest wait on its socket, which its heartbeat thread waits behind
MAX_FRAMES_PER_RECV = 4096  # a flood of frames cannot keep the engine loop from its next round


def routing_id(client: int) -> bytes:
    return client.to_bytes(4, "big")


class Link(enum.Enum):
    """What a client's socket monitor saw: the engine's connection came up or went down."""

    CONNECTED = "connected"
    DISCONNECTED = "disconnected"


class EngineSocket:
    """The GPU process's end: one bound ROUTER, the set of clients heard from, and the probe for dead ones.

    Used by two threads: the engine loop, and a heartbeat thread that keeps beating while a round runs. A lock
    serialises every use of the socket (ZeroMQ sockets may change threads only across such a barrier), and the
    loop never holds it longer than MAX_WAIT_S while waiting for frames.
    """

    def __init__(self, address: str, max_frame_bytes: int = -1) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        # A larger frame drops its sender's connection before libzmq allocates it (-1: no limit).
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        self._sock.setsockopt(zmq.LINGER, 2000)  # long enough for the engine-dead frame to leave
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sock.bind(address)
        self._finalizer = weakref.finalize(self, _shut, self._sock, self._monitor, self._ctx, address)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._decoder = client_decoder()
        self.address = address
        self.clients: set[int] = set()
        self._gone: list[int] = []
        self._probe_until = 0.0
        self._last_probe = 0.0
        self._beats = 0
        self._lock = threading.RLock()

    @property
    def dropped(self) -> int:
        return self._decoder.dropped

    def recv(self, timeout_s: float) -> list[tuple[int, ClientMessage]]:
        """Wait up to `timeout_s` (at most MAX_WAIT_S) for a frame, then take every frame ready, with its sender."""
        with self._lock:
            return self._recv(min(timeout_s, MAX_WAIT_S))

    def _recv(self, timeout_s: float) -> list[tuple[int, ClientMessage]]:
        now = time.monotonic()
        if now < self._probe_until:
            timeout_s = min(timeout_s, PROBE_EVERY_S)
        ready = dict(self._poller.poll(int(max(0.0, timeout_s) * 1000)))
        if self._monitor in ready:
            while self._monitor.poll(0):
                self._monitor.recv_multipart()
            self._probe_until = time.monotonic() + PROBE_WINDOW_S
            self._probe_now()
        out: list[tuple[int, ClientMessage]] = []
        for _ in range(MAX_FRAMES_PER_RECV):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 2 or len(frames[0]) != 4:
                self._decoder.dropped += 1
                log.warning("ignis.ipc.dropped_frame", direction="client->engine", error="not [routing id, payload]")
                if len(frames[0]) == 4:  # a multipart message from a real peer: it is told, like any refused frame
                    self.send(int.from_bytes(frames[0], "big"), Rejected(
                        id="", kind="malformed", message="a message must be one frame (multipart is not accepted)"))
                continue
            client = int.from_bytes(frames[0], "big")
            msg = self._decoder.decode(frames[1])
            if msg is None:
                rid, field = refusal_of(frames[1], self._decoder.error)
                self.send(client, Rejected(id=rid, kind="malformed", message=self._decoder.error, field=field))
                continue
            self.clients.add(client)
            out.append((client, msg))
        now = time.monotonic()
        if now < self._probe_until and now - self._last_probe >= PROBE_EVERY_S:
            self._last_probe = now
            self.beat()
        return out

    def _probe_now(self) -> None:
        """Right after a disconnect: the socket drops the dead peer's route once it has processed the pipe's end,
        which a send triggers; a few tries over a few milliseconds name the peer before this round starts."""
        deadline = time.monotonic() + PROBE_SETTLE_S
        while not self._gone and time.monotonic() < deadline:
            self.beat()
            time.sleep(0.001)
        self._last_probe = time.monotonic()

    def send(self, client: int, msg: msgspec.Struct) -> bool:
        """Send to one client; False (and the client is marked gone) when its connection no longer exists."""
        with self._lock:  # the heartbeat thread encodes too; one encoder, one thread at a time
            return self.send_bytes(client, encode(msg))

    def send_bytes(self, client: int, payload: bytes) -> bool:
        with self._lock:
            if self._sock.closed:
                return False
            try:
                self._sock.send_multipart([routing_id(client), payload], zmq.NOBLOCK)
                return True
            except zmq.ZMQError as e:
                if e.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                    raise
                if client in self.clients:
                    self.clients.discard(client)
                    self._gone.append(client)
                return False

    def broadcast(self, msg: msgspec.Struct) -> None:
        with self._lock:
            payload = encode(msg)
            for client in list(self.clients):
                self.send_bytes(client, payload)

    def beat(self, round_s: float = 0.0) -> None:
        with self._lock:
            self._beats += 1
            self.broadcast(Heartbeat(seq=self._beats, round_s=round_s))

    def take_gone(self) -> list[int]:
        """Clients found unreachable since the last call."""
        with self._lock:
            gone, self._gone = self._gone, []
            return gone

    def close(self, linger_s: float = 2.0) -> None:
        with self._lock:
            if self._finalizer.alive:
                self._sock.setsockopt(zmq.LINGER, int(linger_s * 1000))
                self._finalizer()


def _shut(sock: zmq.Socket, monitor: zmq.Socket, ctx: zmq.Context, address: str | None) -> None:
    """Close a socket, its monitor and their context. Also run when the owner is dropped without `close`, so a
    forgotten socket never leaves a context whose termination would block the interpreter's exit."""
    sock.disable_monitor()
    monitor.close(linger=0)
    sock.close()
    ctx.term()
    if address is not None:
        _unlink_ipc(address)


def _unlink_ipc(address: str) -> None:
    """Remove the socket file an ipc:// bind left behind (libzmq keeps it), so a clean stop leaves nothing."""
    if address.startswith("ipc://"):
        path = address[len("ipc://"):]
        if os.path.exists(path) and stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)


class _ClientEnd:
    """What the sync and async client sockets share: options, the monitor, and draining ready frames."""

    def __init__(self, ctx: zmq.Context, address: str, client: int) -> None:
        self._ctx = ctx
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.ROUTING_ID, routing_id(client))
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self.sock.setsockopt(zmq.LINGER, 0)  # frames for a dead engine must never hold up an exit; close() sets its own
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.sock.connect(address)
        self._finalizer = weakref.finalize(self, _shut, self.sock, self.monitor, self._ctx, None)
        # Non-blocking reads and sends go through plain sockets even when the owner is asyncio.
        self._sync: zmq.Socket = zmq.Socket.shadow(self.sock.underlying)
        self._sync_monitor: zmq.Socket = zmq.Socket.shadow(self.monitor.underlying)
        self._decoder = engine_decoder()
        self.address = address
        self.client = client

    @property
    def dropped(self) -> int:
        return self._decoder.dropped

    def send(self, msg: msgspec.Struct) -> None:
        self._sync.send(encode(msg), zmq.NOBLOCK)

    def drain(self) -> list[EngineMessage | Link]:
        out: list[EngineMessage | Link] = []
        while True:
            try:
                event = parse_monitor_message(self._sync_monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
            out.append(Link.CONNECTED if event["event"] == zmq.EVENT_CONNECTED else Link.DISCONNECTED)
        for _ in range(MAX_FRAMES_PER_RECV):
            try:
                frame = self._sync.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            msg = self._decoder.decode(frame)
            if msg is not None:
                out.append(msg)
        return out

    def close(self, linger_s: float) -> None:
        if self._finalizer.alive:
            self.sock.setsockopt(zmq.LINGER, int(linger_s * 1000))
            self._finalizer()


class ClientSocket(_ClientEnd):
    """A client's end for blocking callers (ignis.LLM): one DEALER plus its monitor."""

    def __init__(self, address: str, client: int) -> None:
        super().__init__(zmq.Context(), address, client)
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._poller.register(self.monitor, zmq.POLLIN)

    def recv(self, timeout_s: float) -> list[EngineMessage | Link]:
        """Wait up to `timeout_s` for a frame or a link event, then take all that are ready."""
        self._poller.poll(int(max(0.0, timeout_s) * 1000))
        return self.drain()


class AsyncClientSocket(_ClientEnd):
    """A client's end for asyncio callers (front-ends, ignis.AsyncLLM)."""

    def __init__(self, address: str, client: int) -> None:
        super().__init__(zmq.asyncio.Context(), address, client)
        self._poller = zmq.asyncio.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._poller.register(self.monitor, zmq.POLLIN)

    async def recv(self, timeout_s: float) -> list[EngineMessage | Link]:
        await self._poller.poll(int(max(0.0, timeout_s) * 1000))
        return self.drain()
