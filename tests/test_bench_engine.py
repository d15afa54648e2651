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
