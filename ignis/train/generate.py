"""On-policy data: the target completes the training prompts itself, through ignis's own engine, and the results
are kept on disk in shards so an interrupted run loses only the shards it had not finished.

Owns: `Sequences` (prompt + completion token ids, completion lengths, which were greedy; padded batches for
training), the decoding modes, generating into shards under a deadline, and reading the shards back. Does not own:
the prompts (ignis.train.prompts) or the engine (ignis.engine.core).

Requests stream through the engine across shard boundaries (a window of lanes + max_waiting / 2 in flight), so a
lane that finishes takes the next prompt at once; a shard is written as soon as its last prompt has finished. Waiting
for a whole shard before starting the next left the lanes emptying one by one at every shard's end and then refilling
all at once: at 512 lanes (one shard's worth), 1.2 to 2 times the rounds for the same tokens, the more so the earlier
completions end.

The completions are the text the drafter will be asked to predict: decoded as serving decodes, greedy and sampled
in turns (request i takes MODES[i % 4]), each request seeded by its index so the data do not depend on how requests
share lanes. A completion ends at the model's end-of-sequence token (kept: the drafter learns to predict it) or at
`max_tokens`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ignis.engine.core import Engine
from ignis.ipc.messages import EngineRequest
from ignis.params import SamplingParams
from ignis.train.progress import Progress
from ignis.train.prompts import Prompt

# Greedy is the headline; the agent setting (T=1.0, top_p 0.95, top_k 20) is what sampled serving sees.
MODES = (
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0, top_p=0.95, top_k=20),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, top_p=0.95, top_k=20),
)
SHARD = 512  # prompts per shard on disk
DONE = "done"  # marker: generation finished (all prompts, or the deadline); its text is the prompt count used


@dataclass
class Sequences:
    tokens: np.ndarray  # [total] int32: every sequence's prompt then completion, back to back
    starts: np.ndarray  # [n + 1] int64: sequence i is tokens[starts[i] : starts[i + 1]]
    prompt_lengths: np.ndarray  # [n] int64
    greedy: np.ndarray  # [n] bool: decoded at temperature 0

    def __len__(self) -> int:
        return len(self.prompt_lengths)

    @property
    def completion_tokens(self) -> int:
        return int((np.diff(self.starts) - self.prompt_lengths).sum())

    def lengths(self) -> np.ndarray:
        return np.diff(self.starts)

    def batch(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [b, S] int64 (right-padded with 0) and mask [b, S] bool (completion tokens), S the longest row."""
        lengths = [int(self.starts[r + 1] - self.starts[r]) for r in rows]
        seq = max(lengths)
        tokens = torch.zeros((len(rows), seq), dtype=torch.int64)
        mask = torch.zeros((len(rows), seq), dtype=torch.bool)
        for i, (r, n) in enumerate(zip(rows, lengths)):
            tokens[i, :n] = torch.from_numpy(self.tokens[self.starts[r] : self.starts[r + 1]].astype(np.int64))
            mask[i, int(self.prompt_lengths[r]) : n] = True
        return tokens, mask

    def counts(self, vocab: int) -> np.ndarray:
        """[vocab] int64: how often each token occurs in the completions (for the shortlist head)."""
        keep = np.concatenate([self.tokens[self.starts[i] + self.prompt_lengths[i] : self.starts[i + 1]]
                               for i in range(len(self))]) if len(self) else np.zeros(0, dtype=np.int32)
        return np.bincount(keep.astype(np.int64), minlength=vocab)[:vocab]


def generate(engine: Engine, prompts: list[Prompt], max_tokens: int, seed: int, folder: Path,
             deadline: float) -> Sequences:
    """Complete `prompts` into shards of SHARD prompts in `folder`, skipping shards already there, until all are done
    or time.monotonic() passes `deadline` (then each shard in progress keeps what finished; the deadline never ends a
    run before its first completion). Returns every shard's data."""
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / DONE
    if not marker.is_file():
        shards = (len(prompts) + SHARD - 1) // SHARD
        todo = [s for s in range(shards) if not (folder / _name(s)).is_file()]
        have = shards - len(todo)
        bar = Progress("generate", (len(prompts) - have * SHARD) * max_tokens, "tokens")
        if todo and not (time.monotonic() > deadline and have):
            _stream(engine, prompts, todo, max_tokens, seed, folder, deadline, bar, have > 0)
        bar.close()
        marker.write_text(str(len(prompts)))
    return load(folder)


def load(folder: Path) -> Sequences:
    parts = [np.load(f) for f in sorted(folder.glob("part-*.npz"))]
    if not parts:
        return Sequences(np.zeros(0, np.int32), np.zeros(1, np.int64), np.zeros(0, np.int64), np.zeros(0, bool))
    lengths = np.concatenate([p["lengths"] for p in parts])
    return Sequences(
        tokens=np.concatenate([p["tokens"] for p in parts]),
        starts=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        prompt_lengths=np.concatenate([p["prompt_lengths"] for p in parts]).astype(np.int64),
        greedy=np.concatenate([p["greedy"] for p in parts]).astype(bool),
    )


def _stream(engine: Engine, prompts: list[Prompt], todo: list[int], max_tokens: int, seed: int, folder: Path,
            deadline: float, bar: Progress, have_data: bool) -> None:
    """Run the prompts of shards `todo` through the engine, a window of requests in flight, writing each shard when
    its last prompt finishes; past `deadline` (once anything finished), abort what is in flight and write what each
    started shard finished."""
    order = [i for s in todo for i in range(s * SHARD, min((s + 1) * SHARD, len(prompts)))]
    window = engine.info.lanes + max(1, engine.config.engine.max_waiting // 2)  # requests in flight at once
    stop = list(engine.info.eos_token_ids)
    left = {s: min((s + 1) * SHARD, len(prompts)) - s * SHARD for s in todo}  # prompts of each shard not finished
    out: dict[int, dict[int, list[int]]] = {s: {} for s in todo}  # shard -> prompt index -> completion
    tokens: dict[str, list[int]] = {}
    flight: set[int] = set()
    queued = made = finished = 0
    while left:
        if time.monotonic() > deadline and (finished or have_data):
            engine.abort([str(i) for i in sorted(flight)])
            for s, done in out.items():
                if done:
                    _save(folder / _name(s), _part(prompts, done))
            return
        while queued < len(order) and len(flight) < window:
            i = order[queued]
            mode = MODES[i % len(MODES)]
            params = SamplingParams(max_tokens=max_tokens, temperature=mode.temperature, top_p=mode.top_p,
                                    top_k=mode.top_k, seed=seed * 1_000_003 + i)
            engine.add(EngineRequest(id=str(i), prompt_token_ids=list(prompts[i].ids), params=params,
                                     stop_token_ids=stop))
            flight.add(i)
            queued += 1
        for d in engine.step():
            tokens.setdefault(d.id, []).extend(d.token_ids)
            made += len(d.token_ids)
            if d.finished:
                i, s = int(d.id), int(d.id) // SHARD
                out[s][i] = tokens.pop(d.id)
                flight.discard(i)
                finished += 1
                left[s] -= 1
                if not left[s]:
                    _save(folder / _name(s), _part(prompts, out.pop(s)))
                    del left[s]
        bar.update(made)


def _part(prompts: list[Prompt], done: dict[int, list[int]]) -> dict[str, np.ndarray]:
    """One shard's arrays: its finished prompts in index order, each prompt followed by its completion."""
    order = sorted(done)
    seqs = [list(prompts[i].ids) + done[i] for i in order]
    return {
        "tokens": np.asarray([t for q in seqs for t in q], dtype=np.int32),
        "lengths": np.asarray([len(q) for q in seqs], dtype=np.int64),
        "prompt_lengths": np.asarray([len(prompts[i].ids) for i in order], dtype=np.int64),
        "greedy": np.asarray([MODES[i % len(MODES)].temperature == 0.0 for i in order], dtype=bool),
    }


def _save(path: Path, part: dict[str, np.ndarray]) -> None:
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **part)  # type: ignore[arg-type]
    os.replace(tmp, path)


def _name(s: int) -> str:
    return f"part-{s:05d}.npz"
