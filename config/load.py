"""Resolving a config: defaults < profile < TOML file < environment < overrides, then one checked `IgnisConfig`.

Owns: the list of built-in profiles and how they are read, TOML file reading, the `IGNIS_SECTION_KEY` environment
variables (`IGNIS_ENGINE_LANES=8` is `engine.lanes = 8`; the `ignis` command passes its environment, Python callers
pass one if they want it), dotted overrides in both forms (`{"spec.backend": "mtp"}` from Python,
`["spec.backend=mtp"]` from `--set`), and naming where a refused value came from. Does not own: what a key accepts (ignis.config.schema) or which backends exist (the entry-point
group, read by `installed_backends`).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.resources
import tomllib
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ignis.config.schema import SECTIONS, IgnisConfig, section_field, unknown_message
from ignis.errors import ConfigError

PROFILES: tuple[str, ...] = ("cpu", "h200", "rtx5090", "rtxpro6000", "rtx50-16gb")
BACKEND_GROUP = "ignis.spec_backends"
ENV_PREFIX = "IGNIS_"


def installed_backends() -> tuple[str, ...]:
    """Names of the speculation backends installed as entry points (built-ins register the same way)."""
    return tuple(sorted({ep.name for ep in importlib.metadata.entry_points(group=BACKEND_GROUP)}))


def load_config(
    profile: str | None = None,
    path: str | Path | None = None,
    overrides: Mapping[str, Any] | Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> IgnisConfig:
    """Resolve the config from defaults, then `profile`, then the TOML file at `path`, then the `IGNIS_*` variables
    of `env` (None: none are read), then `overrides`.

    Overrides are dotted keys: a mapping holds typed Python values; a sequence holds "key=value" strings whose
    values are read as TOML literals (7, true, "x") and otherwise taken as bare strings. Raises ConfigError
    naming the key, the value, what is allowed and where the value came from.
    """
    merged: dict[str, dict[str, Any]] = {}
    origin: dict[str, str] = {}
    if profile is not None:
        _merge_tree(merged, origin, read_profile(profile), f'profile "{profile}"')
    if path is not None:
        _merge_tree(merged, origin, _read_toml(Path(path)), f"file {path}")
    for var, (dotted, value) in env_overrides(env or {}).items():
        section, key = _split(dotted)
        merged.setdefault(section, {})[key] = value
        origin[dotted] = f"environment variable {var}"
    if overrides is not None:
        if isinstance(overrides, Mapping):
            flat, source = dict(overrides), "overrides"
        else:
            flat, source = parse_overrides([overrides] if isinstance(overrides, str) else overrides), "the command line"
        for dotted, value in flat.items():
            section, key = _split(dotted)
            merged.setdefault(section, {})[key] = value
            origin[f"{section}.{key}"] = source
    try:
        return IgnisConfig.from_dict(merged)
    except ConfigError as e:
        if e.key in origin:
            raise ConfigError(e.key, f"{e.message} (set by {origin[e.key]})") from None
        raise


def read_profile(name: str) -> dict[str, Any]:
    """The TOML tree of built-in profile `name`; an unknown name is refused with the list of profiles."""
    if name not in PROFILES:
        raise ConfigError("profile", f'unknown profile "{name}"; profiles are: {", ".join(PROFILES)}')
    resource = importlib.resources.files("ignis.config").joinpath("profiles", f"{name}.toml")
    return tomllib.loads(resource.read_text(encoding="utf-8"))


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """["spec.backend=mtp", "engine.lanes=8"] -> {"spec.backend": "mtp", "engine.lanes": 8}, keys checked.

    A string field keeps the text as written even when it would parse as another literal, so
    `--set model.name=2024` names the model "2024" instead of being refused as an integer.
    """
    out: dict[str, Any] = {}
    for item in items:
        dotted, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(item, f'expected KEY=VALUE, e.g. spec.backend=mtp, got "{item}"')
        dotted, raw = dotted.strip(), raw.strip()
        section, key = _split(dotted)
        value = _literal(raw)
        if typing.get_type_hints(SECTIONS[section])[key] is str and not isinstance(value, str):
            value = raw
        out[dotted] = value
    return out


def env_overrides(env: Mapping[str, str]) -> dict[str, tuple[str, Any]]:
    """IGNIS_<SECTION>_<KEY> variables -> {variable: (dotted key, value)}, values read as `--set` reads them.

    Only variables whose second word is a config section are config (IGNIS_PROFILE, IGNIS_DEBUG and the like are
    other things); an unknown key in a known section is refused, naming the variable."""
    out: dict[str, tuple[str, Any]] = {}
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX):
            continue
        section, _, key = var[len(ENV_PREFIX):].lower().partition("_")
        if section not in SECTIONS or not key:
            continue
        try:
            out[var] = (f"{section}.{key}", parse_overrides([f"{section}.{key}={env[var]}"])[f"{section}.{key}"])
        except ConfigError as e:
            raise ConfigError(var, f"{e.message} (environment variable {var})") from None
    return out


def _literal(raw: str) -> Any:
    try:
        doc = tomllib.loads(f"v = {raw}")
    except tomllib.TOMLDecodeError:
        return raw
    # A value with a newline could smuggle in more TOML; only a single literal counts as one.
    return doc["v"] if len(doc) == 1 else raw


def _split(dotted: str) -> tuple[str, str]:
    section, dot, key = dotted.partition(".")
    if not dot:
        owners = [f"{s}.{dotted}" for s, cls in SECTIONS.items() if dotted in {f.name for f in dataclasses.fields(cls)}]
        hint = f'; did you mean "{owners[0]}"?' if owners else f"; sections are: {', '.join(SECTIONS)}"
        raise ConfigError(dotted, f'expected a dotted key "section.key" such as "spec.backend"{hint}')
    section_field(section, key)
    return section, key


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(str(path), "no such config file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(str(path), f"not valid TOML: {e}") from None


def _merge_tree(merged: dict[str, dict[str, Any]], origin: dict[str, str], tree: dict[str, Any], source: str) -> None:
    for section, table in tree.items():
        if section not in SECTIONS:
            raise ConfigError(section, f"{unknown_message(section, None)} (in {source})")
        if not isinstance(table, dict):
            raise ConfigError(section, f"expected a table [{section}], got {table!r} (in {source})")
        for key, value in table.items():
            try:
                section_field(section, key)
            except ConfigError as e:
                raise ConfigError(e.key, f"{e.message} (in {source})") from None
            merged.setdefault(section, {})[key] = value
            origin[f"{section}.{key}"] = source
