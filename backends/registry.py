"""Finding and loading speculation backends through the `ignis.spec_backends` entry-point group.

Owns: discovery by name and the refusal of unknown names. Built-ins register exactly as a third-party package would,
in pyproject.toml; each entry point is a callable `load(ctx: BackendContext) -> SpecBackend`.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points
from typing import Callable

from ignis.backends.base import BackendContext, SpecBackend
from ignis.errors import ConfigError

GROUP = "ignis.spec_backends"


def installed() -> dict[str, Callable[[BackendContext], SpecBackend]]:
    """Every backend installed in this environment, by name (each entry point is imported only when called)."""
    return {ep.name: _lazy(ep) for ep in sorted(entry_points(group=GROUP), key=lambda ep: ep.name)}


def _lazy(ep: EntryPoint) -> Callable[[BackendContext], SpecBackend]:
    def load(ctx: BackendContext) -> SpecBackend:
        factory: Callable[[BackendContext], SpecBackend] = ep.load()
        return factory(ctx)

    return load


def load_backend(name: str, ctx: BackendContext) -> SpecBackend:
    loaders = installed()
    if name not in loaders:
        raise ConfigError("spec.backend", f"{name!r} is not installed; installed backends: {', '.join(loaders)}")
    return loaders[name](ctx)
