"""Processes dying at the worst moment: the supervisor's crash-loop policy, sockets left behind by a kill -9, and
the embedded LLM facing a dead engine. Real processes, real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from hardened import Served, serve
from ignis import LLM, SamplingParams
from ignis.errors import EngineDeadError
from ignis.ipc.addresses import private_ipc_address
from serving import tiny_artifact


def _wait(condition, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _healthy(s: Served) -> bool:
    try:
        return httpx.get(f"{s.url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_crashes_after_ready_restart_with_backoff_and_only_crashes_before_ready_stop_the_server(tmp_path: Path) -> None:
    model = tiny_artifact(tmp_path / "model")
    with serve(model, tmp_path / "serve.log", {"engine.context": 256, "engine.lanes": 2}) as s:
        # Three crashes, each after the engine served: the old policy gave up on the third ("crash loop at start").
        for i in range(3):
            readies = len(s.events("ignis.serve.engine_ready"))
            _wait(lambda: _healthy(s), 120, "the server did not serve again")
            os.kill(s.engine_pid(), signal.SIGKILL)
            _wait(lambda: len(s.events("ignis.serve.engine_ready")) > readies, 120, s.log.read_text()[-2000:])
        _wait(lambda: _healthy(s), 120, "the server did not serve again")
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and s.proc.poll() is None
        died = s.events("ignis.serve.engine_died")
        assert [(d["was_ready"], d["restart_in_s"]) for d in died] == [(True, 0.0), (True, 1.0), (True, 2.0)]
        # An engine that cannot load any more dies before ready every time: that, three times, stops the server.
        for f in model.glob("*.safetensors"):
            f.unlink()
        os.kill(s.engine_pid(), signal.SIGKILL)
        assert s.proc.wait(180) != 0
        died = s.events("ignis.serve.engine_died")
        assert [d["was_ready"] for d in died] == [True, True, True, True, False, False]
        assert "before it became ready" in s.log.read_text()


def test_a_socket_directory_left_by_a_kill_9_is_removed_by_the_next_start(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    code = ("from ignis.ipc.addresses import private_ipc_address; import time; "
            "print(private_ipc_address().private_dir, flush=True); time.sleep(120)")
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "TMPDIR": str(tmp_path)})
    assert owner.stdout is not None
    left = Path(owner.stdout.readline().strip())
    owner.kill()
    owner.wait()
    assert left.is_dir() and left.parent == tmp_path  # nothing ran to remove it
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    live = private_ipc_address()  # a live owner's (ours): kept by the next sweep
    foreign = tmp_path / "ignis-notours"
    foreign.mkdir(mode=0o755)  # not private: not ours to judge
    unowned = tmp_path / "ignis-unowned"
    unowned.mkdir(mode=0o700)  # no owner file (being made, or by another version): not ours to judge either
    mine = private_ipc_address()
    try:
        assert not left.exists()
        assert live.private_dir is not None and live.private_dir.is_dir() and foreign.is_dir() and unowned.is_dir()
    finally:
        live.close()
        mine.close()


def test_the_embedded_llm_reports_a_dead_engine_on_every_call_and_does_not_restart_it(tmp_path: Path) -> None:
    """As vLLM's LLM does: the engine's death is an error the script sees, promptly, on this call and the next."""
    llm = LLM(str(tiny_artifact(tmp_path / "model")), profile="cpu",
              overrides={"engine.context": 256, "log.level": "warning"})
    params = SamplingParams(max_tokens=4, temperature=0.0)
    try:
        assert llm.generate("x", params)[0].outputs[0].token_ids
        owned = llm.client._owned  # type: ignore[attr-defined]
        os.kill(owned.process.pid, signal.SIGKILL)
        for _ in range(2):
            t = time.monotonic()
            with pytest.raises(EngineDeadError, match="exited|closed|heartbeat"):
                llm.generate("x", params)
            assert time.monotonic() - t < 10
        _wait(lambda: not owned.process.alive(), 10, "the killed engine is still there")  # its exit is asynchronous
        assert llm.client._owned is owned  # type: ignore[attr-defined]  # nothing was started in its place
    finally:
        llm.client.close()  # type: ignore[attr-defined]
