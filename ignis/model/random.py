"""Random-weight Qwen3.5 checkpoints: for tests, and for the built-in model until a trained artifact exists.

Owns: `save_random_checkpoint`, which writes config.json + model.safetensors in the Hugging Face Qwen3.5 text
layout (`Qwen3_5ForCausalLM`, plus `mtp.*`), loadable by ignis and by transformers alike. Does not own: the
tokenizer or drafter files of an artifact.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ignis.model.config import HF_DEFAULTS, ModelConfig
from ignis.model.model import HybridModel


def save_random_checkpoint(path: str | Path, config: dict, *, seed: int, mtp: bool = True) -> None:
    """Write a deterministic random checkpoint of the architecture `config` (a Qwen3.5 text config.json as a dict;
    missing keys take transformers' defaults) to the directory `path`.

    Scales: linears and embeddings N(0, 0.02); zero-centred norm weights N(0, 0.1) around 0 (identity), the GDN
    output norm around 1; conv taps U(-1/sqrt(Kc), 1/sqrt(Kc)) (torch's conv default); A_log = log U(0.01, 16) and
    dt_bias = 1 (transformers' init). Same seed and config -> same bytes."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    full = _full_config(config, mtp=mtp)
    model_config = ModelConfig.from_dict(full)
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in HybridModel(model_config, mtp=mtp).state_dict().items()}
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        stored = name if name.startswith("mtp.") or name == "lm_head.weight" else f"model.{name}"
        tensors[stored] = _init(name, shapes[name], gen, model_config).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(full, indent=2, sort_keys=True) + "\n")


def _full_config(config: dict, *, mtp: bool) -> dict[str, Any]:
    """Every key explicit, so transformers and ignis read the same architecture whatever their defaults."""
    full: dict[str, Any] = {k: v for k, v in HF_DEFAULTS.items() if k not in ("rope_theta", "partial_rotary_factor")}
    full.update({k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    rope = dict(full.pop("rope_parameters", None) or {})
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", full.pop("rope_theta", HF_DEFAULTS["rope_theta"]))
    rope.setdefault("partial_rotary_factor", full.pop("partial_rotary_factor", HF_DEFAULTS["partial_rotary_factor"]))
    full.pop("rope_theta", None)
    full.pop("partial_rotary_factor", None)
    full["rope_parameters"] = rope
    if full.get("layer_types") is None:
        every = full.pop("full_attention_interval")
        full["layer_types"] = [
            "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(full["num_hidden_layers"])
        ]
    full.pop("full_attention_interval", None)
    full["mtp_num_hidden_layers"] = 1 if mtp else 0
    full["model_type"] = "qwen3_5_text"
    full["architectures"] = ["Qwen3_5ForCausalLM"]
    full.setdefault("dtype", "float32")
    return full


def random_model(config: dict | ModelConfig, *, seed: int, mtp: bool, device: str | torch.device, dtype: torch.dtype,
                 exact: bool = False, fuse: bool = True) -> HybridModel:
    """A random model of the architecture `config` (a config.json as a dict, or a parsed one) built directly on
    `device` (no checkpoint on disk; for benchmarks at shapes too large to write out), with the same distributions as
    `save_random_checkpoint`. Same seed, config and device -> the same weights. fuse: join the projections as a
    loaded model does (off in exact mode, and for a caller that converts the weights first)."""
    model_config = config if isinstance(config, ModelConfig) else ModelConfig.from_dict(_full_config(config, mtp=mtp))
    with torch.device("meta"):
        model = HybridModel(model_config, mtp=mtp, exact=exact)
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, t in model.state_dict().items():
        keep_fp32 = name.rsplit(".", 1)[-1] in ("A_log", "dt_bias")
        tensors[name] = _init(name, tuple(t.shape), gen, model_config).to(torch.float32 if keep_fp32 else dtype)
    model.load_state_dict(tensors, strict=True, assign=True)
    model.requires_grad_(False).eval()
    if fuse and not exact:
        model.fuse()
    return model


def _init(name: str, shape: tuple[int, ...], gen: torch.Generator, config: ModelConfig) -> torch.Tensor:
    """One tensor on the generator's device."""
    module = name.rsplit(".", 2)[-2]
    dev = gen.device
    if name.endswith("A_log"):
        return torch.empty(shape, device=dev).uniform_(0.01, 16.0, generator=gen).log()
    if name.endswith("dt_bias"):
        return torch.ones(shape, device=dev)
    if name.endswith("conv1d.weight"):
        bound = 1.0 / math.sqrt(config.linear_conv_kernel_dim)
        return torch.empty(shape, device=dev).uniform_(-bound, bound, generator=gen)
    if name.endswith("linear_attn.norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen, device=dev)
    if "norm" in module:
        return 0.1 * torch.randn(shape, generator=gen, device=dev)
    return 0.02 * torch.randn(shape, generator=gen, device=dev)
