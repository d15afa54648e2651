"""Where the GPU process listens: a private `ipc://` socket by default, `tcp://` only when asked.

Owns: choosing the engine's address from the server config, making the private directory (mode 0700, so only
this user can connect) and removing it. Does not own: binding or connecting (ignis.ipc.queues).
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import tempfile
from pathlib import Path

from ignis.errors import ConfigError

_LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]"}


class EngineAddress:
    """One engine address; owns its private directory (if it made one) and removes it on close."""

    def __init__(self, address: str, private_dir: Path | None = None) -> None:
        self.address = address
        self.private_dir = private_dir

    def close(self) -> None:
        if self.private_dir is not None:
            shutil.rmtree(self.private_dir, ignore_errors=True)
            self.private_dir = None

    def __repr__(self) -> str:
        return f"EngineAddress({self.address!r})"


def private_ipc_address() -> EngineAddress:
    # mkdtemp creates the directory with mode 0700; chmod again in case a umask or platform differs.
    path = Path(tempfile.mkdtemp(prefix="ignis-"))
    os.chmod(path, 0o700)
    return EngineAddress(f"ipc://{path}/engine.sock", path)


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A port free right now. Another process may take it before the engine binds; the bind then fails loudly."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host.strip("[]"), 0))
        return int(s.getsockname()[1])


def is_loopback(address: str) -> bool:
    if not address.startswith("tcp://"):
        return True
    host = address[len("tcp://"):].rsplit(":", 1)[0]
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def engine_address(transport: str, configured: str) -> EngineAddress:
    """The address to bind: `server.engine_address` if set, else a private ipc path or a loopback tcp port.

    A configured address is used as given (that is how one opts in to a non-loopback tcp host); a private ipc
    directory made here is removed by `EngineAddress.close`.
    """
    if configured:
        if not configured.startswith(("ipc://", "tcp://")):
            raise ConfigError("server.engine_address", f"got {configured!r}; use ipc://PATH or tcp://HOST:PORT")
        return EngineAddress(configured)
    if transport == "tcp":
        return EngineAddress(f"tcp://127.0.0.1:{free_tcp_port()}")
    return private_ipc_address()
