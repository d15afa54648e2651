"""`ignis train-drafter` on a random Qwen3.5 checkpoint of another shape: the drafter it writes loads with dflash2
and keeps greedy output equal to off, an interrupted run resumes to the same weights, and bad input is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from engines import run
from ignis.artifact import BUILTIN
from ignis.cli import main
from ignis.config import load_config
from ignis.engine.core import Engine
from ignis.errors import InputError
from ignis.params import SamplingParams
from ignis.train.loop import Loop
from tiny import single_thread, tiny_checkpoint, tiny_config  # noqa: F401 - single_thread is a fixture

# Not the built-in shape (8 layers of 384, tied head) nor tests' TINY: 6 layers of 96, 3 query heads on one K/V
# head, an untied output head, and the built-in tokenizer so text and chat prompts work.
SHAPE: dict[str, Any] = {"vocab_size": 8192, "hidden_size": 96, "num_hidden_layers": 6, "intermediate_size": 160,
                         "num_attention_heads": 3, "num_key_value_heads": 1, "eos_token_id": [2, 0]}
SMALL = ["--window", "24", "--gen-tokens", "12", "--eval-tokens", "12", "--layers", "2", "--intermediate-size", "64",
         "--selector-rank", "8", "--selector-top-k", "4", "--batch", "4", "--anchors", "4", "--warmup", "2",
         "--set", "engine.lanes=4"]


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("target")
    tiny_checkpoint(path, seed=5, mtp=False, **SHAPE)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUILTIN / name, path / name)
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A text file, a chat JSONL (its old assistant answers are dropped) and a prompts JSONL."""
    path = tmp_path_factory.mktemp("data")
    shutil.copy(Path(__file__).parent.parent / "ignis" / "acceptance.py", path / "code.py")
    chats = [{"messages": [{"role": "user", "content": f"Write function number {i}."},
                           {"role": "assistant", "content": "an answer from another model"}]} for i in range(6)]
    (path / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    (path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"def f{i}(x):"}) + "\n" for i in range(6)))
    return path


pytestmark = pytest.mark.usefixtures("restore_logging")  # tests/conftest.py


def _engine(target: Path, backend: str = "off", **spec: Any) -> Engine:
    overrides = {"model.path": str(target), "spec.backend": backend, "log.level": "warning", "engine.lanes": 3,
                 **{f"spec.{k}": v for k, v in spec.items()}}
    return Engine(load_config(profile="cpu", overrides=overrides))


def test_trained_drafter_loads_and_keeps_greedy_output_equal_to_off(target: Path, data: Path, tmp_path: Path,
                                                                     single_thread: None) -> None:
    out = tmp_path / "drafter"
    rc = main(["train-drafter", str(target), "--data", str(data), "--out", str(out), "--steps", "3",
               "--held-out", "2", "--shortlist", "300", *SMALL])
    assert rc == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["block_size"] == 8
    assert config["dflash_config"]["target_layer_ids"] == [1, 2, 3]  # spread over the 6 layers as the reference does
    assert config["hidden_size"] == 96 and config["num_hidden_layers"] == 2
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["steps"] == 3 and summary["greedy_equal_to_off"] == "2/2" and summary["draft_tokens"] == 7
    assert summary["greedy_tokens_per_round"] >= 1.0 and summary["sequences"] > 10
    log = (out / "run" / "train.log").read_text()  # distillation is on by default: layer 5 is tapped for the teacher
    assert "the teacher reads the target's last layer (5, tapped for it alone)" in log and " soft_unary " in log

    prompts = [[1, 882, 198, 9, 44, 71], [100, 200, 300], list(range(10, 40))]
    greedy = SamplingParams(max_tokens=20, temperature=0.0)
    want = {i: d.token_ids for i, d in run(_engine(target), prompts, greedy).items()}
    for head in ("full", "shortlist"):
        spec = _engine(target, "dflash2", draft_tokens=7, drafter=str(out), draft_head=head)
        got = run(spec, prompts, greedy)
        assert {i: d.token_ids for i, d in got.items()} == want, head
        assert all(d.stats is not None and d.stats.drafted > 0 for d in got.values())


def test_an_interrupted_run_resumes_to_the_weights_of_an_uninterrupted_one(
        target: Path, data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, single_thread: None) -> None:
    args = ["--data", str(data), "--steps", "6", "--held-out", "0", "--checkpoint-every", "0", *SMALL]
    assert main(["train-drafter", str(target), "--out", str(tmp_path / "whole"), *args]) == 0

    out = tmp_path / "cut"
    step = Loop.step

    def stop_after(n: int, error: BaseException) -> None:
        def cut(self: Loop, progress: float) -> dict[str, float]:
            seen = step(self, progress)
            if self.counters.step == n:
                raise error
            return seen

        monkeypatch.setattr(Loop, "step", cut)

    stop_after(2, KeyboardInterrupt())  # Ctrl-C: the checkpoint holds step 2
    assert main(["train-drafter", str(target), "--out", str(out), *args]) == 130
    data_files = {f: f.stat().st_mtime_ns for f in (out / "run" / "data").iterdir()}
    stop_after(4, RuntimeError("power cut"))  # a crash before step 4's checkpoint: the last one holds step 3
    with pytest.raises(RuntimeError, match="power cut"):  # --debug: the crash itself, not its one-line report
        main(["train-drafter", str(target), "--out", str(out), *args, "--debug"])
    monkeypatch.setattr(Loop, "step", step)
    assert main(["train-drafter", str(target), "--out", str(out), *args]) == 0

    log = (out / "run" / "train.log").read_text()
    assert "resumed at step 2" in log and "resumed at step 3" in log
    assert {f: f.stat().st_mtime_ns for f in (out / "run" / "data").iterdir()} == data_files  # not generated again
    whole = torch.load(tmp_path / "whole" / "run" / "checkpoint.pt", weights_only=True)
    cut = torch.load(out / "run" / "checkpoint.pt", weights_only=True)
    assert cut["counters"]["step"] == whole["counters"]["step"] == 6
    for name, tensor in whole["drafter"].items():
        assert torch.equal(cut["drafter"][name], tensor), name

    changed = main(["train-drafter", str(target), "--out", str(out), *args, "--lr", "1e-3"])
    assert changed == 2  # another recipe in the same directory is refused, not silently mixed

    settings = out / "run" / "settings.json"
    old = {k: v for k, v in json.loads(settings.read_text()).items() if k != "distill"}
    settings.write_text(json.dumps(old))  # a run from before --distill, which trained on hard labels only
    assert main(["train-drafter", str(target), "--out", str(out), *args]) == 2
    assert main(["train-drafter", str(target), "--out", str(out), *args, "--distill", "0"]) == 0


@pytest.mark.usefixtures("single_thread")
def test_the_teacher_shares_the_drafters_tap_of_the_last_layer(target: Path, data: Path, tmp_path: Path) -> None:
    out = tmp_path / "shared"
    assert main(["train-drafter", str(target), "--data", str(data), "--out", str(out), "--steps", "2", "--taps", "2,5",
                 "--held-out", "0", "--distill", "0", "--distill-tv", "0.5", "--tv-cut", "20,0.95", *SMALL]) == 0
    log = (out / "run" / "train.log").read_text()  # the total variation alone needs the teacher too
    assert ("distill: weight 0.0, total variation 0.5 under top-k 20 and top-p 0.95, the teacher reads the target's "
            "last layer (5)") in log
    assert " tv_unary " in log and " tv_selector " in log and " soft_selector " not in log
    assert json.loads((out / "config.json").read_text())["dflash_config"]["target_layer_ids"] == [2, 5]


def test_a_time_budget_ends_the_run(target: Path, data: Path, tmp_path: Path, single_thread: None) -> None:
    out = tmp_path / "timed"
    # 8 s in all: what generation took is spent, and the evaluation's reserve (20 s at least) leaves the 1 s minimum.
    assert main(["train-drafter", str(target), "--data", str(data), "--out", str(out), "--time-budget", "8s",
                 "--held-out", "0", *SMALL]) == 0
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["steps"] >= 1 and 1.0 <= summary["train_seconds"] < 3.0


@pytest.mark.parametrize(("extra", "needle"), [
    (["--steps", "0"], "--time-budget: give a budget"),
    (["--steps", "2", "--time-budget", "soon"], "--time-budget: expected seconds"),
    (["--steps", "2", "--block-size", "1"], "--block-size"),
    (["--steps", "2", "--taps", "1,99"], "target_layer_ids"),
    (["--steps", "2", "--mask-token-id", "9000"], "--mask-token-id"),
    (["--steps", "2", "--distill", "-1"], "--distill"),
    (["--steps", "2", "--distill-tv", "-0.5"], "--distill-tv"),
    (["--steps", "2", "--distill-tv", "1", "--tv-cut", "20"], "--tv-cut: expected TOP_K,TOP_P"),
    (["--steps", "2", "--distill-tv", "1", "--tv-cut", "20,1.5"], "--tv-cut: expected TOP_K,TOP_P"),
    (["--steps", "2", "--tv-cut", "20,0.95"], "--tv-cut: cuts the total-variation terms"),
    (["--steps", "2", "--grow-layers", "1"], "--grow-layers: grows the drafter --init names"),
    (["--steps", "2", "--grow-layers", "-1"], "--grow-layers: must be 0 or more"),
])
def test_bad_settings_exit_2_naming_the_flag(target: Path, data: Path, tmp_path: Path, extra: list[str], needle: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["train-drafter", str(target), "--data", str(data), "--out", str(tmp_path / "d"), *extra])
    assert rc == 2
    assert needle in capsys.readouterr().err


def test_bad_data_is_refused_with_the_file_and_line(target: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"messages": "not a list"}\n')
    rc = main(["train-drafter", str(target), "--data", str(bad), "--out", str(tmp_path / "d"), "--steps", "1"])
    assert rc == 2
    assert f"{bad}:2: messages must be a list" in capsys.readouterr().err
    assert not (tmp_path / "d" / "run" / "settings.json").exists()  # a corrected rerun is not refused as "other settings"


def test_prompts_from_text_chat_and_prompt_files(data: Path) -> None:
    from ignis.tokenizer import Tokenizer
    from ignis.train.prompts import read_prompts, split

    tok = Tokenizer.from_dir(BUILTIN)
    got = read_prompts([data], tok, window=24, stride=12, vocab=8192)
    chats = [p for p in got if "chat.jsonl" in p.source]
    assert len(chats) == 6
    text = tok.decode(list(chats[0].ids), skip_special_tokens=False)
    assert "Write function number 0." in text and "another model" not in text  # the old answer is dropped
    assert text.endswith("<|im_start|>assistant\n")  # the target writes the answer
    code = [p for p in got if "code.py" in p.source]
    ids = tok.encode((data / "code.py").read_text())
    assert [p.ids for p in code] == [tuple(ids[i : i + 24]) for i in range(0, len(ids) - 12, 36)]
    assert sum("prompts.jsonl" in p.source for p in got) == 6
    train, held = split(got, 4, seed=0)
    assert len(held) == 4 and len(train) == len(got) - 4 and not set(held) & set(train)
    with pytest.raises(InputError, match="outside the model's vocabulary"):
        read_prompts([data], tok, window=24, stride=12, vocab=100)


def test_generation_stops_at_its_deadline_but_not_before_a_first_completion(target: Path, tmp_path: Path) -> None:
    from ignis.train.generate import generate
    from ignis.train.prompts import Prompt

    engine = _engine(target)  # 3 lanes
    prompts = [Prompt((1, 2, 3 + i), f"p{i}") for i in range(10)]
    data = generate(engine, prompts, 4, 0, tmp_path / "data", deadline=0.0)  # long past
    assert 1 <= len(data) <= 3 and 0 < data.completion_tokens <= 4 * len(data)
    again = generate(engine, prompts, 4, 0, tmp_path / "data", deadline=float("inf"))
    assert len(again) == len(data)  # the cut is final: a resumed run reads the same data


def test_generation_gets_its_share_of_what_start_up_left() -> None:
    from ignis.train.run import generation_deadline

    # 465 s, 0.35: a 10 s start leaves 455 s, 159.25 of them to generate; a 130 s start (kernels compiled on a
    # fresh GPU) 117.25, not the 33 that a share of the whole budget left it
    assert generation_deadline(100.0, 110.0, 465.0, 0.35) == pytest.approx(110.0 + 0.35 * 455.0)
    assert generation_deadline(100.0, 230.0, 465.0, 0.35) == pytest.approx(230.0 + 0.35 * 335.0)
    assert generation_deadline(100.0, 700.0, 465.0, 0.35) == 700.0  # start-up took it all: the first completions only
    assert generation_deadline(100.0, 110.0, 0.0, 0.35) == float("inf")  # steps or tokens, no clock


def test_generation_streams_across_shards_and_its_data_do_not_depend_on_them(
        target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    from ignis.train import generate as gen
    from ignis.train.prompts import Prompt

    prompts = [Prompt((1, 2, 3 + i, 4 + i % 3), f"p{i}") for i in range(10)]
    whole = gen.generate(_engine(target), prompts, 6, 0, tmp_path / "whole", deadline=float("inf"))
    monkeypatch.setattr(gen, "SHARD", 4)
    engine = _engine(target)  # 3 lanes
    mixed = []  # rounds whose lanes hold prompts of two shards: the next shard's prompts did not wait for the last one
    step = engine.step

    def watched() -> list:
        mixed.append(len({int(r.id) // 4 for r in engine.scheduler.running}) > 1)
        return step()

    monkeypatch.setattr(engine, "step", watched)
    split = gen.generate(engine, prompts, 6, 0, tmp_path / "split", deadline=float("inf"))
    assert any(mixed)
    assert sorted(p.name for p in (tmp_path / "split").glob("part-*.npz")) == [f"part-0000{s}.npz" for s in range(3)]
    for name in ("tokens", "starts", "prompt_lengths", "greedy"):
        assert np.array_equal(getattr(split, name), getattr(whole, name)), name


def test_init_starts_from_a_drafters_weights_and_shape(target: Path, data: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from ignis.backends.dflash2.weights import save_random_drafter
    from ignis.model.config import ModelConfig

    start = save_random_drafter(tmp_path / "start", ModelConfig.from_dir(target), num_layers=1, taps=2,
                                intermediate_size=64, selector_rank=8, selector_top_k=4, sliding_window=64)
    out = tmp_path / "tuned"
    args = ["train-drafter", str(target), "--data", str(data), "--out", str(out), "--init", str(start), "--steps", "1",
            "--lr", "1e-12", "--warmup", "1", "--held-out", "0", *SMALL]
    assert main(args) == 0
    config = json.loads((out / "config.json").read_text())
    assert config == json.loads((start / "config.json").read_text())  # its shape, not the flags' (2 layers)
    before, after = load_file(str(start / "model.safetensors")), load_file(str(out / "model.safetensors"))
    for name, tensor in before.items():
        torch.testing.assert_close(after[name].float(), tensor, rtol=1e-2, atol=1e-2)

    grown = tmp_path / "grown"
    assert main([*args[:5], str(grown), *args[6:], "--grow-layers", "1"]) == 0
    config = json.loads((grown / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and len(config["layer_types"]) == 2  # the start's one, and one more
    after = load_file(str(grown / "model.safetensors"))
    for name, tensor in before.items():  # the start's layer and everything around it carried over
        torch.testing.assert_close(after[name].float(), tensor, rtol=1e-2, atol=1e-2)
    assert float(after["layers.1.self_attn.o_proj.weight"].float().abs().max()) < 1e-6  # the new layer adds nothing

    other = save_random_drafter(tmp_path / "other", ModelConfig.from_dict(tiny_config(**{**SHAPE, "hidden_size": 64}, model_type="qwen3_5_text")))
    assert main([*args[:7], str(other), *args[8:], "--restart"]) == 2  # built for another target: refused


def test_a_drafter_trained_with_slot_one_given_serves_behind_the_mtp_layer(data: Path, tmp_path: Path,
                                                                           single_thread: None) -> None:
    """--first-draft mtp: the block trains with slot 1's true token in place of its mask, the config says so, and
    the drafter serves with the target's MTP layer drafting slot 1, greedy output equal to off."""
    target = tmp_path / "target"
    tiny_checkpoint(target, seed=5, mtp=True, **SHAPE)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUILTIN / name, target / name)
    out = tmp_path / "drafter"
    rc = main(["train-drafter", str(target), "--data", str(data), "--out", str(out), "--steps", "3",
               "--held-out", "2", "--first-draft", "mtp", *SMALL])
    assert rc == 0
    assert json.loads((out / "config.json").read_text())["dflash_config"]["first_draft"] == "mtp"
    assert json.loads((out / "train_summary.json").read_text())["greedy_equal_to_off"] == "2/2"
    prompts = [[1, 882, 198, 9, 44, 71], list(range(10, 40))]
    greedy = SamplingParams(max_tokens=20, temperature=0.0)
    want = {i: d.token_ids for i, d in run(_engine(target), prompts, greedy).items()}
    got = run(_engine(target, "dflash2", draft_tokens=7, drafter=str(out)), prompts, greedy)
    assert {i: d.token_ids for i, d in got.items()} == want
    # fine-tuning it keeps its form unless the flag says otherwise
    for flag, form in (([], "mtp"), (["--first-draft", "drafter"], None), (["--first-draft", "mtp"], "mtp")):
        tuned = tmp_path / f"tuned-{form}-{len(flag)}"
        assert main(["train-drafter", str(target), "--data", str(data), "--out", str(tuned), "--steps", "1",
                     "--held-out", "2", "--init", str(out), *flag, *SMALL]) == 0
        assert (json.loads((tuned / "config.json").read_text())["dflash_config"].get("first_draft") or None) == form
    # a target without an MTP layer cannot serve one: refused before anything loads beyond the config
    bare = tmp_path / "bare"
    tiny_checkpoint(bare, seed=5, mtp=False, **SHAPE)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUILTIN / name, bare / name)
    assert main(["train-drafter", str(bare), "--data", str(data), "--out", str(tmp_path / "no"), "--steps", "1",
                 "--first-draft", "mtp", *SMALL]) != 0
