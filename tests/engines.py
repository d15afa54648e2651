"""Helpers for engine tests: an engine over a tiny checkpoint, and running token-id requests to completion."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ignis.config import load_config
from ignis.engine.core import Engine
from ignis.ipc.messages import EngineRequest, RequestDelta
from ignis.params import SamplingParams


def make_engine(
    ckpt: Path, backend: str = "off", draft_tokens: int = 0, *, profile: str = "cpu",
    model: dict[str, Any] | None = None, **engine: Any,
) -> Engine:
    """An engine over `ckpt`; `model` and `engine` override keys of those config sections."""
    overrides: dict[str, Any] = {"model.path": str(ckpt), "spec.backend": backend, "log.level": "warning"}
    if draft_tokens:
        overrides["spec.draft_tokens"] = draft_tokens
    overrides.update({f"model.{k}": v for k, v in (model or {}).items()})
    overrides.update({f"engine.{k}": v for k, v in engine.items()})
    return Engine(load_config(profile=profile, overrides=overrides))


def run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams) -> dict[str, RequestDelta]:
    """Add every prompt (ids "0", "1", ...), step until all finish; returns each id's tokens in a final delta."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    for i, (ids, p) in enumerate(zip(prompts, plist)):
        engine.add(EngineRequest(id=str(i), prompt_token_ids=ids, params=p))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    final: dict[str, RequestDelta] = {}
    while len(final) < len(prompts):
        for d in engine.step():
            tokens[d.id].extend(d.token_ids)
            if d.finished:
                final[d.id] = RequestDelta(id=d.id, token_ids=tokens[d.id], finished=True,
                                           finish_reason=d.finish_reason, stats=d.stats)
    return final


def prompts(n: int, vocab: int, seed: int = 0, lo: int = 3, hi: int = 90) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]
