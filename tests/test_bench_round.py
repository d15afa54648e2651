"""tools.bench_round's random shortlist head: a drafter with none on disk gets one the backend loads (the timing
itself needs a GPU: BENCHMARKS.md)."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny import TINY

from ignis.backends.dflash2.shortlist import ShortlistHead
from ignis.backends.dflash2.weights import SHORTLIST
from ignis.model.random import random_model
from tools.bench_round import random_shortlist


def test_a_random_shortlist_holds_the_heads_rows_of_distinct_sorted_ids(tmp_path: Path) -> None:
    model = random_model(TINY, seed=3, mtp=False, device="cpu", dtype=torch.float32)
    random_shortlist(model, tmp_path / "drafter", 40)
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    head = ShortlistHead(tmp_path / "drafter" / SHORTLIST, hidden=hidden, vocab=vocab, device=torch.device("cpu"),
                         dtype=torch.float32)
    ids = head.token_ids
    assert ids.shape == (40,) and torch.equal(ids, ids.unique()) and int(ids.max()) < vocab
    rows = (model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight).detach()[ids]
    # 4-bit codes, one scale a group (max |w| / 7, rounded to fp16): each weight within about half a step of its row
    steps = rows.reshape(40, -1, 32).abs().amax(-1, keepdim=True) / 7
    err = (head.weight - rows).reshape(40, -1, 32).abs()
    assert (err <= steps * 0.51 + 1e-6).all()
