"""The architecture of a Qwen3.5 text model, read from a Hugging Face config.json.

Owns: `ModelConfig` (the frozen shape of the network) and the check that a config.json describes an architecture
ignis runs. Does not own: weights (ignis.model.loader), engine settings (ignis.config).

A missing key means what it means to transformers: the `Qwen3_5TextConfig` default, listed in `HF_DEFAULTS`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ignis.errors import ArtifactError

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
SUPPORTED_ARCHITECTURES = ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM")

# transformers 5.x Qwen3_5TextConfig defaults, for keys a config.json may leave out.
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 248320,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.25,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "tie_word_embeddings": False,
    "max_position_embeddings": 32768,
    "full_attention_interval": 4,
    "hidden_act": "silu",
}

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    mtp_num_hidden_layers: int
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        file = Path(path) / "config.json"
        return cls.from_dict(read_config_json(file, "a model directory holds config.json + safetensors weights"))

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        _check_architecture(d)
        text = d.get("text_config") or {}
        # Nested text_config (Qwen3_5ForConditionalGeneration) wins; the top level fills what it leaves out.
        merged: dict[str, Any] = {**HF_DEFAULTS, **{k: v for k, v in d.items() if k != "text_config"}, **text}
        rope = merged.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise ArtifactError(f"config.json rope_parameters: expected an object, found {rope!r}")
        rope_theta = rope.get("rope_theta", merged.get("rope_theta"))
        partial = rope.get("partial_rotary_factor", merged.get("partial_rotary_factor"))
        n_layers = _int(merged, "num_hidden_layers")
        layer_types = merged.get("layer_types")
        if layer_types is None:
            every = _int(merged, "full_attention_interval")
            layer_types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n_layers)]
        eos = text.get("eos_token_id", d.get("eos_token_id"))
        eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        mtp = merged.get("mtp_num_hidden_layers", merged.get("num_nextn_predict_layers", 0)) or 0
        cfg = cls(
            vocab_size=_int(merged, "vocab_size"),
            hidden_size=_int(merged, "hidden_size"),
            intermediate_size=_int(merged, "intermediate_size"),
            num_hidden_layers=n_layers,
            layer_types=tuple(layer_types),
            num_attention_heads=_int(merged, "num_attention_heads"),
            num_key_value_heads=_int(merged, "num_key_value_heads"),
            head_dim=_int(merged, "head_dim"),
            rms_norm_eps=float(merged["rms_norm_eps"]),
            rope_theta=float(rope_theta if rope_theta is not None else HF_DEFAULTS["rope_theta"]),
            partial_rotary_factor=float(partial if partial is not None else HF_DEFAULTS["partial_rotary_factor"]),
            linear_num_key_heads=_int(merged, "linear_num_key_heads"),
            linear_num_value_heads=_int(merged, "linear_num_value_heads"),
            linear_key_head_dim=_int(merged, "linear_key_head_dim"),
            linear_value_head_dim=_int(merged, "linear_value_head_dim"),
            linear_conv_kernel_dim=_int(merged, "linear_conv_kernel_dim"),
            tie_word_embeddings=bool(merged["tie_word_embeddings"]),
            max_position_embeddings=_int(merged, "max_position_embeddings"),
            mtp_num_hidden_layers=int(mtp),
            eos_token_ids=tuple(int(e) for e in eos_ids),
        )
        cfg._validate(merged)
        return cfg

    def _validate(self, merged: dict[str, Any]) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ArtifactError(
                f"config.json layer_types: {len(self.layer_types)} entries, "
                f"but num_hidden_layers is {self.num_hidden_layers}"
            )
        for t in self.layer_types:
            if t not in LAYER_TYPES:
                raise ArtifactError(f"config.json layer_types: unknown layer type {t!r}; supported: {LAYER_TYPES}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ArtifactError("config.json num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ArtifactError("config.json linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.linear_conv_kernel_dim < 2:
            raise ArtifactError("config.json linear_conv_kernel_dim must be at least 2")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ArtifactError(f"config.json partial_rotary_factor {self.partial_rotary_factor}: bad rotary width")
        if merged.get("hidden_act", "silu") != "silu":
            raise ArtifactError(f"config.json hidden_act {merged['hidden_act']!r}: only 'silu' is supported")
        if merged.get("attention_bias"):
            raise ArtifactError("config.json attention_bias=true is not supported (Qwen3.5 has no biases)")

    # Derived shapes the layers and the cache share.
    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


def _int(d: dict[str, Any], key: str) -> int:
    value = d.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ArtifactError(f"config.json {key}: expected a non-negative integer, found {value!r}")
    return value


def read_config_json(file: Path, missing: str) -> dict[str, Any]:
    """The JSON object in `file`; ArtifactError naming the file when it is absent (with `missing` as the fix),
    unreadable or not an object."""
    if not file.is_file():
        raise ArtifactError(f"{file}: no config.json; {missing}")
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ArtifactError(f"{file}: not readable JSON ({e})") from e
    if not isinstance(data, dict):
        raise ArtifactError(f"{file}: expected a JSON object")
    return data


def _check_architecture(d: dict) -> None:
    model_type = d.get("model_type")
    archs = d.get("architectures") or []
    supported = (
        f"supported: architectures {', '.join(SUPPORTED_ARCHITECTURES)} "
        f"(model_type {', '.join(SUPPORTED_MODEL_TYPES)}), the dense Qwen3.5 text model"
    )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ArtifactError(
            f"config.json model_type {model_type!r} (architectures {archs}) is not supported; {supported}"
        )
    bad = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
    if bad:
        raise ArtifactError(f"config.json architecture {bad[0]!r} is not supported; {supported}")
    text = d.get("text_config") or d
    if text.get("num_experts"):
        raise ArtifactError(f"config.json describes a mixture-of-experts model (num_experts); {supported}")
