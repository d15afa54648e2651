"""Config resolution: defaults, profiles, files, overrides in both forms, and every refusal naming its key."""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
import tomllib
from pathlib import Path
from typing import Any

import pytest

import ignis.config
from ignis.config import PROFILES, IgnisConfig, load_config, parse_overrides, read_profile
from ignis.errors import ConfigError


@pytest.fixture
def with_dflash2(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend a dflash2 backend package is installed beside the built-ins."""
    monkeypatch.setattr(ignis.config, "installed_backends", lambda: ("dflash2", "mtp", "off"))


def refused(key: str, **kwargs: Any) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(**kwargs)
    assert info.value.key == key
    assert key in str(info.value)
    return str(info.value)


def test_defaults_are_the_documented_ones() -> None:
    cfg = load_config()
    assert cfg == IgnisConfig()
    assert (cfg.model.path, cfg.model.dtype, cfg.model.device, cfg.model.exact) == ("", "auto", "auto", "auto")
    # context 0 and backend "auto" are settled by the engine from the model and the memory (tests/test_defaults.py).
    assert (cfg.engine.lanes, cfg.engine.context, cfg.engine.max_rows, cfg.engine.prefill_chunk) == (4, 0, 512, 64)
    assert (cfg.engine.max_waiting, cfg.engine.seed) == (256, 0)
    assert (cfg.spec.backend, cfg.spec.draft_tokens, cfg.spec.draft_head, cfg.spec.drafter) == ("auto", 0, "auto", "")
    assert (cfg.server.host, cfg.server.port, cfg.server.frontends, cfg.server.transport) == ("127.0.0.1", 8000, 1, "ipc")
    assert (cfg.server.heartbeat_s, cfg.server.engine_timeout_s) == (1.0, 5.0)
    assert (cfg.log.level, cfg.log.format) == ("info", "console")


def test_config_is_frozen() -> None:
    cfg = load_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.engine.lanes = 8  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.spec = cfg.spec  # type: ignore[misc]


def test_profile_list_matches_the_shipped_files() -> None:
    shipped = {p.name[: -len(".toml")] for p in importlib.resources.files("ignis.config").joinpath("profiles").iterdir()
               if p.name.endswith(".toml")}
    assert shipped == set(PROFILES)


def test_cpu_and_h200_profiles() -> None:
    cpu = load_config(profile="cpu")
    assert (cpu.model.device, cpu.model.dtype, cpu.engine.lanes) == ("cpu", "float32", 4)
    h200 = load_config(profile="h200")
    assert (h200.model.device, h200.model.dtype, h200.engine.lanes, h200.engine.context) == ("cuda", "bfloat16", 8, 32768)


RTX = {"rtx5090": (4, 16384), "rtxpro6000": (8, 32768), "rtx50-16gb": (4, 16384)}  # tests/test_plan.py: why


@pytest.mark.parametrize("name", sorted(RTX))
def test_rtx_profiles_set_dflash2_at_seven(name: str) -> None:
    tree = read_profile(name)
    assert tree["spec"] == {"backend": "dflash2", "draft_tokens": 7}
    assert tree["model"] == {"device": "cuda", "dtype": "bfloat16", "weights": "bf16" if name == "rtxpro6000" else "int4"}
    assert (tree["engine"]["lanes"], tree["engine"]["context"]) == RTX[name]


@pytest.mark.parametrize("name", sorted(RTX))
def test_rtx_profiles_resolve_once_dflash2_is_installed(name: str, with_dflash2: None) -> None:
    cfg = load_config(profile=name)
    assert (cfg.spec.backend, cfg.spec.draft_tokens, cfg.engine.lanes) == ("dflash2", 7, RTX[name][0])


def test_rtx_profile_without_dflash2_says_it_is_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ignis.config, "installed_backends", lambda: ("mtp", "off"))
    msg = refused("spec.backend", profile="rtx5090")
    assert "dflash2" in msg and "not installed" in msg and '"mtp", "off"' in msg and 'profile "rtx5090"' in msg


def test_unknown_profile_names_the_profiles() -> None:
    msg = refused("profile", profile="a100")
    assert "a100" in msg and all(p in msg for p in PROFILES)


def test_precedence_defaults_profile_file_overrides(tmp_path: Path) -> None:
    f = tmp_path / "mine.toml"
    f.write_text('[engine]\nlanes = 6\ncontext = 8192\n[log]\nformat = "json"\n')
    cfg = load_config(profile="h200", path=f, overrides={"engine.lanes": 2})
    assert cfg.model.device == "cuda"  # profile
    assert cfg.engine.context == 8192 and cfg.log.format == "json"  # file over profile
    assert cfg.engine.lanes == 2  # override over file
    assert cfg.engine.max_rows == 512  # default


def test_overrides_from_the_command_line_are_toml_literals() -> None:
    parsed = parse_overrides(["engine.lanes=8", 'model.name="served"', "server.heartbeat_s=0.5",
                              "model.path=/models/q 3", "model.name=2024", "spec.backend = mtp", "model.path="])
    assert parsed == {"engine.lanes": 8, "model.name": "2024", "server.heartbeat_s": 0.5, "model.path": "",
                      "spec.backend": "mtp"}
    cfg = load_config(overrides=["engine.lanes=8", "server.engine_timeout_s=3", "spec.backend=mtp"])
    assert cfg.engine.lanes == 8 and cfg.spec.backend == "mtp"
    assert cfg.server.engine_timeout_s == 3.0 and isinstance(cfg.server.engine_timeout_s, float)


def test_overrides_from_python_keep_their_types() -> None:
    cfg = load_config(overrides={"engine.lanes": 8, "model.path": "/m", "server.heartbeat_s": 2})
    assert (cfg.engine.lanes, cfg.model.path, cfg.server.heartbeat_s) == (8, "/m", 2.0)
    msg = refused("engine.lanes", overrides={"engine.lanes": "8"})
    assert '"8"' in msg and "a string" in msg and "integer from 1 to 1024" in msg


@pytest.mark.parametrize("item", ["engine.lanes", "=3"])
def test_override_without_equals_or_key_is_refused(item: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[item])
    assert "KEY=VALUE" in str(info.value) or "dotted key" in str(info.value)


BAD: list[tuple[str, Any, str]] = [
    ("engine.lanes", 0, "an integer from 1 to 1024"),
    ("engine.lanes", 1025, "an integer from 1 to 1024"),
    ("engine.lanes", True, "a boolean"),
    ("engine.lanes", 2.0, "a number"),
    ("engine.context", 8, "0 (auto: from the model, fitted to memory) or 16..1048576"),
    ("engine.context", -1, "0 (auto: from the model, fitted to memory) or 16..1048576"),
    ("engine.max_rows", 32, "an integer >= 64"),
    ("engine.prefill_chunk", 96, "a positive multiple of 64"),
    ("engine.prefill_chunk", 0, "a positive multiple of 64"),
    ("engine.prefill_chunk", 1024, "must fit in one round"),
    ("engine.max_waiting", -1, "an integer >= 0"),
    ("engine.seed", -5, "an integer from 0"),
    ("model.dtype", "fp8", '"auto", "float32", "bfloat16", "float16"'),
    ("model.device", "gpu", '"cuda:N"'),
    ("model.device", "cuda:", '"cuda:N"'),
    ("model.exact", "yes", '"auto", "on", "off"'),
    ("model.path", 3, "a string"),
    ("spec.draft_tokens", 8, "0 (unset) or 1..7"),
    ("spec.draft_head", "top", '"full", "shortlist"'),
    ("spec.verify", "tree", '"block", "token"'),
    ("server.port", 70000, "an integer from 0 to 65535"),
    ("server.frontends", 0, "an integer from 1 to 64"),
    ("server.transport", "udp", '"ipc", "tcp"'),
    ("server.host", "", "a host name or address"),
    ("server.heartbeat_s", 0, "a finite number > 0"),
    ("server.heartbeat_s", math.inf, "a finite number > 0"),
    ("server.engine_timeout_s", 1.5, "at least twice server.heartbeat_s"),
    ("server.engine_address", "tcp://127.0.0.1:5555", 'must start with "ipc://"'),
    ("server.engine_address", "localhost:5555", '"ipc://PATH"'),
    ("log.level", "trace", '"debug", "info", "warning", "error"'),
    ("log.format", "xml", '"console", "json"'),
]


@pytest.mark.parametrize(("key", "value", "allowed"), BAD, ids=[f"{k}={v!r}" for k, v, _ in BAD])
def test_bad_values_are_refused_naming_key_value_and_what_is_allowed(key: str, value: Any, allowed: str) -> None:
    msg = refused(key, overrides={key: value})
    shown = f'"{value}"' if isinstance(value, str) else repr(value)
    assert shown in msg and allowed in msg and "(set by overrides)" in msg


def test_unknown_key_lists_the_section_and_suggests_a_match() -> None:
    msg = refused("engine.lane", overrides={"engine.lane": 3})
    assert "lanes, context, max_rows" in msg and 'did you mean "engine.lanes"' in msg
    msg = refused("spce.backend", overrides=["spce.backend=mtp"])
    assert "model, engine, spec, server, log" in msg and 'did you mean "spec"' in msg
    msg = refused("lanes", overrides=["lanes=3"])
    assert 'did you mean "engine.lanes"' in msg


def test_draft_tokens_without_a_backend_is_refused() -> None:
    msg = refused("spec.draft_tokens", overrides={"spec.draft_tokens": 3})
    assert "spec.draft_tokens needs spec.backend set to a drafting backend" in msg and '"mtp"' in msg and "3" in msg


def test_dflash2_requires_draft_tokens(with_dflash2: None) -> None:
    msg = refused("spec.draft_tokens", overrides={"spec.backend": "dflash2"})
    assert "required with dflash2; set spec.draft_tokens to 1..7" in msg
    assert load_config(overrides={"spec.backend": "dflash2", "spec.draft_tokens": 3}).spec.draft_tokens == 3


def test_mtp_defaults_to_one_draft_and_keeps_an_explicit_count() -> None:
    assert load_config(overrides={"spec.backend": "mtp"}).spec.draft_tokens == 1
    assert load_config(overrides={"spec.backend": "mtp", "spec.draft_tokens": 7}).spec.draft_tokens == 7


def test_unknown_backend_lists_the_installed_ones() -> None:
    msg = refused("spec.backend", overrides={"spec.backend": "eagle"})
    assert '"eagle"' in msg and '"mtp", "off"' in msg


def test_installed_backends_come_from_the_entry_point_group() -> None:
    assert {"off", "mtp"} <= set(ignis.config.installed_backends())


def test_a_round_must_hold_every_lanes_verify_columns() -> None:
    msg = refused("engine.max_rows", overrides={"engine.lanes": 128, "spec.backend": "mtp", "spec.draft_tokens": 7})
    assert "1024 verify columns" in msg and "engine.lanes = 128" in msg
    assert load_config(overrides={"engine.lanes": 64, "spec.backend": "mtp", "spec.draft_tokens": 7}).engine.lanes == 64


def test_file_errors_name_the_file_and_the_key(tmp_path: Path) -> None:
    refused(str(tmp_path / "none.toml"), path=tmp_path / "none.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[engine\nlanes = 3\n")
    assert "not valid TOML" in refused(str(broken), path=broken)
    typo = tmp_path / "typo.toml"
    typo.write_text("[engine]\nlanez = 3\n")
    assert str(typo) in refused("engine.lanez", path=typo)
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nport = -1\n")
    assert f"(set by file {bad})" in refused("server.port", path=bad)


@pytest.mark.parametrize("overrides", [
    {},
    {"spec.backend": "mtp", "model.name": 'a "quoted"\\name\n', "server.heartbeat_s": 0.25, "engine.seed": 2**63 - 1},
    {"model.path": "/tmp/ü", "server.transport": "tcp", "server.engine_address": "tcp://10.0.0.1:7000"},
])
def test_to_toml_and_as_dict_round_trip(tmp_path: Path, overrides: dict[str, Any]) -> None:
    cfg = load_config(profile="cpu", overrides=overrides)
    f = tmp_path / "resolved.toml"
    f.write_text(cfg.to_toml(), encoding="utf-8")
    assert load_config(path=f) == cfg
    assert tomllib.loads(cfg.to_toml()) == cfg.as_dict()
    assert IgnisConfig.from_dict(cfg.as_dict()) == cfg


def test_from_dict_refuses_unknown_keys() -> None:
    with pytest.raises(ConfigError, match='did you mean "engine.lanes"'):
        IgnisConfig.from_dict({"engine": {"lane": 2}})


def test_drafter_defaults_to_beside_the_weights() -> None:
    assert load_config().spec.drafter_dir(Path("/m/q")) == Path("/m/q/drafter")
    assert load_config(overrides={"spec.drafter": "/d"}).spec.drafter_dir(Path("/m/q")) == Path("/d")
