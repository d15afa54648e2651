"""The end of a training run: the new drafter against plain decoding, through the engine, on held-out prompts.

Owns: decoding the held-out prompts with `off` and with `dflash2` at the drafter's width (greedy, then sampled at
T = 1.0, top_p 0.95, top_k 20) and summarising: tokens a round (after the first token), greedy outputs equal to
`off`, loop rate, decode speed of each. Does not own: the tallies (ignis.acceptance) or the engine.

Greedy output must equal `off` (exactly on the CPU; on a GPU in bf16 a near-tie may flip a token, which the summary
shows as a share below 1). Tokens a round do not depend on the device; tokens a second do.
"""

from __future__ import annotations

from typing import Any

from ignis.acceptance import measure
from ignis.config import load_config
from ignis.config.schema import MAX_DRAFT_TOKENS
from ignis.engine.core import Engine
from ignis.params import SamplingParams

SAMPLED = dict(temperature=1.0, top_p=0.95, top_k=20)


def evaluate(overrides: dict[str, Any], profile: str | None, drafter: str, width: int, prompts: list[list[int]],
             max_tokens: int, seed: int) -> dict[str, Any]:
    """Summary of the held-out comparison; `overrides` configure both engines (model path, device, lanes...)."""
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    sampled = SamplingParams(max_tokens=max_tokens, seed=seed, **SAMPLED)  # type: ignore[arg-type]
    k = min(width, MAX_DRAFT_TOKENS)
    off = Engine(load_config(profile=profile, overrides={**overrides, "spec.backend": "off"}))
    base, base_out = measure(off, prompts, greedy, "greedy")
    del off
    spec = Engine(load_config(profile=profile, overrides={**overrides, "spec.backend": "dflash2",
                                                          "spec.draft_tokens": k, "spec.drafter": drafter}))
    fast, fast_out = measure(spec, prompts, greedy, "greedy")
    drawn, _ = measure(spec, prompts, sampled, "sampled")
    same = sum(a == b for a, b in zip(base_out, fast_out))
    return {
        "held_out_prompts": len(prompts),
        "max_tokens": max_tokens,
        "draft_tokens": k,
        "greedy_tokens_per_round": round(fast.tokens_per_round, 4),
        "sampled_tokens_per_round": round(drawn.tokens_per_round, 4),
        "greedy_per_position": [round(x, 4) for x in fast.per_position()],
        "greedy_equal_to_off": f"{same}/{len(prompts)}",
        "greedy_loop_rate": round(base.loop_rate, 4),
        "off_tokens_per_s": round(base.tokens / base.seconds, 1) if base.seconds else 0.0,
        "dflash2_tokens_per_s": round(fast.tokens / fast.seconds, 1) if fast.seconds else 0.0,
    }
