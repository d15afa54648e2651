"""Loading a Hugging Face Qwen3.5 checkpoint directory into a `HybridModel`.

Owns: finding the safetensors (single file or sharded with an index), mapping tensor names of both public layouts
(`Qwen3_5ForConditionalGeneration`: `model.language_model.*`; `Qwen3_5ForCausalLM`: `model.*`; or bare), checking
every shape, and placing the weights on the device in the model dtype; for a 4-bit checkpoint (config.json has an
ignis-int4 `quantization_config`, docs/quantization.md), putting a `QuantLinear` in place of each linear stored packed,
whose codes and zero points stay uint8 and whose scales take the model dtype (a GPTQ or AWQ checkpoint is repacked
into the same layout as it loads, ignis.quant.published); and, when asked, converting the
projections to fp8 after loading (ignis.quant.fp8). Does not own: the architecture
(ignis.model.model), the tokenizer or the drafter (their own loaders).

The model is built on the meta device and the checkpoint's tensors are assigned into it, so no memory is spent on an
initialisation that would be overwritten.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ignis.errors import ArtifactError
from ignis.model.config import ModelConfig
from ignis.model.model import HybridModel
from ignis.model.random import random_model
from ignis.quant.format import METHOD, QuantConfig
from ignis.quant.fp8 import to_fp8
from ignis.quant.fp8_checkpoint import STORED_FP8, Fp8Checkpoint, dequantize, scale_name
from ignis.quant.linear import QuantLinear, to_mma, uses_mma
from ignis.quant.published import Published, codes_name, repack, stored_names

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Kept in fp32 whatever the model dtype: the decay is computed in fp32 from them, as transformers does.
FP32_PARAMS = ("A_log", "dt_bias")


def load_model(path: str | Path, *, device: str | torch.device, dtype: torch.dtype, exact: bool,
               progress: Callable[[int, int], None] | None = None, fp8: bool = False,
               dummy: bool = False) -> HybridModel:
    """Read config.json and the safetensors of `path` into a HybridModel on `device` in `dtype`; `progress(done,
    total)` is called after each tensor. fp8: convert the decoder projections to float8 e4m3 once loaded
    (ignis.quant.fp8; the checkpoint must be in its own precision). dummy: read config.json only and make seeded
    random weights of its shapes on `device` (ignis.model.random), for benchmarks at shapes no checkpoint holds.

    Raises ArtifactError naming the file or tensor at fault: missing files, missing tensors, wrong shapes, or a
    config.json of an architecture ignis does not run."""
    root = Path(path)
    config = ModelConfig.from_dir(root)
    if dummy:  # no weights read: random ones of config.json's shapes, made on the device (model.load_format)
        model = random_model(config, seed=0, mtp=config.mtp_num_hidden_layers > 0, device=device, dtype=dtype,
                             exact=exact, fuse=False)
        if progress is not None:
            progress(1, 1)
        return _finish(model, fp8=fp8, exact=exact)
    quant = QuantConfig.from_dir(root)
    if fp8 and quant is not None:
        raise ArtifactError(f"{root}: fp8 weights are made from a checkpoint in its own precision; this one is "
                            f"{quant.bits}-bit ({quant.published.method if quant.published else METHOD}): load it "
                            f"with model.weights = 'int4' or 'auto'")
    fp8_stored = Fp8Checkpoint.from_dir(root) if quant is None else None
    files = _tensor_files(root)
    mtp = any(name.startswith("mtp.") for name in files)
    with torch.device("meta"):
        model = HybridModel(config, mtp=mtp, exact=exact)
        if quant is not None:
            _pack_linears(model, files, quant.group_size, codes_name(quant.published.method) if quant.published
                          else "qweight")
    wanted = model.state_dict()
    handles: dict[Path, object] = {}
    loaded: dict[str, torch.Tensor] = {}
    orders: dict[str, torch.Tensor] = {}
    try:
        if quant is not None and quant.published is not None:
            loaded.update(_repacked(model, files, handles, quant.published, device, dtype, orders))
        for i, (name, meta) in enumerate(wanted.items()):
            if name in loaded:
                continue
            if name not in files:
                raise ArtifactError(
                    f"{root}: tensor {name} is missing from the checkpoint (expected shape {tuple(meta.shape)})"
                )
            file, stored = files[name]
            handle = _open(handles, file)
            view = handle.get_slice(stored)  # type: ignore[attr-defined]
            found = tuple(view.get_shape())
            if found != tuple(meta.shape):
                raise ArtifactError(
                    f"{file.name}: tensor {stored} has shape {found}, expected {tuple(meta.shape)} for this config.json"
                )
            target = torch.float32 if name.rsplit(".", 1)[-1] in FP32_PARAMS else dtype
            if not meta.dtype.is_floating_point:  # packed codes and zero points
                target = meta.dtype
            tensor = handle.get_tensor(stored)  # type: ignore[attr-defined]
            if view.get_dtype() in STORED_FP8:
                tensor = _fp8_weight(name, tensor.to(device), files, handles, fp8_stored, target)
            loaded[name] = tensor.to(device=device, dtype=target)
            if progress is not None:
                progress(i + 1, len(wanted))
    finally:
        handles.clear()
    model.load_state_dict(loaded, strict=True, assign=True)
    for path, order in orders.items():  # act-order linears: not in the state dict (made from the g_idx)
        model.get_submodule(path).order = order
    model.requires_grad_(False)
    model.eval()
    return _finish(model, fp8=fp8, exact=exact)


def _finish(model: HybridModel, *, fp8: bool, exact: bool) -> HybridModel:
    if fp8:
        to_fp8(model)
    if not exact:
        weight = model.embed_tokens.weight
        if uses_mma(weight.device, weight.dtype):
            to_mma(model, weight.dtype)  # 4-bit weights in the mma kernel's order, before they are fused
        model.fuse()
    return model


def _fp8_weight(name: str, codes: torch.Tensor, files: dict[str, tuple[Path, str]], handles: dict[Path, object],
               fp8: Fp8Checkpoint | None, dtype: torch.dtype) -> torch.Tensor:
    """An FP8 checkpoint's weight `name` (its e4m3 codes, on the device it loads to, where the fp32 product is
    fastest) in `dtype`, through the scale stored beside it."""
    try:
        file, key = files[scale_name(name, files)]
    except ValueError as e:
        raise ArtifactError(f"{files[name][0].name}: {e}") from e
    try:
        scale = _open(handles, file).get_tensor(key).to(codes.device)  # type: ignore[attr-defined]
        return dequantize(codes, scale, fp8.block if fp8 else None, dtype)
    except ValueError as e:
        raise ArtifactError(f"{file.name}: {key}: {e}") from e


def _open(handles: dict[Path, object], file: Path) -> Any:
    """The safetensors handle of `file`, opened once for a load."""
    if file not in handles:
        handles[file] = safe_open(str(file), framework="pt", device="cpu")
    return handles[file]


def _repacked(model: HybridModel, files: dict[str, tuple[Path, str]], handles: dict[Path, object], pub: Published,
              device: str | torch.device, dtype: torch.dtype, orders: dict[str, torch.Tensor],
              ) -> dict[str, torch.Tensor]:
    """Every QuantLinear's qweight, scales and qzeros, read in a published layout (GPTQ, AWQ, compressed-tensors) and
    repacked into ignis's (ignis.quant.published); into `orders`, by module path, the held column order of each
    act-order linear."""
    out: dict[str, torch.Tensor] = {}
    required, optional = stored_names(pub)
    for path, module in model.named_modules():
        if not isinstance(module, QuantLinear):
            continue
        stored: dict[str, torch.Tensor] = {}
        for suffix in required + optional:
            name = f"{path}.{suffix}"
            if name not in files:
                if suffix in optional:
                    continue
                raise ArtifactError(f"{name} is missing from the checkpoint ({pub.method}: a packed linear stores "
                                    f"{', '.join(required)})")
            file, key = files[name]
            stored[suffix] = _open(handles, file).get_tensor(key)
        try:
            qweight, scales, qzeros, order = repack(pub, stored, module.out_features, module.in_features)
        except ValueError as e:
            raise ArtifactError(f"{files[f'{path}.{required[0]}'][0].name}: {path}: {e}") from e
        if order is not None:
            orders[path] = order.to(device)
        out[f"{path}.qweight"] = qweight.to(device)
        out[f"{path}.scales"] = scales.to(device=device, dtype=dtype)  # scales take the model dtype, as for ignis-int4
        out[f"{path}.qzeros"] = qzeros.to(device)
    return out


def _pack_linears(model: HybridModel, files: dict[str, tuple[Path, str]], group: int, codes: str) -> None:
    """Put a QuantLinear (on the meta device) in place of every linear the checkpoint stores packed: each whose codes
    (the tensor named by the suffix `codes`) it holds."""
    for name in [n for n in files if n.endswith(f".{codes}")]:
        path = name.removesuffix(f".{codes}")
        try:
            dense = model.get_submodule(path)
        except AttributeError:
            continue  # a tensor ignis does not use; the load reports nothing for it, as for dense ones
        if not isinstance(dense, torch.nn.Linear) or dense.in_features % group:
            raise ArtifactError(f"{files[name][0].name}: {files[name][1]} is packed, but {path} is not a linear "
                                f"whose inputs split into groups of {group}")
        parent, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent), attr, QuantLinear(dense.in_features, dense.out_features, group))


def _tensor_files(root: Path) -> dict[str, tuple[Path, str]]:
    """Our parameter name -> (file, the name stored in it), for every tensor of the checkpoint we use."""
    index = root / INDEX
    single = root / SINGLE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ArtifactError(f"{index}: not a safetensors index with a weight_map ({e})") from e
        stored = {name: root / file for name, file in weight_map.items()}
        for file in set(stored.values()):
            if not file.is_file():
                raise ArtifactError(f"{index} names shard {file.name}, which is not in {root}")
    elif single.is_file():
        with safe_open(str(single), framework="pt", device="cpu") as f:
            stored = {name: single for name in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    else:
        raise ArtifactError(f"{root}: no {SINGLE} or {INDEX} next to config.json")
    out: dict[str, tuple[Path, str]] = {}
    for name, file in stored.items():
        ours = our_name(name)
        if ours is not None:
            out[ours] = (file, name)
    return out


def our_name(stored: str) -> str | None:
    """Map a checkpoint tensor name to HybridModel's; None for tensors ignis does not use (the vision tower)."""
    if stored.startswith(("model.visual.", "visual.")):
        return None
    if stored.startswith("mtp.") or stored == "lm_head.weight":
        return stored
    for prefix in ("model.language_model.", "language_model.", "model."):
        if stored.startswith(prefix):
            return stored[len(prefix) :]
    return stored
