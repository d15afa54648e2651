"""The artifact tools' contracts: shards stay under their limit and round-trip through the index, installing a run
leaves the tokenizer alone, held-out prompts end at a header and continue with the file's own text, and chat
examples are token for token what the chat template renders."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from ignis.builtin import PATH
from tools.artifact import export
from tools.artifact.corpus import SourceFile
from tools.artifact.data import chat_ids, function_requests
from tools.artifact.prompts import code_prompts

SOURCE = '''import math


def hypot(x, y):
    """Return the Euclidean norm of the vector (x, y), without overflow for large inputs."""
    scale = max(abs(x), abs(y))
    if scale == 0:
        return 0.0
    x, y = x / scale, y / scale
    total = x * x + y * y
    root = math.sqrt(total)
    return scale * root


class Point:
    def __init__(self, x, y):
        self.x = x
        self.y = y
        self.norm = hypot(x, y)
        self.angle = math.atan2(y, x)
        self.quadrant = 1 if x >= 0 and y >= 0 else 2 if y >= 0 else 3 if x < 0 else 4
'''


def test_shards_respect_the_limit_and_the_index_finds_every_tensor(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = {f"model.layers.{i}.w": torch.randn(16, 16, generator=gen).bfloat16() for i in range(5)}
    names = export.save_shards(tensors, tmp_path, max_bytes=1100)  # two 512-byte tensors a shard
    assert len(names) == 3
    assert all((tmp_path / n).stat().st_size <= 1100 + 1024 for n in names)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 5 * 512
    for name, tensor in tensors.items():
        assert torch.equal(load_file(tmp_path / index["weight_map"][name])[name], tensor)


def test_install_replaces_weights_and_keeps_the_tokenizer(tmp_path: Path) -> None:
    run, artifact = tmp_path / "run", tmp_path / "artifact"
    run.mkdir()
    artifact.mkdir()
    export.save_shards({"a": torch.zeros(4)}, run)
    (run / "config.json").write_text(json.dumps({"bos_token_id": None, "eos_token_id": [2, 0], "pad_token_id": 0}))
    (run / "train.log").write_text("log\n")
    (artifact / "tokenizer.json").write_text("{}")
    for stale in ("model-00001-of-00002.safetensors", "model.safetensors.index.json"):
        (artifact / stale).write_text("old")
    export.install(run, artifact)
    assert sorted(p.name for p in artifact.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json"
    ]
    assert json.loads((artifact / "generation_config.json").read_text())["eos_token_id"] == [2, 0]


def test_code_prompts_end_at_a_header_and_continue_with_the_file() -> None:
    files = [SourceFile("root", f"pkg/geometry_{i}.py", SOURCE) for i in range(12)]
    items = code_prompts(files, 12)
    assert len(items) == 12 and len({item["file"] for item in items}) == 12
    # Every def/class whose body is long enough can be chosen; hypot's prompt keeps its docstring.
    assert {item["line"] for item in items} <= {4, 15, 16}
    for item in items:
        prompt, reference = str(item["prompt"]), str(item["reference"])
        assert prompt.endswith((":", '"""')) and reference.startswith("\n    ")
        assert prompt + reference in SOURCE
        if item["line"] == 4:
            assert prompt.endswith('without overflow for large inputs."""')


def test_chat_examples_match_the_chat_template() -> None:
    (request, answer, line, name), = function_requests(SOURCE)
    assert (line, name) == (4, "hypot")
    assert request == ("Write a Python function `hypot`: Return the Euclidean norm of the vector (x, y), "
                       "without overflow for large inputs.")
    tok = Tokenizer.from_file(str(PATH / "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(str(PATH))
    messages = [{"role": "user", "content": request}, {"role": "assistant", "content": answer}]
    rendered = hf.apply_chat_template(messages, tokenize=False)
    assert chat_ids(tok, request, answer) == tok.encode(rendered).ids
