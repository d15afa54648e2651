"""Write a trained target (+ MTP) as a Hugging Face model directory: bf16 safetensors shards, index, config.

Owns: tensor names on disk (transformers' names plus `mtp.*`, the tied lm_head left out), shard sizes,
config.json / generation_config.json, and installing a training run's files into the artifact directory. Does not
own: training (train_target.py) or the tokenizer files.

Install a run:  python -m tools.artifact.export RUN_DIR ignis/builtin
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Qwen3_5TextConfig

# The package ships shards of at most 16 MiB; the header (names, shapes, offsets) takes a few KiB more.
MAX_SHARD_BYTES = 15 * 1024 * 1024


def checkpoint_tensors(
    model: torch.nn.Module, mtp: torch.nn.Module, tied: bool
) -> dict[str, torch.Tensor]:  # name -> bf16 tensor, cpu
    """The checkpoint's tensors in bf16 under their on-disk names."""
    tensors = {name: t for name, t in model.state_dict().items()}
    if tied:
        # The head is the embedding; transformers re-ties it on load, and a second copy would cost 6 MiB.
        tensors.pop("lm_head.weight", None)
    tensors.update({f"mtp.{name}": t for name, t in mtp.state_dict().items()})
    return {name: t.detach().to("cpu", torch.bfloat16).contiguous() for name, t in sorted(tensors.items())}


def save_shards(tensors: dict[str, torch.Tensor], out: Path, max_bytes: int = MAX_SHARD_BYTES) -> list[str]:
    """Shards named model-0000i-of-0000n.safetensors (or model.safetensors if one fits) plus the index."""
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > max_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = t
        size += nbytes
    out.mkdir(parents=True, exist_ok=True)
    for stale in list(out.glob("model*.safetensors")) + list(out.glob("model.safetensors.index.json")):
        stale.unlink()
    if len(groups) == 1:
        save_file(groups[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map: dict[str, str] = {}
    for name, group in zip(names, groups):
        save_file(group, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in group})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names


def save_config(config: Qwen3_5TextConfig, out: Path) -> None:
    """config.json: the transformers layout plus mtp_num_hidden_layers, weights in bf16."""
    data = config.to_dict()
    data["dtype"] = "bfloat16"
    noise = ("transformers_version", "_name_or_path", "id2label", "label2id", "chunk_size_feed_forward",
             "is_encoder_decoder", "output_attentions", "output_hidden_states", "problem_type", "return_dict")
    for key in noise:
        data.pop(key, None)
    (out / "config.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def save_generation_config(out: Path) -> None:
    """generation_config.json from config.json: both stop tokens, greedy unless a request says otherwise."""
    config = json.loads((out / "config.json").read_text())
    generation = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
        "do_sample": False,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


# What a training run leaves that the artifact ships; its log stays behind (ARTIFACT.md quotes it).
RUN_FILES = ("config.json", "model*.safetensors", "model.safetensors.index.json", "heldout_*.jsonl")


def install(run: Path, artifact: Path) -> list[str]:
    """Replace the artifact's weights, config and held-out prompts with a run's; leave tokenizer and drafter."""
    if not (run / "config.json").is_file():
        raise FileNotFoundError(f"{run}: no config.json; is this a train_target output directory?")
    for stale in list(artifact.glob("model*.safetensors")) + list(artifact.glob("model.safetensors.index.json")):
        stale.unlink()
    copied: list[str] = []
    for pattern in RUN_FILES:
        for src in sorted(run.glob(pattern)):
            shutil.copyfile(src, artifact / src.name)
            copied.append(src.name)
    save_generation_config(artifact)
    return copied


def main() -> None:
    parser = argparse.ArgumentParser(description="Install a train_target run into the artifact directory.")
    parser.add_argument("run", type=Path)
    parser.add_argument("artifact", type=Path)
    args = parser.parse_args()
    print("installed " + ", ".join(install(args.run, args.artifact)) + ", generation_config.json")


if __name__ == "__main__":
    main()
