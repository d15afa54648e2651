"""The built-in tokenizer: exact round-trips of held-out source, fixed special ids, and the ChatML chat template."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from ignis.builtin import PATH
from tools.artifact import corpus
from tools.artifact.train_tokenizer import ENDOFTEXT_ID, IM_END_ID, IM_START_ID, MASK_ID, VOCAB_SIZE


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(str(PATH / "tokenizer.json"))


def test_held_out_source_round_trips_exactly(tok: Tokenizer) -> None:
    _, held = corpus.load(corpus.default_roots(site_packages=False))
    assert len(held) > 20
    texts = [f.text for f in held[:40]]
    for text, enc in zip(texts, tok.encode_batch(texts)):
        assert tok.decode(enc.ids, skip_special_tokens=False) == text


@pytest.mark.parametrize(
    "text",
    ["\tif x:\r\n\t\treturn 'é' + \"日本\"  \n\n\n", "    \n  x = 0x1F  # trailing   ", "emoji 🐍 and \x0b\x0c"],
)
def test_awkward_text_round_trips_exactly(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text


def test_special_tokens_have_documented_ids(tok: Tokenizer) -> None:
    assert tok.get_vocab_size() == VOCAB_SIZE
    ids = {name: tok.token_to_id(name) for name in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")}
    assert ids == {"<|endoftext|>": ENDOFTEXT_ID, "<|im_start|>": IM_START_ID, "<|im_end|>": IM_END_ID,
                   "<|mask|>": MASK_ID}
    # A special token written in text is one token, not spelled out byte by byte.
    assert tok.encode("a<|im_end|>b").ids[1] == IM_END_ID


def test_split_rule_is_by_path_and_stable() -> None:
    assert corpus.is_held_out("json/decoder.py") == corpus.is_held_out("json/decoder.py")
    rels = [f"pkg/mod_{i}.py" for i in range(2000)]
    share = sum(map(corpus.is_held_out, rels)) / len(rels)
    assert 0.03 < share < 0.07


def test_chat_template_renders_chatml() -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(PATH))
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]
    text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou write Python.<|im_end|>\n"
        "<|im_start|>user\nSort a list.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert hf.eos_token_id == IM_END_ID
    assert hf.pad_token_id == ENDOFTEXT_ID
    config = json.loads((PATH / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>"
