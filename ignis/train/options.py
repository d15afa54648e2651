"""What `ignis train-drafter` accepts: its flags, their checks, and the settings a resumed run must share.

Owns: `Options` (frozen), the argparse flags that build it, budget parsing ("90m", "2h", "40M"), and the
fingerprint a checkpoint is tied to. Does not own: the run (ignis.train.run).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import asdict, dataclass
from typing import Any

from ignis.errors import InputError

_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_COUNT = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9}
# --first-draft's forms -> DrafterConfig.first_draft
FIRST_DRAFT_FORMS = {"drafter": "", "mtp": "mtp"}


@dataclass(frozen=True)
class Options:
    model: str  # "" = the built-in model
    data: tuple[str, ...]
    out: str
    profile: str | None = None
    sets: tuple[str, ...] = ()
    # prompts and completions
    window: int = 384  # tokens per prompt cut from text
    max_prompt_tokens: int = 2048
    max_prompts: int = 0  # 0: all
    gen_tokens: int = 256
    held_out: int = 32
    eval_tokens: int = 256
    # the drafter's shape
    layers: int = 5
    intermediate_size: int = 0  # 0: the target's
    taps: tuple[int, ...] = ()  # (): spread over the target's layers as the reference does
    block_size: int = 8
    sliding_window: int = 2048
    selector_rank: int = 64
    selector_top_k: int = 16
    mask_token_id: int | None = None
    init: str = ""  # a drafter directory to start from ("": random); its config.json decides the shape
    grow_layers: int = 0  # with init: layers added after its own, each starting as the identity
    # who drafts slot 1 (FIRST_DRAFT_FORMS): "mtp" the target's MTP layer, given to the block, "drafter" the drafter;
    # None: as the --init drafter does, else the drafter
    first_draft: str | None = None
    shortlist: int = 0
    # the recipe and budget
    batch: int = 32
    anchors: int = 32
    lr: float = 8e-4
    warmup: int = 100
    distill: float = 1.0  # weight of the soft terms against the target's distribution; 0: hard labels only
    distill_tv: float = 0.0  # weight of the total-variation terms against it (ignis.train.recipe)
    tv_cut: tuple[int, float] | None = None  # (top_k, top_p) the total variation is measured under; None: uncut
    seed: int = 0
    steps: int = 0
    train_tokens: int = 0
    time_budget: float = 0.0
    gen_share: float = 0.35
    checkpoint_every: float = 300.0
    tap_cache: str = "auto"
    restart: bool = False

    def fingerprint(self) -> dict[str, Any]:
        """The settings a checkpoint belongs to; budgets, checkpoint cadence and memory choices may change."""
        keep = {k: v for k, v in asdict(self).items()
                if k not in ("steps", "train_tokens", "time_budget", "gen_share", "checkpoint_every", "tap_cache",
                             "restart", "profile", "sets", "eval_tokens", "shortlist", "out")}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in keep.items()}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default="", metavar="MODEL",
                   help="Qwen3.5 checkpoint directory (default: the built-in model)")
    p.add_argument("--data", action="append", required=True, metavar="PATH",
                   help="prompts: text files or directories, a prompts JSONL or a chat JSONL (repeatable)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="the drafter's directory (spec.drafter); DIR/run keeps data and checkpoints")
    p.add_argument("--time-budget", default="0", metavar="TIME", help="wall time for the whole run: 3600, 90m, 2h")
    p.add_argument("--train-tokens", default="0", metavar="N",
                   help="stop after training on N completion tokens (e.g. 40M); about N / data tokens epochs")
    p.add_argument("--steps", type=int, default=0, help="stop after this many optimizer steps")
    g = p.add_argument_group("data")
    g.add_argument("--window", type=int, default=384, help="tokens per prompt cut from text (default 384)")
    g.add_argument("--max-prompt-tokens", type=int, default=2048, help="longer prompts are skipped (default 2048)")
    g.add_argument("--max-prompts", type=int, default=0, help="use at most this many prompts (default all)")
    g.add_argument("--gen-tokens", type=int, default=256, help="tokens the target writes per prompt (default 256)")
    g.add_argument("--gen-share", type=float, default=0.35,
                   help="share of what --time-budget leaves once the engine has started that generation may take "
                        "(default 0.35)")
    g.add_argument("--held-out", type=int, default=32, help="prompts kept out for the final evaluation (default 32)")
    g.add_argument("--eval-tokens", type=int, default=256, help="tokens per held-out prompt at evaluation")
    d = p.add_argument_group("drafter")
    d.add_argument("--layers", type=int, default=5)
    d.add_argument("--intermediate-size", type=int, default=0, help="MLP width (default: the target's)")
    d.add_argument("--taps", default="", metavar="IDS", help="target layers to tap, e.g. 1,9,17,25,33 (default: "
                                                            "five spread over the layers)")
    d.add_argument("--block-size", type=int, default=8, help="anchor + drafts (default 8: 7 drafts)")
    d.add_argument("--sliding-window", type=int, default=2048)
    d.add_argument("--selector-rank", type=int, default=64)
    d.add_argument("--selector-top-k", type=int, default=16)
    d.add_argument("--mask-token-id", type=int, default=None,
                   help="the block filler (default: the tokenizer's mask token, else the first unused row)")
    d.add_argument("--init", default="", metavar="DIR",
                   help="start from this drafter's weights (e.g. one published for the base model); its config.json "
                        "sets the shape, and the shape flags are not used")
    d.add_argument("--grow-layers", type=int, default=0, metavar="N",
                   help="with --init: add N layers after the drafter's own, each starting as the identity (its "
                        "attention's and MLP's output projections zero), so training starts from that drafter's "
                        "function with more capacity")
    d.add_argument("--first-draft", default=None, choices=sorted(FIRST_DRAFT_FORMS),
                   help="who drafts slot 1 when serving. mtp: the target's MTP layer, so the drafter trains with that "
                        "slot's token given in its block and learns slots 2 on; drafter: the drafter itself. Default: "
                        "as the --init drafter does, else the drafter")
    d.add_argument("--shortlist", type=int, default=0, metavar="N",
                   help="also write the 4-bit shortlist head of the N most frequent completion tokens")
    r = p.add_argument_group("recipe")
    r.add_argument("--batch", type=int, default=32, help="sequences per step (default 32)")
    r.add_argument("--anchors", type=int, default=32, help="blocks per sequence (default 32)")
    r.add_argument("--lr", type=float, default=8e-4)
    r.add_argument("--warmup", type=int, default=100, help="warmup steps (default 100)")
    r.add_argument("--distill", type=float, default=1.0, metavar="W",
                   help="weight of the distillation terms, cross-entropies against the target's own next-token "
                        "distribution beside the hard labels' (default 1.0; 0: hard labels only)")
    r.add_argument("--distill-tv", type=float, default=0.0, metavar="W",
                   help="weight of the total-variation terms, 1 - sum min(p, q) against the target's distribution p: "
                        "the chance a sampled draft is rejected (default 0: reported for the selector, not trained)")
    r.add_argument("--tv-cut", default=None, metavar="TOP_K,TOP_P",
                   help="measure the total variation as sampled requests with this top-k and top-p are served: p and "
                        "the drafter's q each cut to them and renormalised, as the engine's rejection sampling sees "
                        "them (e.g. 20,0.95; default: both uncut)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--checkpoint-every", type=float, default=300.0, help="seconds of training between checkpoints")
    r.add_argument("--tap-cache", choices=("auto", "on", "off"), default="auto",
                   help="keep every tap feature in memory (auto: when it fits) or run the target each step")
    r.add_argument("--restart", action="store_true", help="discard DIR/run and start over")


def from_args(args: argparse.Namespace) -> Options:
    opts = Options(
        model=args.model or "", data=tuple(args.data), out=args.out, profile=args.profile, sets=tuple(args.sets),
        window=args.window, max_prompt_tokens=args.max_prompt_tokens, max_prompts=args.max_prompts,
        gen_tokens=args.gen_tokens, held_out=args.held_out, eval_tokens=args.eval_tokens, layers=args.layers,
        intermediate_size=args.intermediate_size, taps=_ids(args.taps), block_size=args.block_size,
        sliding_window=args.sliding_window, selector_rank=args.selector_rank, selector_top_k=args.selector_top_k,
        mask_token_id=args.mask_token_id, init=args.init, grow_layers=args.grow_layers, shortlist=args.shortlist,
        first_draft=args.first_draft,
        batch=args.batch, anchors=args.anchors,
        lr=args.lr, warmup=args.warmup, distill=args.distill, distill_tv=args.distill_tv,
        tv_cut=parse_cut(args.tv_cut), seed=args.seed, steps=args.steps,
        train_tokens=parse_count(args.train_tokens, "--train-tokens"),
        time_budget=parse_seconds(args.time_budget, "--time-budget"), gen_share=args.gen_share,
        checkpoint_every=args.checkpoint_every, tap_cache=args.tap_cache, restart=args.restart,
    )
    check(opts)
    return opts


def check(o: Options) -> None:
    """Refuse settings that cannot work, naming the flag, before anything loads."""
    positive = {"--window": o.window, "--max-prompt-tokens": o.max_prompt_tokens, "--gen-tokens": o.gen_tokens,
                "--eval-tokens": o.eval_tokens, "--layers": o.layers, "--batch": o.batch, "--anchors": o.anchors,
                "--warmup": o.warmup, "--selector-rank": o.selector_rank, "--selector-top-k": o.selector_top_k,
                "--sliding-window": o.sliding_window}
    for flag, v in positive.items():
        if v < 1:
            raise InputError(flag, f"must be at least 1, got {v}")
    nonneg = {"--max-prompts": o.max_prompts, "--held-out": o.held_out, "--steps": o.steps,
              "--intermediate-size": o.intermediate_size, "--shortlist": o.shortlist, "--seed": o.seed,
              "--grow-layers": o.grow_layers}
    for flag, v in nonneg.items():
        if v < 0:
            raise InputError(flag, f"must be 0 or more, got {v}")
    if o.checkpoint_every < 0:
        raise InputError("--checkpoint-every", f"must be 0 (every step) or more seconds, got {o.checkpoint_every}")
    if o.block_size < 2:
        raise InputError("--block-size", f"a block holds the anchor and at least one draft; got {o.block_size}")
    if not o.lr > 0:
        raise InputError("--lr", f"must be positive, got {o.lr}")
    if not 0.0 <= o.distill < float("inf"):
        raise InputError("--distill", f"must be 0 (off) or a positive weight, got {o.distill}")
    if not 0.0 <= o.distill_tv < float("inf"):
        raise InputError("--distill-tv", f"must be 0 (off) or a positive weight, got {o.distill_tv}")
    if o.grow_layers and not o.init:
        raise InputError("--grow-layers", "grows the drafter --init names: give it one")
    if o.tv_cut is not None and not o.distill_tv:
        raise InputError("--tv-cut", "cuts the total-variation terms: give them a weight with --distill-tv")
    if not 0.0 < o.gen_share < 1.0:
        raise InputError("--gen-share", f"must be between 0 and 1, got {o.gen_share}")
    if not (o.steps or o.train_tokens or o.time_budget):
        raise InputError("--time-budget", "give a budget: --time-budget, --train-tokens or --steps")


def parse_cut(text: str | None) -> tuple[int, float] | None:
    """--tv-cut's TOP_K,TOP_P: top_k 0 (off) or more, top_p in (0, 1]."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*,\s*(\d*\.?\d+)\s*", text)
    if m is None or not 0.0 < float(m.group(2)) <= 1.0:
        raise InputError("--tv-cut", f"expected TOP_K,TOP_P with top_k 0 (off) or more and top_p in (0, 1], "
                                     f"such as 20,0.95; got {text!r}")
    return int(m.group(1)), float(m.group(2))


def parse_seconds(text: str, flag: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", str(text).lower())
    if m is None:
        raise InputError(flag, f"expected seconds or a number with s, m, h or d (90m, 2h), got {text!r}")
    return float(m.group(1)) * _SECONDS[m.group(2)]


def parse_count(text: str, flag: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgb]?)\s*", str(text).lower())
    if m is None:
        raise InputError(flag, f"expected a count such as 500000, 40M or 1.5B, got {text!r}")
    return int(float(m.group(1)) * _COUNT[m.group(2)])


def _ids(text: str) -> tuple[int, ...]:
    if not text.strip():
        return ()
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError as e:
        raise InputError("--taps", f"expected layer ids separated by commas (1,9,17), got {text!r}") from e
