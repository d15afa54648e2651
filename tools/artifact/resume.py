"""What lets one target training run span several jobs (each a machine held for a limited time): the run's state
and its token streams on disk.

Owns: `settings` (what a continuation must share with the run it continues), the state file (weights in float32,
optimizer, data order, step counters; written atomically) and the token-stream file (so a continuation skips reading
and tokenizing the corpus). Does not own: the training loop (train_target.py) or the data (data.py).

A run continues when OUT/state.pt holds an unfinished run of a fixed `--max-steps` (the schedule's length, not fitted
to one job's budget): it loads the state, checks the settings, and takes the steps that are left. Any other
state (a finished run, or one fitted to its budget) is overwritten by a new run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

STATE = "state.pt"
STREAMS = "streams.npz"


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The arguments a continuation must repeat, and the tokenizer's hash: anything else would change the run."""
    tok = hashlib.sha256(Path(args.tokenizer).read_bytes()).hexdigest()
    keep = ("seq_len", "batch", "lr", "seed", "max_train_mb", "max_steps", "toy", "warmup", "unloop", "unloop_lambda")
    init = str(args.init) if args.init is not None else None
    return {"tokenizer_sha256": tok, "init": init, **{k: getattr(args, k) for k in keep}}


def data_settings(want: dict[str, Any]) -> dict[str, Any]:
    """The part of `settings` the token streams depend on."""
    return {k: want[k] for k in ("tokenizer_sha256", "max_train_mb", "seed", "toy")}


def check(have: dict[str, Any], want: dict[str, Any], what: str) -> None:
    diff = [f"{k} {have.get(k)!r} (now {v!r})" for k, v in want.items() if have.get(k) != v]
    if diff:
        raise SystemExit(f"{what} was made with other settings: {', '.join(diff)}; repeat them, or use another --out")


def save_state(path: Path, state: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # a run killed while writing leaves the last whole state


def load_state(path: Path) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=False)
    return state


def save_streams(path: Path, train: np.ndarray, held: np.ndarray, counts: dict[str, Any], want: dict[str, Any]) -> None:
    tmp = path.with_name(path.stem + ".tmp.npz")
    np.savez(tmp, train=train, held=held, meta=np.array(json.dumps({"settings": want, "counts": counts})))
    os.replace(tmp, path)


def load_streams(path: Path, want: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, dict[str, Any]] | None:
    """(train, held, counts) when `path` holds streams made with the same settings, else None."""
    if not path.is_file():
        return None
    with np.load(path) as f:
        meta = json.loads(str(f["meta"]))
        if meta["settings"] != want:
            return None
        return f["train"], f["held"], meta["counts"]
