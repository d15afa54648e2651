"""The Monitor's control panel: what the server runs, what it could run, and how to get there.

Owns: `GET /playground/config` (the resolved config, the built-in profile it follows, the installed backends and
which of them this model can run, and for each engine setting its current value and what it accepts) and
`POST /playground/command` (a wanted change, checked exactly as `ignis serve` would check it, answered with the
`ignis serve` line that runs it, or a 400 naming the key at fault). The engine's config is resolved once and never
changes while it runs (the design's rule), so every engine setting here needs a restart; per-request settings
(sampling, system prompt) change live and are set by the pages themselves. Does not own: config rules
(ignis.config) or loading the model (the engine).
"""

from __future__ import annotations

import dataclasses
import shlex
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any

import msgspec
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from ignis.artifact import resolve_model_path
from ignis.config import PROFILES, IgnisConfig, installed_backends, load_config, parse_overrides, read_profile
from ignis.config.schema import SECTIONS
from ignis.errors import ArtifactError, ConfigError, InputError

router = APIRouter()

# The engine settings the panel offers, in the order it shows them; each needs a restart.
KEYS = (
    "spec.backend", "spec.draft_tokens", "spec.draft_head", "spec.draft_sampling", "spec.verify",
    "engine.lanes", "engine.context", "engine.max_waiting", "server.frontends",
)


@dataclass(frozen=True)
class Carried:
    """What the served model can draft with: its own MTP layers, and a DFlash drafter's trained width."""

    mtp: bool
    drafter_width: int | None  # None: no usable drafter
    drafter_problem: str | None


def matching_profile(cfg: IgnisConfig) -> str | None:
    """The built-in profile whose every key this config holds (the most specific one), or None."""
    tree = cfg.as_dict()
    best, size = None, -1
    for name in PROFILES:
        keys = [(s, k, v) for s, table in read_profile(name).items() for k, v in table.items()]
        if all(tree[s][k] == v for s, k, v in keys) and len(keys) > size:
            best, size = name, len(keys)
    return best


def base_sets(cfg: IgnisConfig, profile: str | None) -> dict[str, Any]:
    """The `--set` overrides that, over `profile`, reproduce `cfg` exactly."""
    start = load_config(profile=profile).as_dict()
    return {
        f"{s}.{k}": v for s, table in cfg.as_dict().items() for k, v in table.items() if start[s][k] != v
    }


def command(profile: str | None, sets: dict[str, Any]) -> str:
    parts = ["ignis", "serve"]
    if profile is not None:
        parts += ["--profile", profile]
    for key, value in sets.items():
        text = ("true" if value else "false") if isinstance(value, bool) else str(value)
        parts += ["--set", shlex.quote(f"{key}={text}")]
    return " ".join(parts)


@cache
def carried(cfg: IgnisConfig) -> Carried:
    from ignis.backends.dflash2.config import DrafterConfig
    from ignis.model.config import ModelConfig

    model_dir = resolve_model_path(cfg)
    target = ModelConfig.from_dir(model_dir)
    try:
        width, problem = DrafterConfig.from_dir(cfg.spec.drafter_dir(model_dir), target).width, None
    except ArtifactError as e:
        width, problem = None, str(e)
    return Carried(mtp=target.mtp_num_hidden_layers > 0, drafter_width=width, drafter_problem=problem)


def _accepts(key: str) -> dict[str, Any]:
    """What `key` accepts, for the form: `choices`, or `min`/`max`."""
    section, name = key.split(".")
    cls = SECTIONS[section]
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if key == "spec.backend":
        return {"choices": list(installed_backends())}
    if "choices" in f.metadata:
        return {"choices": list(f.metadata["choices"])}
    if typing.get_type_hints(cls)[name] is int:
        return {"min": f.metadata.get("min"), "max": f.metadata.get("max")}
    return {}


def _check_runnable(cfg: IgnisConfig, have: Carried) -> None:
    """Refuse what the engine would refuse at load for this model, naming the key."""
    if cfg.spec.backend == "mtp" and not have.mtp:
        raise InputError("spec.backend", "this model has no mtp.* weights, so it cannot run the mtp backend")
    if cfg.spec.backend == "dflash2":
        if have.drafter_width is None:
            raise InputError("spec.backend", f"this model has no usable DFlash drafter: {have.drafter_problem}")
        if cfg.spec.draft_tokens > have.drafter_width:
            raise InputError("spec.draft_tokens", f"got {cfg.spec.draft_tokens}; the drafter was trained for at "
                             f"most {have.drafter_width} drafts a round")


def _json(body: Any) -> Response:
    return Response(msgspec.json.encode(body), media_type="application/json", headers={"Cache-Control": "no-store"})


@router.get("/playground/config")
async def describe(request: Request) -> Response:
    llm = request.app.state.llm
    cfg: IgnisConfig = llm.config
    profile = matching_profile(cfg)
    have = carried(cfg)
    tree = cfg.as_dict()
    info = llm.client.info if llm.client.ready else None
    return _json({
        "config": tree,
        "profile": profile,
        "command": command(profile, base_sets(cfg, profile)),
        "engine": msgspec.structs.asdict(info) if info is not None else None,
        "backends": {
            "installed": list(installed_backends()),
            "mtp": have.mtp,
            "drafter_width": have.drafter_width,
            "drafter_problem": have.drafter_problem,
        },
        "settings": [
            {"key": key, "value": tree[key.split(".")[0]][key.split(".")[1]], "restart": True, **_accepts(key)}
            for key in KEYS
        ],
    })


@router.post("/playground/command")
async def plan(request: Request) -> Response:
    """Body `{"set": {"spec.backend": "mtp", ...}}`, values as typed on a command line (or JSON scalars)."""
    try:
        body = msgspec.json.decode(await request.body())
    except msgspec.DecodeError as e:
        raise InputError("body", f"is not valid JSON: {e}") from None
    wanted = body.get("set") if isinstance(body, dict) else None
    if not isinstance(wanted, dict) or not all(isinstance(v, (str, int, float, bool)) for v in wanted.values()):
        raise InputError("set", 'must be an object of dotted keys to values, e.g. {"spec.backend": "mtp"}')
    cfg: IgnisConfig = request.app.state.llm.config
    profile = matching_profile(cfg)
    try:
        changes = parse_overrides([f"{k}={_text(v)}" for k, v in wanted.items()])
        sets = {**base_sets(cfg, profile), **changes}
        new = load_config(profile=profile, overrides=sets)
    except ConfigError as e:
        raise InputError(e.key, e.message) from None
    _check_runnable(new, carried(cfg))
    # Drop what the change leaves at the profile's value, so the line stays the shortest that runs it.
    sets = base_sets(new, profile)
    changed = sorted(k for k in wanted if _value(new, k) != _value(cfg, k))
    return _json({"command": command(profile, sets), "changed": changed, "restart": bool(changed)})


def _text(value: str | int | float | bool) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def _value(cfg: IgnisConfig, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)
