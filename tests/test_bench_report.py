"""`ignis bench` arithmetic and inputs: percentiles, per-request TPOT, tokens per round, B/A ratios, workload files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ignis.bench import report
from ignis.bench.load import Sample
from ignis.bench.workloads import load
from ignis.errors import InputError


def test_a_level_summary_is_the_requests_own_figures() -> None:
    samples = [Sample(ok=True, ttft=0.1 * i, e2e=0.1 * i + 0.9, prompt_tokens=10, output_tokens=10, rounds=4,
                      accepted=6) for i in range(1, 11)]
    samples.append(Sample(ok=False, error="HTTP 503: full"))
    r = report.summarize(samples, wall_s=2.0, concurrency=4)
    assert (r["requests"], r["errors"], r["first_error"], r["output_tokens"]) == (11, 1, "HTTP 503: full", 100)
    assert r["output_tokens_per_s"] == 50.0 and r["requests_per_s"] == 5.0
    assert (r["ttft_ms"]["p50"], r["ttft_ms"]["p90"], r["ttft_ms"]["p99"]) == (500.0, 900.0, 1000.0)  # nearest rank
    assert r["tpot_ms"]["p50"] == 100.0  # 0.9 s over the 9 tokens after the first
    assert r["tokens_per_round"] == 2.5  # (40 rounds + 60 accepted drafts) / 40 rounds
    other = report.summarize([Sample(ok=True, ttft=0.2, e2e=1.0, output_tokens=1)], wall_s=1.0, concurrency=4)
    assert other["tokens_per_round"] is None and other["tpot_ms"]["p50"] is None  # no timings; one token: no TPOT
    ratios = report.ratios({"levels": [r]}, {"levels": [dict(r, output_tokens_per_s=125.0)]})
    assert ratios == [{"concurrency": 4, "output_tokens_per_s": 2.5, "ttft_p50": 1.0, "tpot_p50": 1.0}]


def test_workloads_built_in_and_from_a_file(tmp_path: Path) -> None:
    assert {item.temperature for item in load("code", 8)} == {0.0} and len(load("code", 8)) == 64
    chat = load("chat", 8)
    assert chat[0].messages and chat[0].path == "/chat/completions" and chat[0].temperature == 0.7
    f = tmp_path / "w.jsonl"
    rows = [{"prompt": "a", "max_tokens": 3}, {"messages": [{"role": "user", "content": "b"}]}]
    f.write_text("".join(json.dumps(row) + "\n" for row in rows))
    items = load(str(f), 16)
    assert [(i.prompt, i.max_tokens, i.path) for i in items] == [
        ("a", 3, "/completions"), (None, 16, "/chat/completions")]
    assert items[0].body("m", ignore_eos=True)["ignore_eos"] is True and "ignore_eos" not in items[1].body("m")
    f.write_text('{"text": "no prompt"}\n')
    with pytest.raises(InputError, match="line 1: expected an object with 'prompt' or 'messages'"):
        load(str(f), 16)
    with pytest.raises(InputError, match="neither a built-in workload"):
        load("poems", 16)
