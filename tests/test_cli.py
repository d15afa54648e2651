"""The `ignis` command: config show round-trips, flags reach the config, and mistakes exit 2 with one clear line."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from ignis.cli import main
from ignis.config import IgnisConfig, load_config
from ignis.errors import ArtifactError
from tiny import tiny_checkpoint


def tiny_dir(base: Path) -> Path:
    """A model directory whose config.json the CLI checks before anything starts (no weights are read)."""
    return tiny_checkpoint(base / "model", seed=0)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ignis.cli", *args], capture_output=True, text=True, timeout=60)


pytestmark = pytest.mark.usefixtures("restore_logging")  # tests/conftest.py


def test_config_show_prints_toml_that_loads_back(tmp_path: Path) -> None:
    proc = run_cli("config", "show", "--profile", "h200", "--set", "spec.backend=mtp", "--set", "engine.lanes=2")
    assert proc.returncode == 0, proc.stderr
    f = tmp_path / "shown.toml"
    f.write_text(proc.stdout)
    shown = load_config(path=f)
    assert shown == load_config(profile="h200", overrides={"spec.backend": "mtp", "engine.lanes": 2})
    assert shown.spec.draft_tokens == 1 and shown.model.device == "cuda"


def test_bad_set_exits_2_with_one_line_and_no_traceback() -> None:
    proc = run_cli("config", "show", "--set", "engine.lanes=0")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "ignis: error: config engine.lanes: got 0; expected an integer from 1 to 1024 (set by the command line)"]


@pytest.mark.parametrize(("argv", "needle"), [
    (["config", "show", "--set", "engine.lane=3"], 'did you mean "engine.lanes"'),
    (["config", "show", "--set", "spec.backend"], "expected KEY=VALUE"),
    (["config", "show", "--set", "spec.draft_tokens=2"], "needs spec.backend set to a drafting backend"),
    (["config", "show", "--profile", "tpu"], "profiles are: cpu, h200"),
    (["serve", "--port", "70000"], "server.port: got 70000"),
    (["generate", "--prompt", "x", "--temperature", "-1"], "temperature"),
    (["generate", "--prompt", "x", "--set", "log.level=loud"], "log.level"),
])
def test_mistakes_exit_2_naming_the_problem(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ignis: error: ") and needle in err and "Traceback" not in err


def test_config_show_reads_a_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "site.toml"
    f.write_text("[engine]\nlanes = 3\n")
    assert main(["config", "show", "--profile", "cpu", "--config", str(f), "--set", "engine.context=512"]) == 0
    out = capsys.readouterr().out
    assert "lanes = 3" in out and "context = 512" in out and 'device = "cpu"' in out


def test_serve_resolves_flags_over_set_and_logs_the_config_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    seen: list[IgnisConfig] = []
    fake = types.ModuleType("ignis.server.serve")
    fake.main = lambda cfg: seen.append(cfg) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ignis.server.serve", fake)
    model = str(tiny_dir(tmp_path))
    code = main(["serve", "--model", model, "--port", "9001", "--set", "server.port=1",
                 "--set", "log.format=json", "--profile", "cpu"])
    assert code == 0 and len(seen) == 1
    cfg = seen[0]
    assert (cfg.model.path, cfg.server.port, cfg.model.device, cfg.log.format) == (model, 9001, "cpu", "json")
    assert capsys.readouterr().err.count('"event": "ignis.config.resolved"') == 1


class FakeLLM:
    """Stands in for ignis.client.llm.LLM so the CLI's wiring is tested without a model."""

    made: list[dict[str, Any]] = []

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        if model == "missing":
            raise ArtifactError("model.path 'missing' has no config.json")
        self.calls: list[tuple[str, Any, Any]] = []
        FakeLLM.made.append({"model": model, **kwargs, "calls": self.calls})

    def _out(self, text: str) -> list[Any]:
        completion = types.SimpleNamespace(text=text, finish_reason="length")
        metrics = {"prompt_tokens": 3, "prompt_ms": 1.25, "decode_tokens": 4, "decode_ms": 8.0, "tokens_per_s": 500.0,
                   "rounds": 2, "drafted": 2, "accepted": 2}
        return [types.SimpleNamespace(outputs=[completion], metrics=metrics)]

    def generate(self, prompts: list[str], params: Any) -> list[Any]:
        self.calls.append(("generate", prompts, params))
        return self._out("completion text")

    def chat(self, messages: list[dict[str, str]], params: Any) -> list[Any]:
        self.calls.append(("chat", messages, params))
        return self._out("chat reply")

    def close(self) -> None:
        self.calls.append(("close", None, None))


@pytest.fixture
def fake_llm(monkeypatch: pytest.MonkeyPatch) -> type[FakeLLM]:
    FakeLLM.made = []
    module = types.ModuleType("ignis.client.llm")
    module.LLM = FakeLLM  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ignis.client.llm", module)
    return FakeLLM


def test_generate_prints_text_and_metrics(
    fake_llm: type[FakeLLM], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    model = str(tiny_dir(tmp_path))
    code = main(["generate", model, "--prompt", "def fib(n):", "--profile", "cpu", "--max-tokens", "4",
                 "--set", "spec.backend=mtp", "--set", "model.name=2024"])
    assert code == 0
    out, err = capsys.readouterr()
    assert out == "completion text\n"
    assert "prompt_tokens=3 prompt_ms=1.2" in err and "tokens_per_s=500.0 rounds=2 drafted=2 accepted=2" in err
    made = fake_llm.made[0]
    # The LLM gets the resolved config, every layer applied (the profile's device included).
    assert made["model"] == model
    o = made["overrides"]
    assert (o["spec.backend"], o["spec.draft_tokens"], o["model.name"], o["model.device"]) == ("mtp", 1, "2024", "cpu")
    kind, prompts, params = made["calls"][0]
    assert (kind, prompts, params.max_tokens, params.temperature) == ("generate", ["def fib(n):"], 4, 0.0)
    assert made["calls"][-1][0] == "close"


def test_generate_chat_sends_a_user_turn(fake_llm: type[FakeLLM], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--prompt", "hi", "--chat", "--temperature", "0.7", "--seed", "5"]) == 0
    assert capsys.readouterr().out == "chat reply\n"
    kind, messages, params = fake_llm.made[0]["calls"][0]
    assert kind == "chat" and messages == [{"role": "user", "content": "hi"}]
    assert (params.temperature, params.seed) == (0.7, 5) and fake_llm.made[0]["model"] is None


def test_generate_artifact_error_exits_2(fake_llm: type[FakeLLM], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", "missing", "--prompt", "x"]) == 2
    assert "'missing': no such directory" in capsys.readouterr().err and not fake_llm.made
