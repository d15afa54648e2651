"""`ignis quantize SRC DST`: a Hugging Face Qwen3.5 checkpoint to the ignis int4 format, one shard at a time.

Owns: reading SRC's shards (single file or sharded with an index) one after another, quantizing the tensors that
`quantized_name` picks and copying the rest unchanged, writing DST's shards under the same names with a new index,
config.json with its `quantization_config`, the other top-level files (tokenizer, generation config, ...) and a
`drafter/` directory as they are, and the progress line. An FP8 checkpoint (ignis.quant.fp8_checkpoint) is read
through its scales: its FP8 weights are quantized from their values, or written in the checkpoint's dtype where the
format keeps a tensor's precision, and its scales are not written. Does not own: the format (ignis.quant.format).

Memory: one source tensor and its packed form at a time, plus the shard being written (safetensors writes a file
from a dict of tensors, so a DST shard, at most the size of its SRC shard, is held until it is written).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ignis.errors import ArtifactError
from ignis.model.config import ModelConfig
from ignis.model.loader import our_name
from ignis.quant.format import QuantConfig, quantize, quantized_name
from ignis.quant.fp8_checkpoint import SCALE_NAMES, Fp8Checkpoint, dequantize, scale_name

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def convert(src: str | Path, dst: str | Path, *, group: int = 128, bits: int = 4, head: bool = False,
            progress: Callable[[int, int, str], None] | None = None) -> QuantConfig:
    """Write the int4 form of the checkpoint `src` into the new or empty directory `dst`; with `head`, the output
    head (lm_head) too.

    progress(done_bytes, total_bytes, shard) is called after every tensor. Raises ArtifactError for a source ignis
    cannot read (no config.json or weights, another architecture, already quantized) or a non-empty `dst`."""
    source, target = Path(src), Path(dst)
    try:
        quant = QuantConfig(bits=bits, group_size=group, head=head)
    except ValueError as e:
        raise ArtifactError(str(e)) from e
    config_path = source / "config.json"
    model_config = ModelConfig.from_dir(source)  # the architecture check, before any work
    config = json.loads(config_path.read_text())
    # A tied head (the embedding read as the output head) becomes its own packed copy of the embedding, which keeps
    # its precision for the lookups: the converted checkpoint unties them.
    untie = head and model_config.tie_word_embeddings
    fp8 = None
    if "quantization_config" in config:
        try:
            fp8 = Fp8Checkpoint.of(config["quantization_config"])
        except ValueError as e:
            raise ArtifactError(f"{config_path}: quantization_config: {e}") from e
        if fp8 is None:
            raise ArtifactError(f"{config_path}: already quantized "
                                f"({config['quantization_config'].get('quant_method')}); convert the checkpoint in "
                                f"its own precision or an FP8 one")
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ArtifactError(f"{target}: exists and is not an empty directory; choose a new one")
    shards = _shards(source)
    scales = _Fp8Scales(shards, fp8, _dtype(config)) if fp8 is not None else None
    total = sum(p.stat().st_size for p in shards)
    target.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    done = 0  # bytes of the finished shards
    untied = False
    for shard in shards:
        out: dict[str, torch.Tensor] = {}
        read = 0
        with safe_open(str(shard), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                tensor = f.get_tensor(name)
                read += tensor.nbytes
                if scales is not None:
                    if scales.consumed(name):
                        continue
                    tensor = scales.weight(name, tensor)
                if quantized_name(name, tuple(tensor.shape), group, head):
                    out.update(_packed(name.removesuffix(".weight"), tensor, group))
                else:
                    out[name] = tensor
                if untie and our_name(name) == "embed_tokens.weight":
                    out.update(_packed("lm_head", tensor, group))
                    untied = True
                del tensor
                if progress is not None:
                    progress(min(done + read, total - 1), total, shard.name)
        save_file(out, str(target / shard.name), metadata={"format": "pt"})
        done += shard.stat().st_size
        if progress is not None:
            progress(done, total, shard.name)
        weight_map.update({name: shard.name for name in out})
        del out
    size = sum((target / s.name).stat().st_size for s in shards)
    (target / INDEX).write_text(json.dumps({"metadata": {"total_size": size}, "weight_map": weight_map}, indent=2,
                                           sort_keys=True) + "\n")
    if untie and not untied:
        raise ArtifactError(f"{source}: tie_word_embeddings is true but no embed_tokens.weight was found to make the "
                            f"output head of")
    if untie:
        for c in (config, config.get("text_config")):
            if isinstance(c, dict) and "tie_word_embeddings" in c:
                c["tie_word_embeddings"] = False
        config.setdefault("tie_word_embeddings", False)
    config["quantization_config"] = quant.to_json()
    (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for item in source.iterdir():
        if item.is_file() and item.name not in ("config.json", INDEX) and item.suffix != ".safetensors":
            shutil.copy2(item, target / item.name)
    if (source / "drafter").is_dir():
        shutil.copytree(source / "drafter", target / "drafter")
    return quant


class _Fp8Scales:
    """An FP8 source's weights in its dtype, their scales read from whichever shard holds them."""

    SIDE = (*SCALE_NAMES, "input_scale", "activation_scale")  # tensors of an FP8 linear that the output does not keep

    def __init__(self, shards: list[Path], fp8: Fp8Checkpoint, dtype: torch.dtype) -> None:
        self.fp8, self.dtype = fp8, dtype
        self.handles = {shard: safe_open(str(shard), framework="pt", device="cpu") for shard in shards}
        self.where = {name: shard for shard, f in self.handles.items() for name in f.keys()}  # noqa: SIM118

    def consumed(self, name: str) -> bool:
        return name.rsplit(".", 1)[-1] in self.SIDE and f"{name.rsplit('.', 1)[0]}.weight" in self.where

    def weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dtype != torch.float8_e4m3fn:
            return tensor
        try:
            scale = scale_name(name, self.where)
        except ValueError as e:
            raise ArtifactError(str(e)) from e
        try:
            return dequantize(tensor, self.handles[self.where[scale]].get_tensor(scale), self.fp8.block, self.dtype)
        except ValueError as e:
            raise ArtifactError(f"{scale}: {e}") from e


def _dtype(config: dict) -> torch.dtype:
    """The dtype a checkpoint's config.json states (`dtype` or `torch_dtype`, at the top or in text_config);
    bfloat16 where it states none."""
    for c in (config, config.get("text_config") or {}):
        name = c.get("dtype") or c.get("torch_dtype")
        if isinstance(name, str) and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
    return torch.bfloat16


def _packed(stem: str, weight: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    qweight, scales, qzeros = quantize(weight, group)
    return {f"{stem}.qweight": qweight, f"{stem}.scales": scales, f"{stem}.qzeros": qzeros}


def _shards(root: Path) -> list[Path]:
    index = root / INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ArtifactError(f"{index}: not a safetensors index with a weight_map ({e})") from e
        missing = [n for n in names if not (root / n).is_file()]
        if missing:
            raise ArtifactError(f"{index} names shard {missing[0]}, which is not in {root}")
        return [root / n for n in names]
    if (root / SINGLE).is_file():
        return [root / SINGLE]
    raise ArtifactError(f"{root}: no {SINGLE} or {INDEX} next to config.json")


class ProgressBar:
    """One line on stderr, redrawn at most ten times a second: bar, GB done of total, rate, current shard."""

    def __init__(self, stream: TextIO | None = None, width: int = 30) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.started = time.perf_counter()
        self.drawn = 0.0

    def __call__(self, done: int, total: int, shard: str) -> None:
        now = time.perf_counter()
        if done < total and now - self.drawn < 0.1:
            return
        self.drawn = now
        filled = self.width * done // max(total, 1)
        rate = done / max(now - self.started, 1e-9) / 1e9
        line = (f"\rquantize [{'#' * filled}{'.' * (self.width - filled)}] {done / 1e9:.2f}/{total / 1e9:.2f} GB "
                f"{rate:.2f} GB/s {shard}")
        print(line, end="\n" if done >= total else "", file=self.stream, flush=True)
