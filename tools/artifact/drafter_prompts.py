"""The built-in drafter's training prompts: windows of the target's training-side corpus, written as a prompts JSONL
that `ignis train-drafter` reads.

Owns: cutting fixed-length prompts (code windows and ChatML requests) from the Python files the target trained on,
and writing them as {"prompt_token_ids": [...]} lines. Does not own: the corpus (corpus.py, data.py), the completions,
the drafter or its training (ignis.train, run by `ignis train-drafter`).

    python -m tools.artifact.drafter_prompts --out build/drafter-prompts.jsonl          # 16,384 prompts of 384 tokens

Every prompt has the same length. A chat prompt is its request preceded by the end of a code window and an
<|endoftext|>, the way documents follow each other in the target's training stream.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from tools.artifact import corpus
from tools.artifact.corpus import SourceFile
from tools.artifact.data import function_requests
from tools.artifact.train_tokenizer import ENDOFTEXT_ID, IM_END_ID, IM_START_ID


def sample_files(roots: list[str], max_bytes: int) -> list[SourceFile]:
    """Training-side files (never held-out ones) in path-hash order until `max_bytes` of text: the corpus rule of
    target training, without reading every installed file first."""
    paths = sorted(((hashlib.sha256(rel.encode("utf-8")).digest(), root, rel) for root in roots
                    for rel in corpus._walk(root) if not corpus.is_held_out(rel)))
    files, total, seen = [], 0, set()
    for _, root, rel in paths:
        text = corpus._read(os.path.join(root, rel))
        key = hashlib.sha256(text.encode("utf-8")).digest() if text else b""
        if text is None or key in seen:
            continue
        seen.add(key)
        files.append(SourceFile(root, rel, text))
        total += len(text)
        if total >= max_bytes:
            break
    return files


def build_prompts(tok: Tokenizer, files: list[SourceFile], count: int, length: int, chat_share: float,
                  seed: int) -> tuple[torch.Tensor, int]:
    """([count, length] int64 prompts, how many are chat): code windows at line starts, and a `chat_share` of ChatML
    requests, as many as the sampled files' functions give (fewer than the share asks when they run out)."""
    rng = random.Random(seed)
    tok.encode_special_tokens = True  # source that mentions "<|im_end|>" stays text
    docs = [np.asarray(e.ids, dtype=np.int64) for e in tok.encode_batch([f.text for f in files])]
    newline = tok.encode("\n").ids
    tok.encode_special_tokens = False
    docs = [d for d in docs if d.size > length + 64]
    if not docs:
        raise ValueError(f"no file is longer than {length + 64} tokens")
    requests = [r for f in rng.sample(files, min(len(files), 4 * count)) for r, _, _, _ in function_requests(f.text)]
    rng.shuffle(requests)
    out = np.zeros((count, length), dtype=np.int64)
    n_chat = min(int(count * chat_share), len(requests))
    for i in range(count):
        doc = docs[rng.randrange(len(docs))]
        if i < n_chat:
            ask = [IM_START_ID, *tok.encode("user\n" + requests[i]).ids, IM_END_ID, *newline, IM_START_ID,
                   *tok.encode("assistant\n").ids]
            ask = ask[-(length // 2):]
            lead = length - len(ask) - 1
            start = rng.randrange(doc.size - lead)
            out[i] = np.concatenate([doc[start : start + lead], [ENDOFTEXT_ID], ask])
        else:
            start = rng.randrange(doc.size - length)
            out[i] = doc[start : start + length]
    order = list(range(count))
    rng.shuffle(order)  # chat and code mixed in every generation batch
    return torch.from_numpy(out[order]), n_chat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="the prompts JSONL to write")
    ap.add_argument("--target", type=Path, default=Path("ignis/builtin"), help="where tokenizer.json is")
    ap.add_argument("--sequences", type=int, default=16384, help="prompts to cut")
    ap.add_argument("--prompt-len", type=int, default=384)
    ap.add_argument("--chat-share", type=float, default=0.3)
    ap.add_argument("--max-mb", type=float, default=40.0, help="training-side text to sample files from")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--toy", action="store_true", help="the standard library only, 2 MB: a quick run")
    args = ap.parse_args()
    tok = Tokenizer.from_file(str(args.target / "tokenizer.json"))
    files = sample_files(corpus.default_roots(site_packages=not args.toy), int((2 if args.toy else args.max_mb) * 1e6))
    prompts, n_chat = build_prompts(tok, files, args.sequences, args.prompt_len, args.chat_share, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps({"prompt_token_ids": row}) + "\n" for row in prompts.tolist()))
    asked = int(args.sequences * args.chat_share)
    short = (f" (the share asked for {asked}; the sampled files' functions gave no more: a larger --max-mb samples "
             f"more files)" if n_chat < asked else "")
    print(f"{args.out}: {prompts.shape[0]} prompts of {args.prompt_len} tokens from {len(files)} training files, "
          f"{n_chat} of them chat requests{short}")


if __name__ == "__main__":
    main()
