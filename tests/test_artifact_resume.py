"""The built-in target's training spread over sessions: a run stopped by Ctrl-C and run again ends with the weights of
one that never stopped, reads its tokens back instead of the corpus, and refuses to continue under other settings
(tools/artifact/train_target.py, resume.py; the toy shape on the CPU)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tools.artifact import train_target

TOY = ["--toy", "--batch", "4", "--seq-len", "128", "--time-budget", "600"]


def run(out: Path, *extra: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["train_target", "--out", str(out), *TOY, *extra])
    train_target.main()


def weights(out: Path) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for shard in sorted(out.glob("*.safetensors")):
        found.update(load_file(shard))
    return found


def test_an_interrupted_run_continues_to_the_weights_of_an_uninterrupted_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    run(whole, "--max-steps", "6", monkeypatch=monkeypatch)

    calls = 0
    real = train_target.losses

    def ctrl_c_in_step_3(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 4:  # the batch probe, then steps 1, 2 and 3
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args)

    with monkeypatch.context() as m:
        m.setattr(train_target, "losses", ctrl_c_in_step_3)
        run(parts, "--max-steps", "6", monkeypatch=monkeypatch)
    assert calls == 4  # it stopped at the end of step 3
    assert not (parts / "state.tmp").exists()
    log = (parts / "train.log").read_text()
    assert "interrupted at step 3" in log and "summary" not in log

    run(parts, "--max-steps", "6", monkeypatch=monkeypatch)
    log = (parts / "train.log").read_text()
    assert "continuing at step 3 of 6" in log and "tokens from" in log and '"steps": 6' in log
    a, b = weights(whole), weights(parts)
    assert a.keys() == b.keys() and len(a) > 10
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_a_run_continues_only_with_its_own_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"
    run(out, "--max-steps", "2", monkeypatch=monkeypatch)
    with pytest.raises(SystemExit, match="lr"):
        run(out, "--max-steps", "2", "--lr", "1e-3", monkeypatch=monkeypatch)
    with pytest.raises(SystemExit):  # the schedule's length must be given to continue it
        run(out, monkeypatch=monkeypatch)
