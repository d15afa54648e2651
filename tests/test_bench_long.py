"""tools.bench_long on a tiny checkpoint: all three measurements run, the second turns resume, the figures are there."""

from __future__ import annotations

import json
from pathlib import Path

from tiny import tiny_checkpoint
from tools.bench_long import main


def test_bench_long_resumes_second_turns_and_times_rounds_beside_a_prefill(tmp_path: Path) -> None:
    ckpt = tiny_checkpoint(tmp_path / "ckpt", seed=3, mtp=True, vocab_size=512)
    out = tmp_path / "long.json"
    assert main(["--model", str(ckpt), "--profile", "cpu", "--backend", "mtp:2", "--context", "100", "--reply", "4",
                 "--turn", "10", "--lanes", "2", "--rounds", "2", "--long", "150", "--json", str(out)]) == 0
    (r,) = json.loads(out.read_text())
    assert r["resumed_lane"] == r["resumed_host"] == 103 and r["second_turn_tokens"] == 114
    assert r["ttft_full_ms"] > 0 and r["full_over_lane"] > 0 and r["full_over_host"] > 0
    assert r["decoding_lanes"] == 1 and r["prefill_rounds"] >= 1 and r["round_ms_during_prefill"] > 0
    (long,) = r["long"]
    assert long["prompt_tokens"] == 150 and long["prefill_tok_s"] > 0 and long["decode_round_ms"] > 0
    assert 1 <= long["tokens_per_round"] <= 3  # a round commits its anchor's token and at most 2 drafts
    assert long["decode_floor_ms"] is None  # no GPU: no copy bandwidth to take a floor from
