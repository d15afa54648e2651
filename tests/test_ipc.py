"""The wire: every message survives a round trip unchanged, bad frames are dropped, sockets route and notice deaths."""

from __future__ import annotations

import os
import stat
import time

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from ignis.errors import ConfigError
from ignis.ipc.addresses import engine_address, is_loopback, private_ipc_address
from ignis.ipc.codec import client_decoder, encode, engine_decoder
from ignis.ipc.messages import (
    Abort,
    Deltas,
    EngineDead,
    EngineInfo,
    EngineRequest,
    EngineStats,
    Heartbeat,
    Hello,
    Ready,
    Rejected,
    RequestDelta,
    RequestStats,
    UtilityCall,
    UtilityReply,
)
from ignis.ipc.queues import ClientSocket, EngineSocket, Link
from ignis.params import SamplingParams

INFO = EngineInfo(
    model_name="tiny", context=256, lanes=4, backend="mtp", draft_tokens=2, vocab_size=512, eos_token_ids=[1, 2]
)
STATS = RequestStats(
    prompt_tokens=5, prompt_ms=1.5, decode_tokens=7, decode_ms=3.25, rounds=4, drafted=8, accepted=3,
    position_drafted=[4, 4], position_accepted=[2, 1],
)
PARAMS = SamplingParams(
    n=2, max_tokens=9, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=3, stop=("\n\n",),
    stop_token_ids=(7,), ignore_eos=True, logprobs=2,
)
CLIENT_MESSAGES = [
    Hello(client=7, pid=123),
    EngineRequest(id="r-1", prompt_token_ids=[1, 2, 3], params=PARAMS, stop_token_ids=[1, 7], client=7),
    EngineRequest(id="r-2", prompt_token_ids=[4], params=SamplingParams()),
    Abort(ids=["r-1", "r-2"]),
    UtilityCall(call_id=5, method="stats"),
]
ENGINE_MESSAGES = [
    Ready(info=INFO, pid=99, heartbeat_s=0.5),
    Heartbeat(seq=12, round_s=0.25),
    Deltas(deltas=[
        RequestDelta(id="r-1", token_ids=[5, 6]),
        RequestDelta(id="r-1", token_ids=[1], finished=True, finish_reason="stop", stop_token_id=1, stats=STATS,
                     logprobs=[{1: -0.25, 4: -2.0}]),
        RequestDelta(id="r-2", token_ids=[], finished=True, finish_reason="error", error="boom"),
    ]),
    Rejected(id="r-3", kind="input", message="is empty", field="prompt"),
    Rejected(id="r-4", kind="queue_full", message="the queue is full"),
    UtilityReply(call_id=5, stats=EngineStats(running=1, waiting=2, requests_total=3, speculative_requests=1,
                                              rounds=4, drafted=5, accepted=6, position_drafted=[3, 2],
                                              position_accepted=[2, 1])),
    UtilityReply(call_id=6, error="no such thing"),
    EngineDead(reason="CUDA error: an illegal memory access", kind="internal"),
    EngineDead(reason="spec.draft_tokens: above the drafter's width 7", kind="config", key="spec.draft_tokens"),
]


@pytest.mark.parametrize("msg", CLIENT_MESSAGES, ids=lambda m: type(m).__name__)
def test_client_messages_round_trip_equal(msg: msgspec.Struct) -> None:
    assert client_decoder().decode(encode(msg)) == msg


@pytest.mark.parametrize("msg", ENGINE_MESSAGES, ids=lambda m: type(m).__name__)
def test_engine_messages_round_trip_equal(msg: msgspec.Struct) -> None:
    assert engine_decoder().decode(encode(msg)) == msg


def test_a_frame_of_the_other_direction_or_unknown_kind_is_dropped() -> None:
    dec = client_decoder()
    assert dec.decode(encode(Heartbeat(seq=1))) is None  # engine->client frame sent the wrong way
    assert dec.decode(msgspec.msgpack.encode({"type": "shutdown_everything"})) is None
    assert dec.decode(msgspec.msgpack.encode({"type": "call", "call_id": 1, "method": "exec"})) is None
    assert dec.decode(b"\xc1\xff not msgpack") is None
    assert dec.dropped == 4


def test_a_request_with_invalid_sampling_params_is_dropped_not_raised() -> None:
    bad = msgspec.msgpack.encode(
        {"type": "add", "id": "x", "prompt_token_ids": [1], "params": {"top_p": 2.0}}
    )
    assert client_decoder().decode(bad) is None


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_fuzzed_bytes_never_raise(frame: bytes) -> None:
    for dec in (client_decoder(), engine_decoder()):
        out = dec.decode(frame)
        assert out is None or isinstance(out, msgspec.Struct)


def test_private_ipc_directory_is_owner_only_and_removed_on_close() -> None:
    addr = private_ipc_address()
    assert addr.address.startswith("ipc://") and addr.private_dir is not None
    assert stat.S_IMODE(os.stat(addr.private_dir).st_mode) == 0o700
    path = addr.private_dir
    addr.close()
    assert not path.exists()


def test_tcp_is_loopback_unless_configured() -> None:
    addr = engine_address("tcp", "")
    assert addr.address.startswith("tcp://127.0.0.1:") and is_loopback(addr.address)
    assert not is_loopback("tcp://0.0.0.0:5555") and is_loopback("tcp://[::1]:5555")
    assert engine_address("ipc", "tcp://10.0.0.2:5555").address == "tcp://10.0.0.2:5555"
    with pytest.raises(ConfigError, match="server.engine_address"):
        engine_address("ipc", "http://x")


def _recv_until(sock: ClientSocket, pred, timeout: float = 3.0) -> list:
    seen: list = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not any(pred(m) for m in seen):
        seen.extend(sock.recv(0.05))
    return seen


def _engine_recv_until(eng: EngineSocket, n: int, timeout: float = 3.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and len(got) < n:
        got.extend(eng.recv(0.05))
    return got


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_router_names_senders_and_routes_replies_to_each_client_only(transport: str) -> None:
    addr = engine_address(transport, "")
    eng = EngineSocket(addr.address)
    a, b = ClientSocket(addr.address, 11), ClientSocket(addr.address, 22)
    try:
        assert any(m is Link.CONNECTED for m in _recv_until(a, lambda m: m is Link.CONNECTED))
        a.send(Hello(client=11))
        b.send(Hello(client=22))
        got = _engine_recv_until(eng, 2)
        assert sorted(c for c, _ in got) == [11, 22] and eng.clients == {11, 22}
        assert eng.send(22, Heartbeat(seq=5))
        seen_b = _recv_until(b, lambda m: isinstance(m, Heartbeat))
        assert Heartbeat(seq=5) in seen_b
        assert not [m for m in a.recv(0.1) if isinstance(m, Heartbeat)]
    finally:
        a.close(0)
        b.close(0)
        eng.close(0)
        addr.close()


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_engine_notices_a_vanished_client_within_a_second_and_a_client_notices_the_engine(transport: str) -> None:
    addr = engine_address(transport, "")
    eng = EngineSocket(addr.address)
    a, b = ClientSocket(addr.address, 1), ClientSocket(addr.address, 2)
    try:
        a.send(Hello(client=1))
        b.send(Hello(client=2))
        _engine_recv_until(eng, 2)
        t0 = time.monotonic()
        a.close(0)
        gone: list[int] = []
        while not gone and time.monotonic() - t0 < 2.0:
            eng.recv(0.05)
            gone = eng.take_gone()
        assert gone == [1] and time.monotonic() - t0 < 1.0
        assert eng.clients == {2}
        eng.close(0)
        assert any(m is Link.DISCONNECTED for m in _recv_until(b, lambda m: m is Link.DISCONNECTED))
    finally:
        a.close(0)
        b.close(0)
        eng.close(0)
        addr.close()


def test_garbage_frames_on_the_engine_socket_are_dropped_and_service_continues() -> None:
    addr = private_ipc_address()
    eng = EngineSocket(addr.address)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.connect(addr.address)
    good = ClientSocket(addr.address, 3)
    try:
        for frame in (b"", b"\x00", b"\x93\x01\x02", os.urandom(64), encode(Heartbeat(seq=1))):
            raw.send(frame)
        raw.send_multipart([b"a", b"b", b"c"])
        deadline = time.monotonic() + 3.0
        while eng.dropped < 6 and time.monotonic() < deadline:
            assert eng.recv(0.05) == []
        assert eng.dropped == 6
        good.send(Hello(client=3))
        assert _engine_recv_until(eng, 1) == [(3, Hello(client=3))]
    finally:
        raw.close(0)
        ctx.term()
        good.close(0)
        eng.close(0)
        addr.close()


class _EngineThatFails:
    """Accepts requests, then fails its first round the way a GPU fault would."""

    info = INFO

    def __init__(self) -> None:
        self.queued: list[EngineRequest] = []

    def add(self, req: EngineRequest) -> None:
        self.queued.append(req)

    def abort(self, ids: list[str]) -> list[RequestDelta]:
        return []

    def has_work(self) -> bool:
        return bool(self.queued)

    def step(self) -> list[RequestDelta]:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def stats(self) -> EngineStats:
        return EngineStats()


def test_an_engine_that_fails_tells_every_client_why_before_it_exits(tmp_path) -> None:
    import threading

    from ignis.client.process_client import ProcessClient
    from ignis.config import load_config
    from ignis.engine.process import serve
    from ignis.errors import EngineDeadError

    addr = private_ipc_address()
    sock = EngineSocket(addr.address)
    codes: list[object] = []

    def engine() -> None:
        try:
            serve(_EngineThatFails(), sock, 0.2, threading.Event())  # type: ignore[arg-type]
        except SystemExit as e:
            codes.append(e.code)

    thread = threading.Thread(target=engine)
    thread.start()
    bystander = ClientSocket(addr.address, 2)
    client = ProcessClient(load_config(overrides={"model.path": str(tmp_path)}), addr.address)
    try:
        assert client.info == INFO
        bystander.send(Hello(client=2))
        assert any(isinstance(m, Ready) for m in _recv_until(bystander, lambda m: isinstance(m, Ready)))
        client.add(EngineRequest(id="x", prompt_token_ids=[1, 2], params=SamplingParams()))
        with pytest.raises(EngineDeadError, match="illegal memory access"):
            client.get_deltas(5.0)
        dead = [m for m in _recv_until(bystander, lambda m: isinstance(m, EngineDead)) if isinstance(m, EngineDead)]
        assert dead and dead[0].kind == "internal" and "RuntimeError" in dead[0].reason
        thread.join(5.0)
        assert codes == [1]
    finally:
        client.close()
        bystander.close(0)
        addr.close()
