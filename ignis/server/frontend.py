"""A front-end process: uvicorn on uvloop serving the app, on a listening socket the supervisor shares.

Owns: the process's entry point, its signals (SIGTERM drains: new requests get 503 + Retry-After while the
in-flight responses finish, then the process exits; SIGINT is the supervisor's to act on), and exiting when its
parent is gone. Does not own: the app (ignis.server.app) or restarts (ignis.server.serve).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import time
from collections.abc import Callable
from types import FrameType

import structlog
import uvicorn

from ignis.config import IgnisConfig
from ignis.ipc.spawn import parent_gone, read_start
from ignis.logging import configure, get_logger
from ignis.server.guard import Gate

log = get_logger("ignis.server.frontend")  # not __name__: this module runs as __main__

DRAIN_S = 60  # how long SIGTERM waits for in-flight responses before cancelling them


class _Server(uvicorn.Server):
    """uvicorn, with a drain that keeps answering: after SIGTERM new requests get 503 + Retry-After (not a
    connection left waiting in the accept queue), and the server stops once the requests in flight are done."""

    def __init__(self, config: uvicorn.Config, parent_pid: int, gate: Gate) -> None:
        super().__init__(config)
        self.parent_pid = parent_pid
        self.gate = gate
        self.drain_until = 0.0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Ctrl-C reaches every process of the terminal's group; only the supervisor decides what stops.
        if sig == signal.SIGINT:
            return
        if sig == signal.SIGTERM and not self.gate.draining:
            self.gate.draining = True
            self.drain_until = time.monotonic() + DRAIN_S
            log.info("ignis.frontend.draining", inflight=self.gate.inflight)
            return
        super().handle_exit(sig, frame)  # a second SIGTERM: uvicorn's own shutdown

    async def on_tick(self, counter: int) -> bool:
        if counter % 10 == 0 and parent_gone(self.parent_pid):
            log.warning("ignis.frontend.orphaned", parent=self.parent_pid)
            self.should_exit = True
        drained = self.gate.inflight == 0 or time.monotonic() > self.drain_until
        if self.gate.draining and not self.should_exit and drained:
            log.info("ignis.frontend.drained", inflight=self.gate.inflight)
            self.should_exit = True
        return await super().on_tick(counter)


def run(cfg: IgnisConfig, listener: socket.socket, address: str, index: int, parent_pid: int,
        on_ready: Callable[[], None] | None = None, secret: str = "") -> None:
    """Serve on `listener` until SIGTERM, talking to the engine at `address`; `on_ready` once the engine answers."""
    configure(cfg.log.level, cfg.log.format)
    structlog.contextvars.bind_contextvars(frontend=index)
    from ignis.server.app import build_app

    # uvicorn re-raises the signal it drained on; with this handler that ends in a clean exit code.
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    gate = Gate()
    config = uvicorn.Config(
        build_app(cfg, address, index, on_ready, gate, secret),
        loop="uvloop",
        log_config=None,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=DRAIN_S,
    )
    _Server(config, parent_pid, gate).run(sockets=[listener])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ignis.server.frontend", description="a front-end (started by ignis serve)")
    parser.add_argument("--address", required=True)
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--frontend", type=int, required=True)
    parser.add_argument("--listen-fd", type=int, required=True)
    parser.add_argument("--ready-fd", type=int, required=True)
    args = parser.parse_args(argv)
    listener = socket.socket(fileno=args.listen_fd)

    def ready() -> None:
        os.write(args.ready_fd, b"r")
        os.close(args.ready_fd)

    cfg, secret = read_start()
    run(cfg, listener, args.address, args.frontend, args.parent, ready, secret)


if __name__ == "__main__":
    main()
