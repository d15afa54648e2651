"""The GPU process behind its socket: routing to the owning client, bad frames, vanished clients, death and restart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ignis.client.process_client import ProcessClient
from ignis.engine.process import EngineProcess
from ignis.errors import ArtifactError, EngineDeadError
from ignis.ipc.addresses import private_ipc_address
from ignis.ipc.messages import EngineRequest
from ignis.params import SamplingParams
from serving import config, tiny_artifact

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7], [100, 200, 300, 400], [42] * 9, [7, 7, 8, 9, 1000]]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_artifact(tmp_path_factory.mktemp("engine"))


@pytest.fixture(scope="module")
def engine(model: Path) -> Iterator[tuple[EngineProcess, str]]:
    addr = private_ipc_address()
    proc = EngineProcess(config(model, **{"engine.lanes": 4}), addr.address)
    try:
        yield proc, addr.address
    finally:
        proc.stop()
        addr.close()


def _finish(client: ProcessClient, ids: set[str], timeout: float = 60.0) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    done: set[str] = set()
    deadline = time.monotonic() + timeout
    while done != ids:
        assert time.monotonic() < deadline, f"unfinished: {ids - done}"
        for d in client.get_deltas(1.0):
            assert d.id in ids, f"received {d.id!r}, which this client never sent"
            tokens.setdefault(d.id, []).extend(d.token_ids)
            if d.finished:
                done.add(d.id)
    return tokens


def test_two_clients_share_one_engine_and_each_gets_only_its_own_outputs(model: Path, engine) -> None:
    _, address = engine
    cfg = config(model)
    a, b = ProcessClient(cfg, address), ProcessClient(cfg, address)
    try:
        alone = {}
        for i, p in enumerate(PROMPTS[:2]):
            a.add(EngineRequest(id=f"ref{i}", prompt_token_ids=p, params=GREEDY))
            alone[i] = _finish(a, {f"ref{i}"})[f"ref{i}"]
        for i, p in enumerate(PROMPTS[:2]):
            a.add(EngineRequest(id=f"a{i}", prompt_token_ids=p, params=GREEDY))
            b.add(EngineRequest(id=f"b{i}", prompt_token_ids=p, params=GREEDY))
        got_a, got_b = _finish(a, {"a0", "a1"}), _finish(b, {"b0", "b1"})
        for i in range(2):
            assert got_a[f"a{i}"] == got_b[f"b{i}"] == alone[i]
            assert len(alone[i]) == GREEDY.max_tokens
        assert a.stats().requests_total >= 6
    finally:
        a.close()
        b.close()


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(frames=st.lists(st.binary(max_size=128), min_size=1, max_size=4))
def test_fuzzed_frames_never_kill_the_engine(engine, frames: list[bytes]) -> None:
    proc, address = engine
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.ROUTING_ID, os.urandom(4))
    raw.connect(address)
    try:
        raw.send_multipart(frames)
        for f in frames:
            raw.send(f)
    finally:
        raw.close(linger=1000)
        ctx.term()
    assert proc.alive()


def test_engine_still_serves_after_the_fuzzing(model: Path, engine) -> None:
    proc, address = engine
    with ProcessClient(config(model), address) as c:
        c.add(EngineRequest(id="after", prompt_token_ids=PROMPTS[2], params=GREEDY))
        assert len(_finish(c, {"after"})["after"]) == GREEDY.max_tokens
    assert proc.alive()


CLIENT_THAT_DIES = textwrap.dedent("""
    import sys, time
    from ignis.client.process_client import ProcessClient
    from ignis.config import load_config
    from ignis.ipc.messages import EngineRequest
    from ignis.params import SamplingParams
    cfg = load_config(profile="cpu", overrides={"model.path": sys.argv[2], "spec.backend": "off", "log.level": "warning"})
    c = ProcessClient(cfg, sys.argv[1])
    p = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    for i in range(6):  # more than the lanes: some run, some wait
        c.add(EngineRequest(id=f"doomed{i}", prompt_token_ids=[5, 6, 7 + i], params=p))
    while not c.get_deltas(1.0):
        pass
    print("streaming", flush=True)
    time.sleep(600)
""")


def test_a_client_that_dies_has_its_requests_aborted_and_lanes_freed_within_a_second(model: Path, engine) -> None:
    _, address = engine
    child = subprocess.Popen([sys.executable, "-c", CLIENT_THAT_DIES, address, str(model)], stdout=subprocess.PIPE, text=True)
    watcher = ProcessClient(config(model), address)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "streaming"
        deadline = time.monotonic() + 30
        while (s := watcher.stats()).running < 4:  # admitted as the scheduler sees fit: wait for all lanes
            assert time.monotonic() < deadline, s
        assert s.running == 4 and s.waiting == 2
        # Lanes are freed between rounds, so the bound is 1 s or, on a machine too loaded for that, a few rounds.
        t = time.monotonic()
        watcher.stats()  # answered between two rounds: this one takes one whole round
        round_s = time.monotonic() - t
        child.send_signal(signal.SIGKILL)
        child.wait()
        t0 = time.monotonic()
        while (s := watcher.stats()).running or s.waiting:
            assert time.monotonic() - t0 < 30.0
            time.sleep(0.02)
        elapsed = time.monotonic() - t0
        assert elapsed < max(1.0, 3 * round_s), (elapsed, round_s)
    finally:
        child.kill()
        child.wait()
        assert child.stdout is not None
        child.stdout.close()
        watcher.close()


def test_a_dead_engine_fails_live_requests_promptly_and_a_restarted_one_serves_the_same_client(model: Path) -> None:
    addr = private_ipc_address()
    cfg = config(model)
    proc = EngineProcess(cfg, addr.address)
    client = None
    try:
        client = ProcessClient(cfg, addr.address, start_timeout_s=120)
        client.add(EngineRequest(id="long", prompt_token_ids=PROMPTS[0],
                                 params=SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)))
        while not client.get_deltas(1.0):
            pass
        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="closed its connection"):
            while True:
                client.get_deltas(1.0)
        assert time.monotonic() - t0 < 5.0
        with pytest.raises(EngineDeadError):
            client.add(EngineRequest(id="meanwhile", prompt_token_ids=[1, 2], params=GREEDY))
        proc.stop()
        proc = EngineProcess(cfg, addr.address)
        client.wait_ready(120)
        client.add(EngineRequest(id="again", prompt_token_ids=PROMPTS[1], params=GREEDY))
        assert len(_finish(client, {"again"})["again"]) == GREEDY.max_tokens
    finally:
        if client is not None:
            client.close()
        proc.stop()
        addr.close()


def test_a_bad_artifact_is_reported_to_the_client_that_started_the_engine(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}')
    cfg = config(tmp_path)
    t0 = time.monotonic()
    with pytest.raises(ArtifactError):
        ProcessClient(cfg)
    assert time.monotonic() - t0 < 60
