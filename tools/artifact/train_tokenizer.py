"""Train the built-in byte-level BPE tokenizer on the standard library's train files and write it into the artifact.

Owns: the tokenizer's recipe (vocabulary size, special tokens and their ids, pre-tokenizer, decoder) and the
tokenizer_config.json beside it (chat template, eos/pad). Does not own: which files are read (corpus.py).

Run from the repository root:  python -m tools.artifact.train_tokenizer --out ignis/builtin
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tools.artifact import corpus

# Fixed ids, first in the vocabulary so they do not move if the vocabulary size changes.
# <|endoftext|> separates documents and pads; <|im_end|> ends a chat turn; <|mask|> fills the drafter's block.
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")
ENDOFTEXT_ID, IM_START_ID, IM_END_ID, MASK_ID = 0, 1, 2, 3

# 8192 keeps the embedding (shared with the output head) at 8192 x hidden, a small share of a ~20M-parameter
# model, while Python's keywords, common identifiers and indentation runs still get tokens of their own.
VOCAB_SIZE = 8192

# ChatML, as Qwen writes it; the generation prompt opens the assistant turn.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)


def build(texts: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained on texts. No normalizer: decode(encode(s)) == s for every string."""
    tok = Tokenizer(models.BPE())
    # No prefix space: a source file must come back byte for byte, and code has no leading-space convention.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for token, want in zip(SPECIAL_TOKENS, (ENDOFTEXT_ID, IM_START_ID, IM_END_ID, MASK_ID)):
        got = tok.token_to_id(token)
        if got != want:
            raise RuntimeError(f"special token {token} got id {got}, expected {want}")
    return tok


def tokenizer_config() -> dict[str, object]:
    """tokenizer_config.json: what transformers and ignis read besides tokenizer.json."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|mask|>"],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("ignis/builtin"))
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args()

    t0 = time.perf_counter()
    train, held = corpus.load(corpus.default_roots(site_packages=False))
    tok = build([f.text for f in train], args.vocab_size)
    args.out.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out / "tokenizer.json"))
    (args.out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")

    held_bytes = sum(len(f.text.encode("utf-8")) for f in held)
    held_tokens = sum(len(e.ids) for e in tok.encode_batch([f.text for f in held]))
    print(
        f"trained on {len(train)} files, held out {len(held)}; vocab {tok.get_vocab_size()}; "
        f"held-out {held_bytes / held_tokens:.2f} bytes/token; {time.perf_counter() - t0:.0f}s"
    )


if __name__ == "__main__":
    main()
