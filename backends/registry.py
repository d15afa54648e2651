"""Finding and loading speculation backends through the `ignis.spec_backends` entry-point group.

Owns: discovery by name and the refusal of unknown names. Built-ins register exactly as a third-party package would,
in pyproject.toml; each entry point is a callable `load(ctx: BackendContext) -> SpecBackend`.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Callable

from ignis.backends.base import BackendContext, SpecBackend
from ignis.errors import ConfigError

GROUP = "ignis.spec_backends"


def installed() -> dict[str, Callable[[BackendContext], SpecBackend]]:
    """Every backend installed in this environment, by name (loading each entry point lazily on call)."""
    found = {}
    for ep in entry_points(group=GROUP):
        found[ep.name] = ep
    return {name: (lambda ctx, ep=ep: ep.load()(ctx)) for name, ep in sorted(found.items())}


def load_backend(name: str, ctx: BackendContext) -> SpecBackend:
    loaders = installed()
    if name not in loaders:
        raise ConfigError("spec.backend", f"{name!r} is not installed; installed backends: {', '.join(loaders)}")
    return loaders[name](ctx)
