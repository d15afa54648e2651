"""ignis configuration: a frozen dataclass tree resolved once from defaults, a profile, a TOML file and overrides.

Owns: the public config API (`IgnisConfig`, its sections, `load_config`, `PROFILES`, `installed_backends`).
Does not own: logging the resolved config (ignis.logging.log_resolved) or acting on it (engine, server).

    from ignis.config import load_config
    cfg = load_config(profile="cpu", overrides={"spec.backend": "mtp"})
"""

from __future__ import annotations

from ignis.config.load import (
    ENV_PREFIX,
    PROFILES,
    env_overrides,
    installed_backends,
    load_config,
    parse_overrides,
    read_profile,
)
from ignis.config.schema import (
    MAX_DRAFT_TOKENS,
    EngineSection,
    IgnisConfig,
    LogSection,
    ModelSection,
    ServerSection,
    SpecSection,
)

__all__ = [
    "IgnisConfig", "ModelSection", "EngineSection", "SpecSection", "ServerSection", "LogSection",
    "load_config", "parse_overrides", "read_profile", "installed_backends", "PROFILES", "MAX_DRAFT_TOKENS",
    "env_overrides", "ENV_PREFIX",
]
