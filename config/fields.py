"""Field declarations for the config sections and the checks they imply.

Owns: the helpers that declare a field together with what it accepts (`choice`, `flag`, `integer`, `number`, `text`),
the per-field type and range check every section runs on construction, and the wording of the "what is allowed"
part of a refusal. Does not own: the sections themselves (ignis.config.schema) or rules that tie fields
together (each section's `__post_init__`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from typing import Any

from ignis.errors import ConfigError


def choice(default: str, *allowed: str) -> Any:
    """A string field that takes one of `allowed`."""
    return dataclasses.field(default=default, metadata={"choices": allowed})


def integer(default: int, lo: int, hi: int | None = None, *, multiple_of: int = 1, allowed: str = "") -> Any:
    """An int field in lo..hi (hi None: no upper bound), optionally a multiple of `multiple_of`.

    `allowed` replaces the generated description when the plain range would mislead (e.g. 0 meaning unset).
    """
    meta = {"min": lo, "max": hi, "multiple_of": multiple_of, "allowed": allowed}
    return dataclasses.field(default=default, metadata=meta)


def flag(default: bool) -> Any:
    """A boolean field (TOML true / false)."""
    return dataclasses.field(default=default, metadata={})


def number(default: float) -> Any:
    """A float field that must be finite and > 0 (every float in the schema is a duration)."""
    return dataclasses.field(default=default, metadata={"positive": True})


def text(default: str, *, pattern: typing.Callable[[str], bool] | None = None, allowed: str = "") -> Any:
    """A free string field; `pattern` (with its description `allowed`) narrows it when given."""
    return dataclasses.field(default=default, metadata={"pattern": pattern, "allowed": allowed})


def describe(f: dataclasses.Field[Any], typ: type) -> str:
    """What field `f` accepts, in words, for refusal messages."""
    meta = f.metadata
    if meta.get("allowed"):
        return str(meta["allowed"])
    if "choices" in meta:
        return "one of " + ", ".join(f'"{c}"' for c in meta["choices"])
    if typ is int:
        lo, hi, step = meta.get("min"), meta.get("max"), meta.get("multiple_of", 1)
        if step > 1:
            return f"a positive multiple of {step}"
        if hi is None:
            return f"an integer >= {lo}"
        return f"an integer from {lo} to {hi}"
    if typ is float:
        return "a finite number > 0"
    if typ is bool:
        return "true or false"
    return "a string"


def _type_name(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(type(value), type(value).__name__)


def check_section(section: str, obj: Any) -> None:
    """Refuse a value of the wrong type or out of range in dataclass `obj`; widen int to float where a float goes.

    Runs in each section's `__post_init__`, so every instance, however it was built, holds checked values.
    """
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        typ = hints[f.name]
        value = getattr(obj, f.name)
        key = f"{section}.{f.name}"
        allowed = describe(f, typ)
        shown = json.dumps(value) if isinstance(value, str) else repr(value)
        # bool is an int subclass in Python; `lanes = true` is a mistake, not 1.
        if typ is bool:
            if not isinstance(value, bool):
                raise ConfigError(key, f"got {shown}, {_type_name(value)}; expected {allowed}")
            continue
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
            object.__setattr__(obj, f.name, value)
        if not isinstance(value, typ) or isinstance(value, bool):
            raise ConfigError(key, f"got {shown}, {_type_name(value)}; expected {allowed}")
        meta = f.metadata
        ok = True
        if "choices" in meta:
            ok = value in meta["choices"]
        elif typ is int:
            hi = meta.get("max")
            ok = value >= meta["min"] and (hi is None or value <= hi) and value % meta.get("multiple_of", 1) == 0
        elif typ is float:
            ok = math.isfinite(value) and value > 0
        elif meta.get("pattern") is not None:
            ok = meta["pattern"](value)
        if not ok:
            raise ConfigError(key, f"got {shown}; expected {allowed}")
