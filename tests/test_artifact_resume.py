"""The built-in target's training spread over several jobs: a run stopped by Ctrl-C and run again ends with the
weights of one that never stopped, reads its tokens back instead of the corpus, and refuses to continue under other
settings (tools/artifact/train_target.py, resume.py; the toy shape on the CPU)."""

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


def interrupt_in_step(n: int, out: Path, *extra: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that Ctrl-C stops during step n: it ends once that step is done."""
    calls = 0
    real = train_target.losses

    def ctrl_c(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == n + 1:  # the batch probe, then the steps
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args)

    with monkeypatch.context() as m:
        m.setattr(train_target, "losses", ctrl_c)
        run(out, *extra, monkeypatch=monkeypatch)
    assert calls == n + 1


def test_an_interrupted_run_continues_to_the_weights_of_an_uninterrupted_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    run(whole, "--max-steps", "6", monkeypatch=monkeypatch)

    interrupt_in_step(3, parts, "--max-steps", "6", monkeypatch=monkeypatch)
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
    interrupt_in_step(1, out, "--max-steps", "3", monkeypatch=monkeypatch)
    with pytest.raises(SystemExit, match="lr"):
        run(out, "--max-steps", "3", "--lr", "1e-3", monkeypatch=monkeypatch)
    with pytest.raises(SystemExit):  # the schedule's length must be given to continue it
        run(out, monkeypatch=monkeypatch)
    run(out, "--max-steps", "3", monkeypatch=monkeypatch)
    run(out, "--max-steps", "2", "--lr", "1e-3", monkeypatch=monkeypatch)  # a finished run: the next starts over
    log = (out / "train.log").read_text()
    assert "continuing" not in log and '"steps": 2' in log
