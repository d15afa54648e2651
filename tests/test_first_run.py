"""A new user's first commands: `ignis serve MODEL` and `ignis generate MODEL` with a directory or a Hugging Face id
(from a hub cache the test builds, offline), mistakes refused in one line before any process starts, `--help` with
defaults, and the order of the config layers (file < IGNIS_* environment < --set < flags)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

import ignis.ipc.spawn
from ignis.cli import main
from ignis.config import IgnisConfig
from serving import tiny_artifact

REPO = "ignis-test/tiny-qwen"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


pytestmark = pytest.mark.usefixtures("restore_logging")  # tests/conftest.py


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_artifact(tmp_path_factory.mktemp("first_run") / "tiny-qwen")


@pytest.fixture(scope="module")
def hub_cache(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face hub cache holding REPO at COMMIT, laid out as huggingface_hub itself writes it
    (blobs named by content, snapshot files linking to them, refs/main naming the commit)."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / f"models--{REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(p for p in model.iterdir() if p.is_file())):
        blob = repo / "blobs" / f"{i:040x}"
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return cache


@pytest.fixture
def offline_hub(hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    import huggingface_hub.constants as hf

    monkeypatch.setattr(hf, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(hf, "HF_HUB_OFFLINE", True)
    return hub_cache


@pytest.fixture
def serve_spy(monkeypatch: pytest.MonkeyPatch) -> list[IgnisConfig]:
    """Stands in for the server, and fails the test if anything tries to start a child process."""
    seen: list[IgnisConfig] = []
    fake = types.ModuleType("ignis.server.serve")
    fake.main = lambda cfg: seen.append(cfg)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ignis.server.serve", fake)

    def no_child(*args: object, **kwargs: object) -> None:
        raise AssertionError("a child process was started")

    monkeypatch.setattr(ignis.ipc.spawn.Child, "__init__", no_child)
    return seen


def test_serve_takes_the_model_positionally(model: Path, serve_spy: list[IgnisConfig]) -> None:
    assert main(["serve", str(model), "--lanes", "2", "--context", "1024", "--spec", "mtp:2", "--frontends", "3",
                 "--set", "log.level=warning"]) == 0
    cfg = serve_spy[0]
    assert (cfg.model.path, cfg.engine.lanes, cfg.engine.context) == (str(model), 2, 1024)
    assert (cfg.spec.backend, cfg.spec.draft_tokens, cfg.server.frontends) == ("mtp", 2, 3)


def test_serve_takes_a_hub_id_from_the_cache_and_serves_it_under_that_id(
    offline_hub: Path, serve_spy: list[IgnisConfig]
) -> None:
    assert main(["serve", REPO, "--set", "log.level=warning"]) == 0
    cfg = serve_spy[0]
    assert Path(cfg.model.path) == offline_hub / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT
    assert cfg.model.name == REPO
    assert main(["serve", REPO, "--revision", COMMIT, "--set", "model.name=mine", "--set", "log.level=warning"]) == 0
    assert serve_spy[1].model.name == "mine" and serve_spy[1].model.path == cfg.model.path


@pytest.mark.parametrize(("argv", "needle"), [
    (["serve", "/no/such/model"], "'/no/such/model': no such directory; give a checkpoint directory or a Hugging "
                                  "Face id"),
    (["serve", "ignis-test/missing"], "'ignis-test/missing' is not a directory here, nor in the Hugging Face cache, "
                                      "and the hub cannot be reached"),
    (["serve", REPO, "--revision", "v9"], "at revision 'v9' is not a directory here, nor in the Hugging Face cache"),
    (["serve", "--spec", "dflash2:x"], 'config --spec: got "dflash2:x"'),
    (["serve", "--lanes", "0"], "engine.lanes: got 0"),
    (["generate", "/no/such/model", "--prompt", "x"], "no such directory"),
])
def test_a_bad_model_or_flag_is_one_line_and_starts_no_process(
    argv: list[str], needle: str, offline_hub: Path, serve_spy: list[IgnisConfig], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ignis: error: ") and needle in err and err.count("\n") == 1 and "Traceback" not in err
    assert serve_spy == []


def test_a_directory_that_is_not_a_checkpoint_is_refused_before_serving(
    tmp_path: Path, serve_spy: list[IgnisConfig], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err and serve_spy == []


def test_an_unexpected_error_is_one_line_and_debug_shows_the_traceback(
    model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = types.ModuleType("ignis.server.serve")

    def boom(cfg: IgnisConfig) -> None:
        raise RuntimeError("something\nbroke")

    fake.main = boom  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ignis.server.serve", fake)
    assert main(["serve", str(model), "--set", "log.level=warning"]) == 1
    assert capsys.readouterr().err == ("ignis: error: RuntimeError: something broke (run with --debug for the "
                                       "traceback)\n")
    with pytest.raises(RuntimeError):
        main(["serve", str(model), "--debug", "--set", "log.level=warning"])


def test_help_shows_every_flag_with_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for needle in ("MODEL", "Hugging Face id", "--lanes N sequences decoded at once (engine.lanes; default 4",
                   "--context N", "max_position_embeddings, fitted to the memory left", "--spec BACKEND[:K]",
                   "default auto: dflash2 at 7 when the model carries a drafter", "--drafter PATH",
                   "server.host; default 127.0.0.1", "server.port; default 8000", "server.frontends; default 1",
                   "--api-key KEY", "server.api_key; default none", "--profile", "--revision", "--debug"):
        assert needle in text, needle


def test_layers_resolve_in_the_documented_order(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, serve_spy: list[IgnisConfig]
) -> None:
    """defaults < profile < --config file < IGNIS_* environment < --set < flags."""
    site = tmp_path / "site.toml"
    site.write_text("[engine]\nlanes = 2\nmax_waiting = 7\nseed = 5\n[server]\nfrontends = 2\n")
    monkeypatch.setenv("IGNIS_PROFILE", "h200")
    monkeypatch.setenv("IGNIS_ENGINE_MAX_WAITING", "9")  # over the file
    monkeypatch.setenv("IGNIS_ENGINE_LANES", "3")  # over the file, under --set
    monkeypatch.setenv("IGNIS_SERVER_FRONTENDS", "4")  # over the file, under the flag
    monkeypatch.setenv("IGNIS_LOG_LEVEL", "warning")
    monkeypatch.setenv("IGNIS_SERVER_API_KEY", "from-env")  # under the flag
    assert main(["serve", str(model), "--config", str(site), "--set", "engine.lanes=6", "--frontends", "5",
                 "--set", "server.frontends=1", "--set", "model.device=cpu", "--api-key", "from-flag"]) == 0
    cfg = serve_spy[0]
    assert cfg.engine.context == 32768  # the profile, named by IGNIS_PROFILE
    assert (cfg.engine.seed, cfg.engine.max_waiting, cfg.engine.lanes, cfg.server.frontends) == (5, 9, 6, 5)
    assert cfg.server.api_key == "from-flag"


def test_a_bad_environment_variable_is_named(
    model: Path, monkeypatch: pytest.MonkeyPatch, serve_spy: list[IgnisConfig], capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("IGNIS_ENGINE_LANE", "3")
    assert main(["serve", str(model)]) == 2
    err = capsys.readouterr().err
    assert "IGNIS_ENGINE_LANE" in err and 'did you mean "engine.lanes"' in err and serve_spy == []
    monkeypatch.delenv("IGNIS_ENGINE_LANE")
    monkeypatch.setenv("IGNIS_ENGINE_LANES", "many")
    assert main(["serve", str(model)]) == 2
    err = capsys.readouterr().err
    assert 'engine.lanes: got "many"' in err and "(set by environment variable IGNIS_ENGINE_LANES)" in err


def test_generate_runs_a_hub_id_offline_end_to_end(hub_cache: Path) -> None:
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1", "IGNIS_LOG_LEVEL": "warning"}
    proc = subprocess.run([sys.executable, "-m", "ignis.cli", "generate", REPO, "--prompt", "def fib(n):",
                           "--max-tokens", "4", "--profile", "cpu", "--context", "256"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "decode_tokens=4" in proc.stderr or "finish_reason=stop" in proc.stderr
