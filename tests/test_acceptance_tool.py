"""The acceptance tool: recorded turns replay token for token under teacher forcing, its tallies add up, tokens a
round leave out the prefill's first token, and the loop rate finds outputs that end in a cycle."""

from __future__ import annotations

from pathlib import Path

import pytest

import itertools
import random

import torch

from engines import make_engine, prompts
from ignis.acceptance import Tally, loops, measure
from ignis.ipc.messages import EngineRequest, RequestStats
from ignis.params import SamplingParams
from tiny import tiny_checkpoint
from tools.acceptance import main, record, replay

VOCAB = 512
SAMPLED = SamplingParams(max_tokens=14, temperature=1.0, top_p=0.95, top_k=20, seed=3, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("acc"), seed=9, mtp=True, vocab_size=VOCAB)


def test_teacher_forcing_emits_the_record_whatever_the_drafts(ckpt: Path) -> None:
    ps = prompts(3, VOCAB, seed=4, lo=5, hi=40)
    turns = record(str(ckpt), "cpu", ps, SAMPLED, lanes=2)
    engine = make_engine(ckpt, "mtp", draft_tokens=3, lanes=2)
    for i, t in enumerate(turns):
        p = SamplingParams(max_tokens=len(t["response_token_ids"]), temperature=1.0, seed=5)
        engine.add(EngineRequest(id=str(i), prompt_token_ids=t["prompt_token_ids"], params=p),
                   forced=t["response_token_ids"])
    got: dict[str, list[int]] = {}
    done = 0
    while done < len(turns):
        for d in engine.step():
            got.setdefault(d.id, []).extend(d.token_ids)
            if d.finished:
                done += 1
                assert d.stats.accepted <= d.stats.drafted and d.stats.rounds >= 1
    assert [got[str(i)] for i in range(len(turns))] == [t["response_token_ids"] for t in turns]


def test_replay_and_free_running_tallies(ckpt: Path) -> None:
    ps = prompts(3, VOCAB, seed=6, lo=5, hi=40)
    turns = record(str(ckpt), "cpu", ps, SAMPLED, lanes=3)
    off = replay(str(ckpt), "cpu", "off", 0, turns, SAMPLED, lanes=3)
    assert off.rounds == sum(len(t["response_token_ids"]) - 1 for t in turns) and off.tokens_per_round == 1.0
    spec = replay(str(ckpt), "cpu", "mtp", 3, turns, SAMPLED, lanes=3)
    assert 1.0 <= spec.tokens_per_round <= 4.0 and len(spec.per_position()) <= 3
    engine = make_engine(ckpt, "mtp", draft_tokens=3, lanes=3)
    greedy, outputs = measure(engine, ps, SamplingParams(max_tokens=10, temperature=0.0), "greedy")
    assert greedy.prompts == 3 and greedy.accepted <= greedy.drafted and len(outputs) == 3
    assert greedy.tokens == sum(map(len, outputs))


def test_tokens_per_round_leave_out_the_prefills_first_token(ckpt: Path) -> None:
    ps = prompts(3, VOCAB, seed=8, lo=5, hi=40)
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    off, outputs = measure(make_engine(ckpt, "off", lanes=3), ps, params, "greedy")
    assert [len(o) for o in outputs] == [9, 9, 9]
    assert off.rounds == 3 * 8 and off.tokens_per_round == 1.0  # 9 tokens: the prefill's first, then 8 rounds
    spec, spec_outputs = measure(make_engine(ckpt, "mtp", draft_tokens=3, lanes=3), ps, params, "greedy")
    assert spec_outputs == outputs
    assert spec.tokens_per_round == (spec.tokens - 3) / spec.rounds <= 1.0 + spec.accepted / spec.rounds


def test_more_prompts_than_the_queue_holds_are_fed_as_lanes_free(ckpt: Path) -> None:
    ps = prompts(8, VOCAB, seed=9, lo=5, hi=20)
    engine = make_engine(ckpt, "off", lanes=2, max_waiting=2)  # at most 4 queued at once
    tally, outputs = measure(engine, ps, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), "code")
    assert tally.prompts == 8 and [len(o) for o in outputs] == [3] * 8


def test_an_output_loops_when_its_last_64_tokens_repeat_a_shorter_period() -> None:
    rng = random.Random(0)
    fresh = [rng.randrange(1000) for _ in range(200)]
    cycle = [11, 12, 13, 14]  # "the fibonacci of the fibonacci of ..."
    assert loops([7] * 64)
    assert loops(fresh[:40] + cycle * 16)
    assert loops(fresh[:10] + (fresh[50:82]) * 3)  # period 32: shows twice in full in the window
    assert not loops(fresh)
    assert not loops([7] * 63)  # shorter than the window: never
    assert not loops(cycle * 30 + fresh[:3])  # a loop it escaped from
    assert not loops(fresh[:10] + fresh[100:133] * 2)  # period 33 fits less than twice in 64 tokens


def test_loop_rate_is_the_share_of_looping_outputs() -> None:
    t = Tally("dflash2", 7, "code")
    stats = RequestStats(rounds=10, drafted=70, accepted=30, position_drafted=[10] * 7, position_accepted=[8, 6, 5, 4,
                                                                                                          3, 2, 2])
    t.add(stats, [5] * 80)
    t.add(stats, list(range(41)))
    assert t.loop_rate == 0.5 and t.as_dict()["loop_rate"] == 0.5
    assert t.tokens_per_round == (80 + 41 - 2) / 20


def test_the_tool_reports_each_suite(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    code = tmp_path / "code.jsonl"
    code.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts(2, VOCAB, seed=3)))
    out = tmp_path / "r.json"
    assert main(["--model", str(ckpt), "--prompts", str(code), "--backend", "off", "--backend", "mtp:2",
                 "--max-tokens", "6", "--json", str(out), "--profile", "cpu"]) == 0
    rows = json.loads(out.read_text())
    assert [(r["backend"], r["suite"]) for r in rows] == [("off", "code"), ("mtp", "code")]
    assert rows[0]["tokens_per_round"] == 1.0 and "loop_rate" in rows[0]
    assert "loop_rate=" in capsys.readouterr().out


def test_sampled_suites_run_once_a_seed_and_report_the_mean(ckpt: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    import json

    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts(2, VOCAB, seed=4)))
    out = tmp_path / "r.json"
    assert main(["--model", str(ckpt), "--prompts", str(chat), "--mode", "sampled", "--backend", "mtp:2",
                 "--max-tokens", "12", "--seed", "5", "--seeds", "3", "--json", str(out), "--profile", "cpu"]) == 0
    rows = json.loads(out.read_text())
    assert [r["suite"] for r in rows] == ["chat@5", "chat@6", "chat@7"]
    per_seed = [r["tokens_per_round"] for r in rows]
    mean = sum(per_seed) / 3
    error = (sum((x - mean) ** 2 for x in per_seed) / 2) ** 0.5 / 3 ** 0.5
    assert (f"chat     mean of seeds 5-7: tokens/round={mean:.3f} +- {error:.3f} (standard error; seeds "
            f"{min(per_seed):.3f}-{max(per_seed):.3f})") in capsys.readouterr().out


def test_the_anatomy_of_a_verify_is_its_chance_kept_and_the_mass_q_misses() -> None:
    from ignis.engine.accept import Anatomy

    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.8, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.6, 0.4, 0.0, 0.0], [0.0, 0.5, 0.5, 0.0]])
    a = Anatomy()
    a.add(p, q, 2)  # both drafts drawn: the first was kept
    a.add(p, q, 1)  # the first rejected
    a.add(p, q, 0)  # nothing drawn (no drafts)
    first, second = a.rows()
    assert first == {"position": 1, "reached": 2, "kept": pytest.approx(0.8), "p_outside_q": pytest.approx(0.2),
                     "q_support": 2.0, "p_support": 3.0}
    assert second == {"position": 2, "reached": 1, "kept": pytest.approx(0.6), "p_outside_q": pytest.approx(0.1),
                      "q_support": 2.0, "p_support": 3.0}


def test_anatomy_reports_every_drafted_position_of_a_sampled_run(tmp_path: Path) -> None:
    """--anatomy on a sampled dflash2 run (its drafts are drawn from q): a row a draft position reached, fewer
    verifies reaching each next one, and position 1's mean chance kept near the run's own acceptance there (an
    expectation against a count)."""
    import json

    from tiny import tiny_pair

    model = tiny_pair(tmp_path / "pair", seed=9, vocab_size=VOCAB)
    lines = [json.dumps({"prompt_token_ids": p}) for p in prompts(4, VOCAB, seed=12, lo=5, hi=30)]
    (tmp_path / "p.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "acc.json"
    assert main(["--model", str(model), "--profile", "cpu", "--prompts", str(tmp_path / "p.jsonl"), "--mode",
                 "sampled", "--backend", "dflash2:7", "--max-tokens", "24", "--lanes", "2", "--anatomy", "--json",
                 str(out)]) == 0
    row, = json.loads(out.read_text())
    rows = row["anatomy"]
    assert [r["position"] for r in rows] == list(range(1, len(rows) + 1)) and 1 <= len(rows) <= 7
    assert all(0 <= r["kept"] <= 1 and 0 <= r["p_outside_q"] <= 1 - r["kept"] + 1e-6 for r in rows)
    assert all(a["reached"] >= b["reached"] for a, b in itertools.pairwise(rows))
    assert abs(rows[0]["kept"] - row["per_position"][0]) < 0.25
    expected = row["expected_kept"]  # both rules on the run's own verifies
    assert expected["verifies"] == rows[0]["reached"] and 0 <= expected["token"] <= 7 and 0 <= expected["block"] <= 7
