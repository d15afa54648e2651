"""The training loop: steps of the block recipe under a budget, with checkpoints that a later run resumes from.

Owns: `Budget` (steps, training tokens or seconds, whichever ends first), the learning-rate schedule (linear warmup,
cosine to a tenth over the budget), one optimizer step split into micro-batches, and the checkpoint (drafter,
optimizer, generator state and counters, written atomically). Does not own: the losses (ignis.train.recipe), where
tap features come from (ignis.train.taps, or a cache) or the run around it (ignis.train.run).

Every random draw (which sequences, which anchors) comes from one generator whose state is in the checkpoint, and
anchors are drawn for the whole batch before it is split, so a resumed run takes the same steps as one that was
never interrupted, and the micro-batch size changes nothing but memory.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ignis.backends.dflash2.model import DrafterModel
from ignis.train.generate import Sequences
from ignis.train.progress import Progress
from ignis.train.recipe import Teacher, anchors_for, losses, slot_weights

# (rows, tokens [b, S], lengths) -> (the drafter's taps [b, S, F], the target's last layer's outputs [b, S, H] or None)
Features = Callable[[list[int], torch.Tensor, list[int]], tuple[torch.Tensor, torch.Tensor | None]]


@dataclass(frozen=True)
class Budget:
    steps: int = 0  # 0: no limit
    tokens: int = 0  # completion tokens of the sequences steps read; 0: no limit
    seconds: float = 0.0  # training wall time; 0: no limit

    def progress(self, step: int, tokens: int, seconds: float) -> float:
        """How much of the budget is spent, 0..1 (the largest share of any limit)."""
        parts = [step / self.steps if self.steps else 0.0, tokens / self.tokens if self.tokens else 0.0,
                 seconds / self.seconds if self.seconds > 0 else 0.0]
        return min(1.0, max(parts))


@dataclass(frozen=True)
class Recipe:
    batch: int  # sequences per step
    anchors: int  # blocks per sequence
    lr: float
    warmup: int  # steps
    gamma: float
    seed: int
    distill: float = 0.0  # weight of the soft (distillation) terms; 0: hard labels only
    distill_tv: float = 0.0  # weight of the total-variation terms (recipe.Teacher.tv)
    tv_cut: tuple[int, float] | None = None  # the (top_k, top_p) they are measured under (recipe.Teacher.cut)

    @property
    def teacher(self) -> bool:
        """Whether a step needs the target's own distribution."""
        return self.distill > 0 or self.distill_tv > 0

    def lr_at(self, step: int, progress: float) -> float:
        return self.lr * min(1.0, (step + 1) / self.warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


@dataclass
class Counters:
    step: int = 0
    tokens: int = 0
    seconds: float = 0.0


class Loop:
    def __init__(self, drafter: DrafterModel, embed: torch.Tensor, head: torch.Tensor, features: Features,
                 data: Sequences, rows: list[int], recipe: Recipe, device: torch.device,
                 final_norm: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.drafter = drafter
        self.embed = embed  # [V, H] the target's input embedding
        self.head = head  # [V, H] the target's output head
        self.final_norm = final_norm  # the target's final norm: the teacher's, when recipe.teacher
        self.features = features
        self.data = data
        self.rows = torch.tensor(rows, dtype=torch.long)  # training sequences
        self.recipe = recipe
        self.device = device
        self.opt = torch.optim.AdamW(drafter.parameters(), lr=recipe.lr, betas=(0.9, 0.95), weight_decay=0.01)
        self.gen = torch.Generator().manual_seed(recipe.seed)
        self.counters = Counters()
        self.micro = recipe.batch
        self.last: dict[str, float] = {}  # the latest step's losses and counts

    def optimizer_bytes(self) -> int:
        return 2 * sum(p.numel() * 4 for p in self.drafter.parameters())

    def probe(self, n: int) -> None:
        """Forward + backward over the n longest training sequences; gradients dropped (for memory sizing)."""
        longest = sorted(self.rows.tolist(), key=lambda r: -int(self.data.starts[r + 1] - self.data.starts[r]))[:n]
        tokens, mask = self.data.batch(longest)
        anchors = anchors_for(mask, self.recipe.anchors, torch.Generator().manual_seed(0))
        self._backward(longest, tokens, mask, anchors, None)
        self.opt.zero_grad(set_to_none=True)

    def step(self, progress: float) -> dict[str, float]:
        r = self.recipe
        picks = self.rows[torch.randint(len(self.rows), (r.batch,), generator=self.gen)].tolist()
        tokens, mask = self.data.batch(picks)
        anchors = anchors_for(mask, r.anchors, self.gen)
        lr = r.lr_at(self.counters.step, progress)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.zero_grad(set_to_none=True)
        norm = slot_weights(mask, anchors, self.drafter.config.width, r.gamma).sum().to(self.device)
        sums: dict[str, float] = {}
        for lo in range(0, r.batch, self.micro):
            part = slice(lo, lo + self.micro)
            seen = self._backward(picks[part], tokens[part], mask[part], anchors[part], norm)
            for key, v in seen.items():  # the parts' losses are shares of the whole's, and counts add up
                sums[key] = sums.get(key, 0.0) + v
        norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), 1.0)
        self.opt.step()
        self.counters.step += 1
        self.counters.tokens += int(mask.sum())
        sums.update(lr=lr, gnorm=float(norm), tau=1.0 + sums["accepted_selector"] / max(sums["blocks"], 1.0))
        return sums

    def _backward(self, picks: list[int], tokens: torch.Tensor, mask: torch.Tensor, anchors: torch.Tensor,
                  norm: torch.Tensor | None) -> dict[str, float]:
        lengths = [int(self.data.starts[p + 1] - self.data.starts[p]) for p in picks]
        seq = max(lengths)
        tokens, mask = tokens[:, :seq].to(self.device), mask[:, :seq].to(self.device)
        taps, last = self.features(picks, tokens, lengths)
        teacher = None
        if self.recipe.teacher:
            if last is None or self.final_norm is None:
                raise ValueError("distillation needs the target's last layer among the features and its final norm")
            teacher = Teacher(last, self.final_norm, self.recipe.distill, self.recipe.distill_tv, self.recipe.tv_cut)
        cuda = self.device.type == "cuda"
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=cuda):
            out = losses(self.drafter, self.embed, self.head, taps, tokens, mask, anchors.to(self.device),
                         self.recipe.gamma, norm, teacher)
        out["loss"].backward()
        return {k: float(v.detach()) for k, v in out.items()}

    def run(self, budget: Budget, checkpoint: Path, every_s: float, log: Callable[[str], None]) -> None:
        """Step until the budget is spent, writing the checkpoint every `every_s` seconds of training (0: every
        step), on Ctrl-C (then re-raised) and at the end."""
        c = self.counters
        bar = Progress("train", max(budget.steps, 1), "steps")
        last_save = c.seconds
        try:
            while (p := budget.progress(c.step, c.tokens, c.seconds)) < 1.0:
                t0 = time.monotonic()
                seen = self.last = self.step(p)
                _sync(self.device)
                c.seconds += time.monotonic() - t0
                if c.step <= 3 or c.step % 100 == 0:
                    r = self.recipe
                    terms = (["soft_unary", "soft_selector"] if r.distill else []) + (
                        ["tv_unary"] if r.distill_tv else []) + (["tv_selector"] if r.teacher else [])
                    soft = "".join(f" {k} {seen[k]:.4f}" for k in terms)
                    log(f"step {c.step} loss {seen['loss']:.4f} unary {seen['unary']:.4f} selector "
                        f"{seen['selector']:.4f}{soft} tau {seen['tau']:.2f} gnorm {seen['gnorm']:.2f} "
                        f"lr {seen['lr']:.2e}")
                p = budget.progress(c.step, c.tokens, c.seconds)
                bar.total = c.step / p if p > 0 else bar.total
                bar.update(c.step, f"loss {seen['loss']:.3f} tau {seen['tau']:.2f}")
                if c.seconds - last_save >= every_s:
                    self.save(checkpoint)
                    last_save = c.seconds
        except KeyboardInterrupt:
            self.save(checkpoint)
            bar.close("interrupted: checkpoint written")
            raise
        self.save(checkpoint)
        bar.close()

    def save(self, path: Path) -> None:
        state = {"drafter": self.drafter.state_dict(), "optimizer": self.opt.state_dict(),
                 "generator": self.gen.get_state(), "counters": vars(self.counters)}
        tmp = path.with_name(path.name + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)

    def load(self, path: Path) -> None:
        state: dict[str, Any] = torch.load(path, map_location=self.device, weights_only=True)
        self.drafter.load_state_dict(state["drafter"])
        self.opt.load_state_dict(state["optimizer"])
        self.gen.set_state(state["generator"].cpu())
        self.counters = Counters(**state["counters"])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
