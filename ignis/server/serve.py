"""`ignis serve`: the supervisor of one GPU process and N front-ends that share one listening port.

Owns: the listening socket, the engine address, starting the GPU process and the front-ends (spawned), waiting
for the engine before announcing where the server listens, restarting whatever dies (a front-end at once; the GPU
process too, giving up if it keeps dying as it starts), and draining on SIGTERM/SIGINT (front-ends finish their
in-flight responses, then the engine stops). Does not own: what the children do (ignis.engine.process,
ignis.server.frontend). In-flight requests of a dead GPU process are failed by the front-ends themselves, which
see its connection drop (ignis.client.link).

Why one listening socket made here and shared, rather than SO_REUSEPORT in each front-end: the port is bound once
(a busy port fails before anything starts, and port 0 resolves to one real port), connections wait in one accept
queue that survives a front-end's death and restart, and it works wherever SO_REUSEPORT does not.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import time
from multiprocessing.connection import wait
from multiprocessing.synchronize import Event as EventType
from types import FrameType

from ignis.client.link import EngineLink, new_client_id
from ignis.config import IgnisConfig
from ignis.engine.process import EngineProcess
from ignis.errors import EngineDeadError, IgnisError
from ignis.ipc.addresses import engine_address
from ignis.ipc.messages import EngineInfo
from ignis.ipc.queues import ClientSocket
from ignis.logging import get_logger
from ignis.server.app import has_playground
from ignis.server.frontend import DRAIN_S
from ignis.server.frontend import run as frontend_run

log = get_logger(__name__)

FAST_DEATH_S = 30.0  # an engine that dies sooner than this after starting counts towards giving up
MAX_FAST_DEATHS = 3
FRONTEND_RESTART_GAP_S = 1.0


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
        self._mp = mp.get_context("spawn")
        self._signals = 0
        self.address = engine_address(cfg.server.transport, cfg.server.engine_address)
        self.listener = listen(cfg.server.host, cfg.server.port)
        self.port = int(self.listener.getsockname()[1])
        self.engine: EngineProcess | None = None
        self.frontends: list[mp.process.BaseProcess | None] = [None] * cfg.server.frontends
        self._started_at: list[float] = [0.0] * cfg.server.frontends
        self._engine_started = 0.0
        self._fast_deaths = 0

    def start(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        self._start_engine()
        info = self._wait_engine()
        ready = [self._mp.Event() for _ in self.frontends]
        for i in range(len(self.frontends)):
            self._start_frontend(i, ready[i])
        self._wait_frontends(ready)
        self._announce(info)

    def watch(self) -> None:
        while not self._signals:
            sentinels = [p.sentinel for p in self.frontends if p is not None]
            if self.engine is not None:
                sentinels.append(self.engine.sentinel)
            wait(sentinels, timeout=0.5)
            if self._signals:
                break
            if self.engine is not None and not self.engine.alive():
                self._engine_died()
            for i, p in enumerate(self.frontends):
                if p is not None and not p.is_alive() and time.monotonic() - self._started_at[i] > FRONTEND_RESTART_GAP_S:
                    log.error("ignis.serve.frontend_died", frontend=i, exitcode=p.exitcode)
                    p.close()
                    self._start_frontend(i)

    def stop(self) -> None:
        """Drain: front-ends stop accepting and finish what they serve; then the engine; then the address."""
        for p in self.frontends:
            if p is not None and p.is_alive():
                p.terminate()
        deadline = time.monotonic() + DRAIN_S + 5.0
        for p in self.frontends:
            if p is None:
                continue
            while p.is_alive() and time.monotonic() < deadline and self._signals < 2:
                p.join(0.2)
            if p.is_alive():
                p.kill()
                p.join(5.0)
        self.frontends = [None] * len(self.frontends)
        if self.engine is not None:
            self.engine.stop()
            self.engine = None
        self.listener.close()
        self.address.close()
        log.info("ignis.serve.stopped")

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        self._signals += 1  # a second one skips the drain
        if self._signals == 1:
            log.info("ignis.serve.draining", signal=signal.Signals(sig).name)

    def _start_engine(self) -> None:
        self.engine = EngineProcess(self.cfg, self.address.address)
        self._engine_started = time.monotonic()
        log.info("ignis.serve.engine_started", pid=self.engine.pid, address=self.address.address)

    def _engine_died(self) -> None:
        assert self.engine is not None
        code, lived = self.engine.exitcode, time.monotonic() - self._engine_started
        self.engine.stop()
        self._fast_deaths = self._fast_deaths + 1 if lived < FAST_DEATH_S else 0
        if self._fast_deaths >= MAX_FAST_DEATHS:
            self.engine = None
            raise EngineDeadError(f"the GPU process died {MAX_FAST_DEATHS} times within {FAST_DEATH_S:g} s of "
                                  f"starting (last exit code {code}); its log is above")
        log.error("ignis.serve.engine_died", exitcode=code, restarting=True)
        self._start_engine()

    def _wait_engine(self) -> EngineInfo:
        """Wait for the engine's handshake like any client would; its start error (if any) is raised here."""
        assert self.engine is not None
        link = EngineLink(new_client_id(), self.cfg.server.engine_timeout_s)
        sock = ClientSocket(self.address.address, link.client)
        try:
            while not link.ready:
                for item in sock.recv(0.1):
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

    def _wait_frontends(self, ready: list[EventType]) -> None:
        """Announce only once every front-end serves; a front-end that dies while starting is an error."""
        while not all(e.is_set() for e in ready):
            for i, p in enumerate(self.frontends):
                if p is not None and not p.is_alive():
                    raise IgnisError(f"front-end {i} exited with code {p.exitcode} while starting; its log is above")
            if self._signals:
                raise KeyboardInterrupt
            time.sleep(0.05)

    def _start_frontend(self, i: int, ready: EventType | None = None) -> None:
        p = self._mp.Process(
            target=frontend_run, args=(self.cfg, self.listener, self.address.address, i, os.getpid(), ready),
            name=f"ignis-frontend-{i}", daemon=True,
        )
        p.start()
        self.frontends[i] = p
        self._started_at[i] = time.monotonic()
        log.info("ignis.serve.frontend_started", frontend=i, pid=p.pid)

    def _announce(self, info: EngineInfo) -> None:
        host = self.cfg.server.host
        base = f"http://{f'[{host}]' if ':' in host else host}:{self.port}"
        lines = [
            f"ignis: serving {info.model_name!r} (backend {info.backend}, draft tokens {info.draft_tokens}, "
            f"{info.lanes} lanes, context {info.context}) with {len(self.frontends)} front-end(s)",
            f"  OpenAI API   {base}/v1",
            f"  Metrics      {base}/metrics",
        ]
        if has_playground():
            lines.append(f"  Playground   {base}/playground")
        print("\n".join(lines), flush=True)
        log.info("ignis.serve.listening", url=base, model=info.model_name, frontends=len(self.frontends))


def listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host.strip("[]"), port), family=family, backlog=2048)
