"""The engine socket as a hostile local user sees it: a tcp engine takes nothing from a client without its per-start
secret, every refused frame gets a Rejected reply (nobody waits forever), and an oversized frame costs no memory."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from ignis.client.async_client import AsyncEngineClient
from ignis.client.process_client import ProcessClient
from ignis.engine.process import EngineProcess
from ignis.errors import EngineDeadError
from ignis.ipc.addresses import free_tcp_port
from ignis.ipc.codec import encode
from ignis.ipc.messages import EngineRequest, Hello, Ready, Rejected, RequestDelta
from ignis.params import SamplingParams
from serving import config, tiny_artifact

SECRET = "b7" * 32
REQUEST = EngineRequest(id="r1", prompt_token_ids=[5, 6, 7], params=SamplingParams(max_tokens=3, temperature=0.0))


@pytest.fixture(scope="module")
def tcp_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineProcess, str, Path]]:
    model = tiny_artifact(tmp_path_factory.mktemp("tcp"))
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    proc = EngineProcess(config(model, **{"server.transport": "tcp"}), address, SECRET)
    try:
        yield proc, address, model
    finally:
        proc.stop()


class Raw:
    """A bare DEALER: what any local user can open against the port."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.ROUTING_ID, os.urandom(4))
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def answer(self, kinds: tuple[type, ...], timeout_s: float = 60.0) -> object:
        """The first frame of one of `kinds` (heartbeats and the like are skipped)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.sock.poll(100):
                try:
                    msg = msgspec.msgpack.decode(self.sock.recv())
                except msgspec.DecodeError:
                    continue
                for kind in kinds:
                    try:
                        return msgspec.convert(msg, kind)
                    except msgspec.ValidationError:
                        pass
        raise AssertionError(f"no {kinds} within {timeout_s} s")

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def _wait_ready(address: str) -> None:
    raw = Raw(address)
    try:
        raw.sock.send(encode(Hello(client=1, secret=SECRET)))
        assert isinstance(raw.answer((Ready,), 120), Ready)
    finally:
        raw.close()


def test_a_tcp_engine_takes_nothing_from_a_client_without_its_secret(tcp_engine) -> None:
    proc, address, model = tcp_engine
    _wait_ready(address)
    raw = Raw(address)
    try:
        raw.sock.send(encode(REQUEST))  # no Hello at all
        r = raw.answer((Rejected,))
        assert isinstance(r, Rejected) and r.kind == "unauthenticated" and r.id == "r1"
        raw.sock.send(encode(Hello(client=7, secret="guess")))
        assert raw.answer((Rejected,)).kind == "unauthenticated"  # type: ignore[attr-defined]
        raw.sock.send(encode(REQUEST))
        assert raw.answer((Rejected, RequestDelta)).kind == "unauthenticated"  # type: ignore[attr-defined]
    finally:
        raw.close()
    # The embedded client, pointed at the port without the secret, is told so at once rather than left waiting.
    t = time.monotonic()
    with pytest.raises(EngineDeadError, match="refused"):
        ProcessClient(config(model), address, start_timeout_s=30)
    assert time.monotonic() - t < 10
    assert proc.alive()


def test_with_the_secret_the_same_engine_serves(tcp_engine) -> None:
    proc, address, model = tcp_engine

    async def main() -> list[int]:
        client = AsyncEngineClient(config(model), address, secret=SECRET)
        await client.start(timeout_s=120)
        queue: asyncio.Queue = asyncio.Queue()
        client.add(REQUEST, queue)
        tokens: list[int] = []
        while True:
            d = await asyncio.wait_for(queue.get(), 60)
            tokens += d.token_ids
            if d.finished:
                await client.close()
                return tokens

    assert len(asyncio.run(main())) == 3


def test_a_frame_that_fails_validation_gets_a_rejected_reply_naming_the_request(tcp_engine) -> None:
    proc, address, _ = tcp_engine
    raw = Raw(address)
    try:
        raw.sock.send(encode(Hello(client=3, secret=SECRET)))
        raw.answer((Ready,))
        bad = msgspec.msgpack.encode({"type": "add", "id": "r9", "prompt_token_ids": [1, 2],
                                      "params": {"max_tokens": "many"}})
        raw.sock.send(bad)
        r = raw.answer((Rejected,))
        assert isinstance(r, Rejected) and r.kind == "malformed" and r.id == "r9" and r.field == "params.max_tokens"
        raw.sock.send(b"\xc1 not msgpack")
        r = raw.answer((Rejected,))
        assert isinstance(r, Rejected) and r.kind == "malformed" and r.id == ""
        raw.sock.send_multipart([encode(REQUEST), b"more"])
        r = raw.answer((Rejected,))
        assert isinstance(r, Rejected) and r.kind == "malformed" and "one frame" in r.message
    finally:
        raw.close()


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_an_oversized_frame_is_dropped_before_it_is_allocated(tcp_engine) -> None:
    proc, address, model = tcp_engine
    _wait_ready(address)
    before = _rss_mib(proc.pid)
    raw = Raw(address)
    try:
        raw.sock.send(encode(Hello(client=4, secret=SECRET)))
        raw.answer((Ready,))
        # A request whose prompt alone would decode into millions of Python ints (hundreds of MB).
        raw.sock.send(encode(EngineRequest(id="big", prompt_token_ids=[1000] * 5_000_000, params=SamplingParams())))
        time.sleep(2.0)
    finally:
        raw.close()
    assert _rss_mib(proc.pid) - before < 32, (before, _rss_mib(proc.pid))
    _wait_ready(address)  # still serving
    assert proc.alive()
