"""Build the drafter's 4-bit shortlist head: the target's output rows of the N most frequent tokens.

Owns: counting token frequencies (from token-id files or text through the artifact's tokenizer). Does not own:
choosing the N tokens and writing them (ignis.train.shortlist, which `ignis train-drafter --shortlist N` uses too),
the file format or the quantization (ignis.backends.dflash2.shortlist), nor the drafter itself.

    python -m tools.artifact.build_shortlist --model ignis/builtin --size 4096 --text FILE...
    python -m tools.artifact.build_shortlist --model DIR --size 131072 --ids ids.npy
    python -m tools.artifact.build_shortlist --model ignis/builtin --size 4096 --counts RUN/counts.npy --exclude 3

Frequencies should come from text like what the drafter will propose (the target's own completions): a token
outside the shortlist can never be drafted.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from ignis.backends.dflash2.weights import SHORTLIST
from ignis.model.loader import load_model
from ignis.train import shortlist


def count_ids(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """ids [..] int64 -> counts [vocab] int64."""
    return torch.bincount(ids.reshape(-1).to(torch.int64), minlength=vocab)[:vocab]


def count_text(files: list[Path], tokenizer_file: Path, vocab: int) -> torch.Tensor:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    counts = torch.zeros(vocab, dtype=torch.int64)
    for f in files:
        ids = tok.encode(f.read_text(errors="replace")).ids
        counts += count_ids(torch.tensor(ids, dtype=torch.int64), vocab)
    return counts


def build(model_dir: Path, out: Path, counts: torch.Tensor, size: int, *, group: int = 32,
          exclude: tuple[int, ...] = ()) -> torch.Tensor:
    """Write the shortlist of `model_dir`'s output head to `out`; returns the chosen ids [N] int64."""
    model = load_model(model_dir, device="cpu", dtype=torch.float32, exact=False)
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    return shortlist.build(head, out, counts, size, group=group, exclude=exclude)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="the target's directory")
    ap.add_argument("--drafter", type=Path, help="drafter directory (default <model>/drafter)")
    ap.add_argument("--size", type=int, required=True, help="tokens in the shortlist")
    ap.add_argument("--group", type=int, default=32, help="columns per 4-bit scale")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", type=Path, nargs="+", help="text files, tokenized with <model>/tokenizer.json")
    src.add_argument("--ids", type=Path, nargs="+", help=".npy files of token ids")
    src.add_argument("--counts", type=Path, help=".npy of per-token counts [vocab]")
    ap.add_argument("--exclude", type=int, nargs="*", default=[], help="ids never to include (the mask token)")
    args = ap.parse_args()
    from ignis.model.config import ModelConfig

    vocab = ModelConfig.from_dir(args.model).vocab_size
    if args.text:
        counts = count_text(args.text, args.model / "tokenizer.json", vocab)
    elif args.counts:
        counts = torch.from_numpy(np.load(args.counts)).to(torch.int64)[:vocab]
    else:
        counts = torch.zeros(vocab, dtype=torch.int64)
        for f in args.ids:
            counts += count_ids(torch.from_numpy(np.load(f)), vocab)
    out = (args.drafter or args.model / "drafter") / SHORTLIST
    ids = build(args.model, out, counts, args.size, group=args.group, exclude=tuple(args.exclude))
    covered = float(counts[ids].sum()) / max(float(counts.sum()), 1.0)
    print(f"{out}: {ids.numel()} tokens covering {covered:.1%} of the counted tokens")


if __name__ == "__main__":
    main()
