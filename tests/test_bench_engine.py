"""tools.bench_engine on the CPU: every requested prompt is decoded at each lane count, and its figures add up."""

from __future__ import annotations

import json
from pathlib import Path

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
