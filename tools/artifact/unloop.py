"""Training against greedy loops: pseudo-repetitive windows and the loss that makes each repetition less likely than
the one before (DITTO: Xu et al., "Learning to Break the Loop", NeurIPS 2022).

Owns: `newline_ids` (the tokens that end a line), `repeated` (a window cut after one of its lines, then that line
repeated to the window's end) and `repetition_losses` (cross-entropy up to the line's first copy, the repetition
penalty on every later copy). Does not own: the training loop that mixes these rows with ordinary ones
(train_target.py) or the model (model.py).

Why: a small model decoding greedily falls into a cycle ("if len(sizes) == 0: return False" again and again) because
each copy of a line makes the next copy more likely; the loss asks the probability of a token in copy n to be
lambda times its probability at the same place in copy n - 1, whose value is held fixed:
    -log(1 - |p_n(x) - lambda * p_{n-1}(x)|).
A line of code is the unit that repeats in the built-in model's loops, so lines are what these windows repeat.
"""

from __future__ import annotations

import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import Qwen3_5ForCausalLM

MIN_LINE = 4  # tokens in a repeated line, its newline included: shorter ones are mostly blank or a bracket
MAX_LINE = 48
MIN_PREFIX = 32  # tokens of the window kept before the repeated line, so that the line has a context
FLOOR = 1e-5  # the penalty's argument is kept above this, as 1 - |.| can reach 0


def newline_ids(tok: Tokenizer) -> np.ndarray:
    """bool [vocab]: whether a token's text holds a newline (byte-level BPE merges "\\n" with indentation)."""
    mask = np.zeros(tok.get_vocab_size(), dtype=bool)
    for i in range(mask.size):
        mask[i] = "\n" in tok.decode([i])
    return mask


def repeated(
    windows: torch.Tensor,  # [B, W] int64: ordinary training windows
    newline: np.ndarray,  # bool [vocab], `newline_ids`
    gen: np.random.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(seq [B, W] on windows' device, start [B], length [B] int64): each row is its window up to a line of MIN_LINE to
    MAX_LINE tokens starting at `start`, then that line again and again to the window's end. A window without such a
    line repeats its first MAX_LINE // 2 tokens after MIN_PREFIX."""
    host = windows.cpu().numpy()
    b, w = host.shape
    if w < MIN_PREFIX + MAX_LINE:
        raise ValueError(f"windows of {w} tokens are too short to repeat a line: at least {MIN_PREFIX + MAX_LINE}")
    seq = np.empty_like(host)
    starts = np.empty(b, dtype=np.int64)
    lengths = np.empty(b, dtype=np.int64)
    for r in range(b):
        ends = np.flatnonzero(newline[host[r]])  # index of each line's last token
        begin, size = ends[:-1] + 1, np.diff(ends)
        ok = (begin >= MIN_PREFIX) & (size >= MIN_LINE) & (size <= MAX_LINE) & (begin + 2 * size <= w)
        if ok.any():
            pick = gen.choice(np.flatnonzero(ok))
            s, m = int(begin[pick]), int(size[pick])
        else:
            s, m = MIN_PREFIX, MAX_LINE // 2
        line = host[r, s : s + m]
        seq[r, :s] = host[r, :s]
        seq[r, s:] = np.resize(line, w - s)
        starts[r], lengths[r] = s, m
    return torch.from_numpy(seq).to(windows.device), torch.from_numpy(starts), torch.from_numpy(lengths)


def repetition_losses(
    logits: torch.Tensor,  # [B, T, V]: the model's logits over seq[:, :T]
    seq: torch.Tensor,  # [B, T + 1] int64, from `repeated`
    start: torch.Tensor,  # [B] int64
    length: torch.Tensor,  # [B] int64
    lam: float,
) -> dict[str, torch.Tensor]:
    """{"loss": cross-entropy over the tokens up to the end of the line's first copy, "unloop": the repetition penalty
    averaged over the tokens of every later copy, "repeat_p": the mean probability the model gives those tokens}."""
    t = logits.shape[1]
    device = logits.device
    target = seq[:, 1 : t + 1]
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, target[..., None])[..., 0]  # [B, T]
    # prediction j is of token j + 1; token i is a later copy when i >= start + length
    token = torch.arange(1, t + 1, device=device)[None, :]
    s, m = start.to(device)[:, None], length.to(device)[:, None]
    later = token >= s + m
    first = ~later
    p = logp.exp()
    prev = p.gather(1, (torch.arange(t, device=device)[None, :] - m).clamp(min=0)).detach()  # same place, copy n - 1
    penalty = -torch.log((1 - (p - lam * prev).abs()).clamp(min=FLOOR))
    ce = -(logp * first).sum() / first.sum().clamp(min=1)
    unloop = (penalty * later).sum() / later.sum().clamp(min=1)
    with torch.no_grad():
        repeat_p = (p * later).sum() / later.sum().clamp(min=1)
    return {"loss": ce, "unloop": unloop, "repeat_p": repeat_p}


def forward_logits(net: Qwen3_5ForCausalLM, seq: torch.Tensor) -> torch.Tensor:  # [B, T, V]
    """The target's logits over seq[:, :-1]."""
    hidden = net.model(input_ids=seq[:, :-1], use_cache=False).last_hidden_state
    logits: torch.Tensor = net.lm_head(hidden)
    return logits
