"""`ignis serve`: the supervisor of one GPU process and N front-ends that share one listening port.

Owns: the listening socket, the engine address, starting the GPU process and the front-ends, waiting for them
before announcing where the server listens, restarting whatever dies (a front-end at once; the GPU process too,
giving up only if it keeps dying before it is ready, with a growing backoff otherwise), and draining on
SIGTERM/SIGINT (front-ends answer 503 to new requests while they finish their in-flight responses, then the engine
stops). Does not own: what the children do (ignis.engine.process,
ignis.server.frontend). In-flight requests of a dead GPU process are failed by the front-ends themselves, which
see its connection drop (ignis.client.link); the lanes of a dead front-end are freed by the engine, which sees
its connection drop (ignis.ipc.queues).

Why one listening socket made here and inherited, rather than SO_REUSEPORT in each front-end: the port is bound
once (a busy port fails before anything starts, and port 0 resolves to one real port), connections wait in one
accept queue that survives a front-end's death and restart, and it works wherever SO_REUSEPORT does not.
"""

from __future__ import annotations

import os
import secrets
import select
import signal
import socket
import time
from types import FrameType

from ignis.client.link import EngineLink, new_client_id
from ignis.config import IgnisConfig
from ignis.engine.process import EngineProcess
from ignis.errors import EngineDeadError, IgnisError
from ignis.ipc.addresses import engine_address
from ignis.ipc.messages import EngineInfo
from ignis.ipc.queues import ClientSocket
from ignis.ipc.spawn import Child
from ignis.logging import get_logger
from ignis.server.app import has_playground
from ignis.server.frontend import DRAIN_S
from ignis.server.guard import Access

log = get_logger(__name__)

# Crash-loop policy. Only deaths before the engine answered count towards giving up (a model that cannot load will
# not load on the next try either); an engine that served and then died is always restarted, after a backoff that
# grows while it keeps dying soon after becoming ready.
MAX_START_FAILURES = 3  # consecutive deaths before ready
BACKOFF_S = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0)  # before restarting an engine that had served
STABLE_S = 60.0  # an engine that served this long resets the backoff
WATCH_S = 0.1  # how often the supervisor looks at its children


def main(cfg: IgnisConfig) -> None:
    """Run the server until SIGTERM or SIGINT; raises if the GPU process cannot start (or keeps dying).

    The caller (the `ignis serve` command) has configured logging and logged the resolved config.
    """
    sup = Supervisor(cfg)
    try:
        sup.start()
        sup.watch()
    finally:
        sup.stop()


class Supervisor:
    def __init__(self, cfg: IgnisConfig) -> None:
        self.cfg = cfg
        self._t0 = time.monotonic()
        Access.of(cfg)  # an unreadable server.api_key_file fails here, before anything starts
        self._signals = 0
        self.address = engine_address(cfg.server.transport, cfg.server.engine_address)
        # A tcp port is open to every local user (an ipc socket sits in a 0700 directory): the engine takes frames
        # only from the processes handed this secret, which lives as long as this start.
        self.secret = secrets.token_hex(32) if self.address.address.startswith("tcp://") else ""
        self.listener = listen(cfg.server.host, cfg.server.port)
        self.port = int(self.listener.getsockname()[1])
        self.engine: EngineProcess | None = None
        self.frontends: list[Child | None] = [None] * cfg.server.frontends
        self._probe: _ReadyProbe | None = None  # set while a (re)started engine has not answered yet
        self._ready_at: float | None = None  # when the engine running now first answered
        self._start_failures = 0
        self._crashes = 0
        self._restart_at = 0.0

    def start(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        self._start_engine()
        info = self._wait_engine()
        self._ready_at = time.monotonic()
        ready = [self._start_frontend(i) for i in range(len(self.frontends))]
        self._wait_frontends(ready)
        self._announce(info)

    def watch(self) -> None:
        while not self._signals:
            time.sleep(WATCH_S)
            if self.engine is not None and self._probe is not None and self._probe.ready():
                self._probe.close()
                self._ready_at, self._probe = time.monotonic(), None
                log.info("ignis.serve.engine_ready", pid=self.engine.pid)
            if self.engine is not None and not self.engine.alive():
                self._engine_died()
            if self.engine is None and time.monotonic() >= self._restart_at:
                self._start_engine()
                self._probe = _ReadyProbe(self.address.address, self.cfg.server.engine_timeout_s, self.secret)
            for i, child in enumerate(self.frontends):
                if child is not None and not child.alive() and not self._signals:
                    log.error("ignis.serve.frontend_died", frontend=i, exitcode=child.exitcode, restarting=True)
                    os.close(self._start_frontend(i))  # nobody waits for a restarted one to be ready

    def stop(self) -> None:
        """Drain: front-ends stop accepting and finish what they serve; then the engine; then the address."""
        live = [c for c in self.frontends if c is not None]
        for child in live:
            if child.alive():
                child.proc.terminate()
        deadline = time.monotonic() + DRAIN_S + 5.0
        while any(c.alive() for c in live) and time.monotonic() < deadline and self._signals < 2:
            time.sleep(WATCH_S)
        for child in live:
            child.kill()
        self.frontends = [None] * len(self.frontends)
        self.listener.close()  # nobody serves it now: new connections are refused, not left waiting
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        if self.engine is not None:
            self.engine.stop()
            self.engine = None
        self.address.close()
        log.info("ignis.serve.stopped")

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        self._signals += 1  # a second one skips the drain
        if self._signals == 1:
            log.info("ignis.serve.draining", signal=signal.Signals(sig).name)

    def _start_engine(self) -> None:
        self.engine = EngineProcess(self.cfg, self.address.address, self.secret)
        self._ready_at = None
        log.info("ignis.serve.engine_started", pid=self.engine.pid, address=self.address.address)

    def _engine_died(self) -> None:
        assert self.engine is not None
        code, now = self.engine.exitcode, time.monotonic()
        self.engine.stop()
        self.engine = None
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        if self._ready_at is None:
            self._start_failures += 1
            delay = 0.0
            if self._start_failures >= MAX_START_FAILURES:
                raise EngineDeadError(f"the GPU process died {MAX_START_FAILURES} times in a row before it became "
                                      f"ready (last exit code {code}); its log is above")
        else:
            self._start_failures = 0
            self._crashes = 1 if now - self._ready_at >= STABLE_S else self._crashes + 1
            delay = BACKOFF_S[min(self._crashes, len(BACKOFF_S)) - 1]
        log.error("ignis.serve.engine_died", exitcode=code, was_ready=self._ready_at is not None, restart_in_s=delay)
        self._restart_at = now + delay

    def _wait_engine(self) -> EngineInfo:
        """Wait for the engine's handshake like any client would; its start error (if any) is raised here."""
        assert self.engine is not None
        link = EngineLink(new_client_id(), self.cfg.server.engine_timeout_s, self.secret)
        sock = ClientSocket(self.address.address, link.client)
        try:
            while not link.ready:
                for item in sock.recv(WATCH_S):
                    hello = link.feed(item)
                    if hello is not None:
                        sock.send(hello)
                if link.dead is not None:
                    raise link.start_error()
                if not self.engine.alive():
                    raise EngineDeadError(f"the GPU process exited with code {self.engine.exitcode} while starting; "
                                          "its log is above")
                if self._signals:
                    raise KeyboardInterrupt
            assert link.info is not None
            return link.info
        finally:
            sock.close(0)

    def _start_frontend(self, i: int) -> int:
        """Start front-end i; returns the read end of the pipe on which it says it is ready."""
        ready_r, ready_w = os.pipe()
        args = ["--address", self.address.address, "--frontend", str(i),
                "--listen-fd", str(self.listener.fileno()), "--ready-fd", str(ready_w)]
        try:
            child = Child("ignis.server.frontend", args, self.cfg, pass_fds=(self.listener.fileno(), ready_w),
                          secret=self.secret)
        finally:
            os.close(ready_w)
        self.frontends[i] = child
        log.info("ignis.serve.frontend_started", frontend=i, pid=child.pid)
        return ready_r

    def _wait_frontends(self, ready: list[int]) -> None:
        """Announce only once every front-end serves; a front-end that exits while starting is an error."""
        waiting = set(ready)
        try:
            while waiting:
                for fd in select.select(list(waiting), [], [], WATCH_S)[0]:
                    os.read(fd, 1)  # a byte when ready; end of file if it died first (caught below)
                    waiting.discard(fd)
                for i, child in enumerate(self.frontends):
                    if child is not None and not child.alive():
                        raise IgnisError(f"front-end {i} exited with code {child.exitcode} while starting; "
                                         "its log is above")
                if self._signals:
                    raise KeyboardInterrupt
        finally:
            for fd in ready:
                os.close(fd)

    def _announce(self, info: EngineInfo) -> None:
        host = self.cfg.server.host
        base = f"http://{f'[{host}]' if ':' in host else host}:{self.port}"
        took = time.monotonic() - self._t0
        # Logged before the banner, so that whoever waits for the banner finds the event already written.
        log.info("ignis.serve.listening", url=base, model=info.model_name, frontends=len(self.frontends),
                 startup_s=round(took, 2))
        lines = [
            f"ignis: serving {info.model_name!r} (backend {info.backend}, draft tokens {info.draft_tokens}, "
            f"{info.lanes} lanes, context {info.context}) with {len(self.frontends)} front-end(s); "
            f"ready in {took:.1f} s",
            f"  OpenAI API   {base}/v1",
            f"  Metrics      {base}/metrics",
        ]
        if has_playground():
            lines.append(f"  Playground   {base}/playground")
        print("\n".join(lines), flush=True)


def listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host.strip("[]"), port), family=family, backlog=2048)


class _ReadyProbe:
    """The supervisor's view of a restarted engine: connected like any client, ready once it answers Hello."""

    def __init__(self, address: str, timeout_s: float, secret: str) -> None:
        self.link = EngineLink(new_client_id(), timeout_s, secret)
        self.sock = ClientSocket(address, self.link.client)

    def ready(self) -> bool:
        for item in self.sock.recv(0.0):
            hello = self.link.feed(item)
            if hello is not None:
                self.sock.send(hello)
        return self.link.ready

    def close(self) -> None:
        self.sock.close(0)
