"""Training against greedy loops (tools/artifact/unloop.py): the repetitive windows, the repetition penalty against
its formula, and train_target's fine-tune from a checkpoint (--init) with repetitive rows (--unloop), on the CPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.test_artifact_resume import run as _run
from tests.test_artifact_resume import weights as _weights
from tools.artifact import unloop

NL = 9  # the newline token of the windows below


def _newline(vocab: int = 16) -> np.ndarray:
    mask = np.zeros(vocab, dtype=bool)
    mask[NL] = True
    return mask


def test_a_repetitive_window_keeps_its_prefix_then_repeats_one_whole_line() -> None:
    gen = np.random.default_rng(0)
    w = 200
    rows = []
    for r in range(6):
        row = np.random.default_rng(r).integers(0, NL, w)
        row[np.arange(5 + r, w, 7 + r)] = NL  # lines of 7 + r tokens, the newline last
        rows.append(row)
    rows.append(np.arange(w) % NL)  # no newline: the fallback
    windows = torch.from_numpy(np.stack(rows))
    seq, start, length = unloop.repeated(windows, _newline(), gen)
    assert seq.shape == windows.shape and seq.dtype == windows.dtype
    for r in range(len(rows)):
        s, m = int(start[r]), int(length[r])
        assert torch.equal(seq[r, :s], windows[r, :s])
        line = windows[r, s : s + m]
        copies = (w - s) // m
        assert torch.equal(seq[r, s : s + copies * m], line.repeat(copies)) and copies >= 2
        if r < 6:
            assert s >= unloop.MIN_PREFIX and unloop.MIN_LINE <= m <= unloop.MAX_LINE
            assert line[-1] == NL and windows[r, s - 1] == NL and not (line[:-1] == NL).any()
        else:
            assert (s, m) == (unloop.MIN_PREFIX, unloop.MAX_LINE // 2)
    with pytest.raises(ValueError, match="too short to repeat a line"):
        unloop.repeated(windows[:, : unloop.MIN_PREFIX + unloop.MAX_LINE - 1], _newline(), gen)


def test_the_repetition_penalty_follows_its_formula_and_holds_the_earlier_copy_fixed() -> None:
    torch.manual_seed(0)
    b, t, v = 2, 12, 5
    seq = torch.randint(0, v, (b, t + 1))
    start, length = torch.tensor([2, 3]), torch.tensor([3, 4])
    for r in range(b):  # make the rows repeat from start on, as `repeated` does
        s, m = int(start[r]), int(length[r])
        seq[r, s:] = seq[r, s : s + m].repeat(t)[: t + 1 - s]
    logits = torch.randn(b, t, v, requires_grad=True)
    lam = 0.5
    out = unloop.repetition_losses(logits, seq, start, length, lam)

    p = torch.softmax(logits, -1).gather(-1, seq[:, 1:, None])[..., 0]
    ce, pen, n_first, n_later = 0.0, 0.0, 0, 0
    for r in range(b):
        s, m = int(start[r]), int(length[r])
        for j in range(t):  # prediction j is of token j + 1
            if j + 1 < s + m:
                ce, n_first = ce - torch.log(p[r, j]), n_first + 1
            else:
                pen = pen - torch.log(1 - (p[r, j] - lam * p[r, j - m].detach()).abs())
                n_later += 1
    torch.testing.assert_close(out["loss"], ce / n_first)
    torch.testing.assert_close(out["unloop"], pen / n_later)

    # the earlier copy is a target, not a path for the gradient: only positions of later copies get one
    grad = torch.autograd.grad(out["unloop"], logits)[0]
    for r in range(b):
        s, m = int(start[r]), int(length[r])
        assert torch.all(grad[r, : s + m - 1] == 0) and grad[r, s + m - 1 :].abs().sum() > 0


def test_a_fine_tune_starts_from_its_checkpoint_and_trains_against_repeating(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = tmp_path / "base"
    _run(base, "--max-steps", "3", monkeypatch=monkeypatch)
    # at a learning rate of 0 the fine-tune writes back the checkpoint it started from
    still = tmp_path / "still"
    _run(still, "--init", str(base), "--lr", "0", "--max-steps", "1", "--unloop", "0.5", monkeypatch=monkeypatch)
    before, after = _weights(base), _weights(still)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)

    tuned = tmp_path / "tuned"
    _run(tuned, "--init", str(base), "--max-steps", "2", "--warmup", "1", "--unloop", "0.5", monkeypatch=monkeypatch)
    log = (tuned / "train.log").read_text()
    assert "unloop: 2 of 4 rows a step repeat a line" in log and " repeat_p " in log
    assert any(not torch.equal(before[k], w) for k, w in _weights(tuned).items())

    # every row repetitive would leave no ordinary rows to train on
    with pytest.raises(SystemExit):
        _run(tmp_path / "all", "--unloop", "1", "--max-steps", "1", monkeypatch=monkeypatch)

    # a checkpoint of another shape is refused before any step
    from safetensors.torch import save_file

    wrong = tmp_path / "wrong"
    wrong.mkdir()
    save_file({"model.norm.weight": torch.ones(3, dtype=torch.bfloat16)}, str(wrong / "model.safetensors"))
    with pytest.raises(SystemExit, match="does not hold this model's weights"):
        _run(tmp_path / "refused", "--init", str(wrong), "--max-steps", "1", monkeypatch=monkeypatch)
