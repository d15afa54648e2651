"""Where the GPU process listens: a private `ipc://` socket by default, `tcp://` only when asked.

Owns: choosing the engine's address from the server config, making the private directory (mode 0700, so only
this user can connect) and removing it, also when its owner was killed before it could (the next start sweeps).
Does not own: binding or connecting (ignis.ipc.queues).
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import stat
import tempfile
from pathlib import Path

from ignis.errors import ConfigError

_LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]"}
PREFIX = "ignis-"
OWNER = "owner.pid"  # the pid of the process that made the directory and removes it on a clean stop


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
    sweep_stale()
    # mkdtemp creates the directory with mode 0700; chmod again in case a umask or platform differs.
    path = Path(tempfile.mkdtemp(prefix=PREFIX))
    os.chmod(path, 0o700)
    (path / OWNER).write_text(str(os.getpid()))
    return EngineAddress(f"ipc://{path}/engine.sock", path)


def sweep_stale(root: Path | None = None) -> list[Path]:
    """Remove the private directories of owners that died without cleaning up (kill -9): this user's, mode 0700,
    whose owner file names a process that is gone. Returns what it removed."""
    root = Path(tempfile.gettempdir()) if root is None else root
    removed = []
    for path in root.glob(f"{PREFIX}*"):
        try:
            st = path.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o700:
                continue
            owner = path / OWNER
            if not owner.is_file() or _alive(int(owner.read_text().strip() or 0)):
                continue  # being made right now, or by a version that wrote no owner file: not ours to judge
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        except (OSError, ValueError):
            continue  # gone meanwhile, or not ours to judge
    return removed


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone's process with that pid: not provably dead
    return True


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
