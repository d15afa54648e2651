"""The shape of a DFlash-family drafter, read from its config.json (the public DFlash / DFlash2 format).

Owns: `DrafterConfig` (frozen), the `dflash_config`-first lookup every DFlash loader uses, the checks that tie a
drafter to its target (hidden size, vocabulary, tapped layers, mask id), and `drafter_config_json`, the inverse used
by writers. Does not own: tensors (ignis.backends.dflash2.weights) or how the drafter runs (.model).

A key is read from `dflash_config` first and from the top level second, as the reference loader's `_draft_value`
does. `DFlash2DraftModel` adds grouped dynamic convs and a candidate selector (their four keys become required);
`DFlashDraftModel` (v1) has neither. `is_causal` unset means: sliding layers causal inside the block, full ones not.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ignis.errors import ArtifactError
from ignis.model.config import ModelConfig, read_config_json

DFLASH2 = "DFlash2DraftModel"
DFLASH = "DFlashDraftModel"
LAYER_TYPES = ("full_attention", "sliding_attention")
FIRST_DRAFTS = ("", "mtp")  # DrafterConfig.first_draft


@dataclass(frozen=True)
class DrafterConfig:
    variant: str  # DFLASH2 or DFLASH
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rotary_dim: int
    vocab_size: int
    layer_types: tuple[str, ...]
    sliding_window: int | None  # positions a sliding layer sees: key visible iff q_pos - k_pos < window
    causal: tuple[bool, ...]  # per layer: causal inside the block
    block_size: int  # anchor + trained drafts
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    input_embedding_scale: float
    output_multiplier: float
    final_logit_softcapping: float | None
    conv_kernel_size: int  # 0 for v1
    conv_group_size: int  # 0 for v1
    selector_rank: int  # 0 for v1
    selector_top_k: int  # 0 for v1
    # who drafts slot 1: "" the drafter, as every published drafter does; "mtp" the target's MTP layer, and the drafter's
    # block takes that draft as given ([anchor, draft, MASK...]) and drafts slots 2..width (trained so: --first-draft)
    first_draft: str = ""

    @property
    def width(self) -> int:
        """Drafts per round the drafter was trained for."""
        return self.block_size - 1

    @property
    def is_v2(self) -> bool:
        return self.variant == DFLASH2

    @classmethod
    def from_dir(cls, path: Path, target: ModelConfig) -> DrafterConfig:
        file = path / "config.json"
        data = read_config_json(
            file, "spec.backend 'dflash2' needs a DFlash drafter beside the weights (<model>/drafter) or at spec.drafter"
        )
        try:
            return cls.from_dict(data, target)
        except ArtifactError as e:
            raise ArtifactError(f"{file}: {e}") from e

    @classmethod
    def from_dict(cls, d: dict[str, Any], target: ModelConfig) -> DrafterConfig:
        draft = d.get("dflash_config") or {}
        if not isinstance(draft, dict):
            raise ArtifactError(f"dflash_config: expected an object, found {draft!r}")

        def value(name: str, default: Any = None) -> Any:
            return draft.get(name, d.get(name, default))

        archs = d.get("architectures") or []
        if archs and archs[0] not in (DFLASH2, DFLASH):
            raise ArtifactError(f"architectures {archs}: supported drafters are {DFLASH2} and {DFLASH}")
        v2_keys = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
        variant = archs[0] if archs else (DFLASH2 if any(value(k) is not None for k in v2_keys) else DFLASH)
        n_layers = _int(d, "num_hidden_layers", 1)
        hidden = _int(d, "hidden_size", 1)
        heads = _int(d, "num_attention_heads", 1)
        head_dim = d.get("head_dim") or hidden // heads
        layer_types = tuple(d.get("layer_types") or ["full_attention"] * n_layers)
        if len(layer_types) != n_layers or any(t not in LAYER_TYPES for t in layer_types):
            raise ArtifactError(f"layer_types {list(layer_types)}: need {n_layers} entries from {LAYER_TYPES}")
        window = d.get("sliding_window")
        if "sliding_attention" in layer_types and (not isinstance(window, int) or window < 1):
            raise ArtifactError(f"sliding_window {window!r}: sliding_attention layers need a positive integer window")
        is_causal = value("is_causal", value("causal"))
        causal = tuple(t == "sliding_attention" if is_causal is None else bool(is_causal) for t in layer_types)
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ArtifactError(f"rope parameters {rope}: only the default RoPE is supported for drafters")
        rope_theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        partial = float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)))
        layer_ids = value("target_layer_ids")
        if not isinstance(layer_ids, list) or not layer_ids or not all(isinstance(i, int) for i in layer_ids):
            raise ArtifactError(f"dflash_config.target_layer_ids {layer_ids!r}: expected a non-empty list of layer ids")
        softcap = value("final_logit_softcapping")
        v2 = variant == DFLASH2
        cfg = cls(
            variant=variant,
            hidden_size=hidden,
            intermediate_size=_int(d, "intermediate_size", 1),
            num_layers=n_layers,
            num_heads=heads,
            num_kv_heads=_int(d, "num_key_value_heads", 1),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rotary_dim=int(int(head_dim) * partial),
            vocab_size=int(d.get("vocab_size", target.vocab_size)),
            layer_types=layer_types,
            sliding_window=window if "sliding_attention" in layer_types else None,
            causal=causal,
            block_size=int(value("block_size", 16)),
            mask_token_id=_required_int(value("mask_token_id"), "dflash_config.mask_token_id"),
            target_layer_ids=tuple(layer_ids),
            input_embedding_scale=float(value("input_embedding_scale", 1.0)),
            output_multiplier=float(value("output_multiplier", 1.0)),
            final_logit_softcapping=float(softcap) if softcap is not None and float(softcap) > 0 else None,
            conv_kernel_size=_required_int(value("conv_kernel_size"), "dflash_config.conv_kernel_size") if v2 else 0,
            conv_group_size=_required_int(value("conv_group_size"), "dflash_config.conv_group_size") if v2 else 0,
            selector_rank=_required_int(value("selector_rank"), "dflash_config.selector_rank") if v2 else 0,
            selector_top_k=_required_int(value("selector_top_k"), "dflash_config.selector_top_k") if v2 else 0,
            first_draft=str(value("first_draft", "") or ""),
        )
        cfg._check(target)
        return cfg

    def _check(self, target: ModelConfig) -> None:
        if self.first_draft not in FIRST_DRAFTS:
            raise ArtifactError(f"dflash_config.first_draft {self.first_draft!r}: expected one of {list(FIRST_DRAFTS)}")
        if self.first_draft == "mtp" and (not target.mtp_num_hidden_layers or self.block_size < 3):
            raise ArtifactError("dflash_config.first_draft 'mtp' takes slot 1 from the target's MTP layer: the target "
                                "needs one (mtp_num_hidden_layers) and the block at least 3 slots")
        if self.hidden_size != target.hidden_size:
            raise ArtifactError(
                f"hidden_size {self.hidden_size}: the drafter reads the target's embeddings and output head, whose "
                f"width is {target.hidden_size}"
            )
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_hidden_layers]
        if bad:
            raise ArtifactError(
                f"dflash_config.target_layer_ids {list(self.target_layer_ids)}: {bad} outside the target's "
                f"{target.num_hidden_layers} decoder layers (ids are 0-based decoder layers, HF hidden_states[id+1])"
            )
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise ArtifactError(f"dflash_config.mask_token_id {self.mask_token_id}: not a row of the target's "
                                f"{target.vocab_size}-token embedding")
        if self.block_size < 2:
            raise ArtifactError(f"block_size {self.block_size}: a drafter block holds the anchor and at least one draft")
        if self.num_heads % self.num_kv_heads:
            raise ArtifactError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ArtifactError(f"rotary width {self.rotary_dim} (head_dim {self.head_dim}): bad partial_rotary_factor")
        if self.output_multiplier <= 0:
            raise ArtifactError(f"output_multiplier {self.output_multiplier}: must be positive")
        if self.is_v2:
            if self.conv_kernel_size < 1 or self.conv_group_size < 1 or self.hidden_size % self.conv_group_size:
                raise ArtifactError(
                    f"conv_kernel_size {self.conv_kernel_size} / conv_group_size {self.conv_group_size}: need positive "
                    f"values, the group size dividing hidden_size {self.hidden_size}"
                )
            if self.vocab_size < target.vocab_size:
                raise ArtifactError(f"vocab_size {self.vocab_size}: the selector's codebooks need a row for each of "
                                    f"the target's {target.vocab_size} tokens")
            if not 1 <= self.selector_top_k <= target.vocab_size or self.selector_rank < 1:
                raise ArtifactError(f"selector_top_k {self.selector_top_k} / selector_rank {self.selector_rank}: "
                                    "need 1 <= top_k <= vocabulary and rank >= 1")


def drafter_config_json(
    target: ModelConfig,
    *,
    variant: str = DFLASH2,
    num_layers: int = 5,
    intermediate_size: int | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    layer_types: list[str] | None = None,
    sliding_window: int | None = 2048,
    is_causal: bool | None = False,
    block_size: int = 8,
    mask_token_id: int,
    target_layer_ids: list[int],
    rope_theta: float | None = None,
    conv_kernel_size: int = 2,
    conv_group_size: int = 16,
    selector_rank: int = 64,
    selector_top_k: int = 16,
    output_multiplier: float = 1.0,
    final_logit_softcapping: float | None = None,
    first_draft: str = "",
) -> dict[str, Any]:
    """A drafter config.json in the published layout for `target` (sizes default to the target's attention shape)."""
    types = layer_types or ["sliding_attention" if sliding_window else "full_attention"] * num_layers
    dflash: dict[str, Any] = {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)}
    if variant == DFLASH2:
        dflash.update(conv_kernel_size=conv_kernel_size, conv_group_size=conv_group_size, selector_rank=selector_rank,
                      selector_top_k=selector_top_k)
    if output_multiplier != 1.0:
        dflash["output_multiplier"] = output_multiplier
    if final_logit_softcapping:
        dflash["final_logit_softcapping"] = final_logit_softcapping
    if first_draft:
        dflash["first_draft"] = first_draft
    return {
        "architectures": [variant],
        "model_type": "qwen3",
        "block_size": block_size,
        "dflash_config": dflash,
        "num_target_layers": target.num_hidden_layers,
        "hidden_size": target.hidden_size,
        "intermediate_size": intermediate_size or target.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads or target.num_attention_heads,
        "num_key_value_heads": num_kv_heads or target.num_key_value_heads,
        "head_dim": head_dim or target.head_dim,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta or target.rope_theta},
        "layer_types": types,
        "sliding_window": sliding_window if "sliding_attention" in types else None,
        "use_sliding_window": "sliding_attention" in types,
        **({} if is_causal is None else {"is_causal": is_causal}),
        "vocab_size": target.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "hidden_act": "silu",
    }


def _int(d: dict[str, Any], key: str, lo: int) -> int:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ArtifactError(f"{key}: expected an integer >= {lo}, found {v!r}")
    return v


def _required_int(v: Any, key: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ArtifactError(f"{key}: expected an integer, found {v!r}")
    return v
