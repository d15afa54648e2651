"""tools.bench_engine on the CPU: every requested prompt is decoded at each lane count, and its figures add up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ignis.errors import ConfigError
from tools.bench_engine import main


def test_bench_engine_decodes_every_request_and_reports_both_speeds(tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    assert main(["--backend", "off", "--lanes", "1", "--lanes", "2", "--requests", "3", "--max-tokens", "4",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["lanes"], r["backend"]) for r in rows] == [(1, "off"), (1, "off"), (2, "off"), (2, "off")]
    for r in rows:
        assert r["requests"] == 3 and r["tokens"] == 3 * 3  # 4 tokens each, the first of each not counted
        assert r["tok_s"] > 0 and r["tok_s_request"] > 0 and r["tokens_per_round"] == 1.0
        assert 0.0 <= r["wait_share"] <= 1.0


def test_a_backend_variant_carries_its_config_overrides(tmp_path: Path) -> None:
    """`--backend NAME:K,KEY=VALUE`: the variant runs with those overrides, beside the plain backend in one run."""
    out = tmp_path / "engine.json"
    assert main(["--backend", "off", "--backend", "off,engine.rounds_per_sync=2,model.exact=off", "--lanes", "1",
                 "--requests", "1", "--max-tokens", "6", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["backend"] for r in rows] == ["off", "off,engine.rounds_per_sync=2,model.exact=off", "off"]
    assert rows[0]["tokens"] == rows[1]["tokens"] == 5
    with pytest.raises(ConfigError, match="rounds_per_sync"):  # the overrides reach the engine's config
        main(["--backend", "off,engine.rounds_per_sync=9", "--lanes", "1", "--requests", "1", "--max-tokens", "2"])


def test_waits_time_the_runners_syncs_and_the_device_rounds_waits_and_put_them_back(tmp_path: Path) -> None:
    """bench_engine.Waits counts the seconds inside the runner's syncs and the device round's waits for a queued
    round (both taken on the CPU too, where they return at once), and leaves both as they were."""
    import ignis.engine.round as rounds
    from engines import make_engine
    from tiny import tiny_checkpoint
    from tools.bench_engine import Waits, decode

    engine = make_engine(tiny_checkpoint(tmp_path, seed=3, vocab_size=256), "off", model={"exact": "off"}, lanes=2)
    dr = engine.runner.device_round
    assert dr is not None
    kept_sync, kept_wait = rounds.synchronize, dr.wait
    calls: list[str] = []
    with Waits().on(engine) as waits:
        inner_sync, inner_wait = rounds.synchronize, dr.wait
        assert inner_sync is not kept_sync and inner_wait != kept_wait
        waits.timed(lambda *a: calls.append("x"))()
        r = decode(engine, [[5, 6, 7], [8, 9]], 6)
    assert calls == ["x"] and waits.seconds >= 0.0 and 0.0 <= r["wait_share"] <= 1.0
    assert rounds.synchronize is kept_sync and dr.wait == kept_wait and "wait" not in vars(dr)
