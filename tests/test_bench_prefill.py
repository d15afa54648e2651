"""tools/bench_prefill runs end to end on the CPU (the same code as on a GPU, without graphs) and reports each
length's device and host prefill."""

from __future__ import annotations

import json
from pathlib import Path

from ignis.backends.dflash2.weights import save_random_drafter
from ignis.model.config import ModelConfig
from tiny import tiny_checkpoint
from tools import bench_prefill


def test_bench_prefill_reports_device_and_host_prefill(tmp_path: Path) -> None:
    ckpt = tiny_checkpoint(tmp_path / "ckpt", seed=2, vocab_size=2048)
    save_random_drafter(ckpt / "drafter", ModelConfig.from_dir(ckpt), block_size=8, seed=1, sliding_window=64)
    out = tmp_path / "prefill.json"
    assert bench_prefill.main(["--models", "builtin", "--model-path", str(ckpt), "--device", "cpu", "--lengths",
                               "5,70", "--iters", "1", "--context", "256", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    # 70 = 64 + 4 + 2; the drafter's sliding layers keep 63 rows, so its pieces stop at 32: 32 + 32 + 4 + 2
    assert [(r["backend"], r["tokens"], r["pieces"]) for r in rows] == [("off", 5, 2), ("off", 70, 3),
                                                                       ("dflash2", 5, 2), ("dflash2", 70, 4)]
    assert all(r["device_ms"] > 0 and r["host_ms"] > 0 for r in rows)
