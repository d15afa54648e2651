"""FP8 checkpoints, read in the model's dtype: Qwen's and DeepSeek's block-scaled e4m3 (`quant_method: "fp8"`,
`weight_block_size`), vLLM's per-tensor or per-channel fp8, and compressed-tensors' `float-quantized` FP8 weights.

Owns: recognising them from `quantization_config` (`Fp8Checkpoint.of`, which refuses the variants it cannot read,
naming the field), the stored scale of a weight (`scale_name`) and the dequantization (`dequantize`). Does not own:
reading files (ignis.model.loader, ignis.quant.convert) or ignis's own FP8 weights (ignis.quant.fp8, which
`model.weights = "fp8"` makes from what this module reads).

Every such linear stores its e4m3 codes as `P.weight` and one scale tensor beside it, which the codes multiply:
W[o, c] = weight[o, c] * s, with s one number, one per output row ([out] or [out, 1]), or one per block of
block[0] rows x block[1] columns ([ceil(out / block[0]), ceil(in / block[1])], the last blocks partial), named
`P.weight_scale_inv` (the block-scaled releases: the name is historical, it is multiplied) or `P.weight_scale`.
Activation scales (`input_scale`, `activation_scale`) are not read: ignis multiplies unquantized activations.

Why they are read rather than refused: the 27B's FP8 release is half the download of its bf16 one, and an H200 user
reaches for it first. Its weights load as the model dtype (what transformers does without an FP8 GPU); with
`model.weights = "fp8"` they then become ignis's per-channel FP8 (ignis.quant.fp8), and `ignis quantize` turns them
into 4 bits.
"""

from __future__ import annotations

import json
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SCALE_NAMES = ("weight_scale_inv", "weight_scale")  # the scale of `P.weight`, as `P.<name>`, in the order looked for
STORED_FP8 = ("F8_E4M3",)  # safetensors' name of the stored dtype


@dataclass(frozen=True)
class Fp8Checkpoint:
    """How a checkpoint stores its FP8 weights: `block` (rows, columns) a scale covers, or None for per-tensor or
    per-channel scales (read from the scale's shape)."""

    block: tuple[int, int] | None

    @staticmethod
    def of(q: Any) -> Fp8Checkpoint | None:
        """The FP8 storage a `quantization_config` describes; None for any other quantization (or none). Raises
        ValueError naming the field for an FP8 variant ignis does not read."""
        if not isinstance(q, dict):
            return None
        method = str(q.get("quant_method", "")).lower()
        if method == "fp8":
            fmt = str(q.get("fmt", "e4m3")).lower()
            if fmt != "e4m3":
                raise ValueError(f"fmt is {fmt!r}; ignis reads e4m3 FP8 weights")
            block = q.get("weight_block_size")
            if block is None:
                return Fp8Checkpoint(None)
            if (not isinstance(block, list | tuple) or len(block) != 2
                    or not all(isinstance(b, int) and b > 0 for b in block)):
                raise ValueError(f"weight_block_size is {block!r}; ignis reads [rows, columns] of positive ints")
            return Fp8Checkpoint((int(block[0]), int(block[1])))
        if method == "compressed-tensors" and _float_quantized(q):
            return _compressed_fp8(q)
        return None

    @staticmethod
    def from_dir(root: Path) -> Fp8Checkpoint | None:
        """`of` the config.json in `root` (which the caller has read and checked already)."""
        return Fp8Checkpoint.of(json.loads((root / "config.json").read_text()).get("quantization_config"))


def _float_quantized(q: dict[str, Any]) -> bool:
    """Whether a compressed-tensors config stores weights as floats (its FP8 formats) rather than packed ints."""
    groups = q.get("config_groups")
    return isinstance(groups, dict) and any(
        isinstance(s, dict) and (s.get("weights") or {}).get("type") == "float" for s in groups.values())


def _compressed_fp8(q: dict[str, Any]) -> Fp8Checkpoint:
    if q.get("quantization_status") != "compressed":
        raise ValueError(f"quantization_status is {q.get('quantization_status')!r}; ignis reads 'compressed' "
                         f"checkpoints")
    blocks = set()
    for name, scheme in q["config_groups"].items():
        where = f"config_groups.{name}"
        if not isinstance(scheme, dict):
            raise ValueError(f"{where} is {scheme!r} beside FP8 schemes; ignis reads one weight format a checkpoint")
        fmt = scheme.get("format") or q.get("format")
        if fmt != "float-quantized":
            raise ValueError(f"{where}.format is {fmt!r}; ignis reads FP8 weights stored 'float-quantized', and one "
                             f"weight format a checkpoint")
        w = scheme.get("weights") or {}
        for field, want in {"type": "float", "num_bits": 8}.items():
            if w.get(field) != want:
                raise ValueError(f"{where}.weights.{field} is {w.get(field)!r}; ignis reads FP8 weights ({want!r}), "
                                 f"one weight format a checkpoint")
        strategy = w.get("strategy")
        if strategy not in ("tensor", "channel", "block"):
            raise ValueError(f"{where}.weights.strategy is {strategy!r}; ignis reads FP8 weights scaled by tensor, "
                             f"channel or block")
        block = w.get("block_structure")
        blocks.add(tuple(block) if strategy == "block" and isinstance(block, list | tuple) else None)
    if len(blocks) > 1:
        raise ValueError(f"config_groups mix block structures ({', '.join(map(str, blocks))})")
    (block,) = blocks
    return Fp8Checkpoint(None if block is None else (int(block[0]), int(block[1])))


def scale_name(weight: str, held: Container[str]) -> str:
    """The name of the stored FP8 weight `weight`'s scale among the names `held` (`P.weight_scale_inv`, else
    `P.weight_scale`); ValueError where it has none."""
    stem = weight.removesuffix(".weight")
    names = [f"{stem}.{name}" for name in SCALE_NAMES]
    found = next((n for n in names if n in held), None)
    if found is None:
        raise ValueError(f"{weight} is stored in FP8 but has no {' or '.join(names)} to scale it by")
    return found


def dequantize(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               dtype: torch.dtype) -> torch.Tensor:
    """codes [out, in] e4m3 and their scale -> the weight in `dtype`: codes * scale in fp32, rounded once. The scale
    is one number, one per row ([out] or [out, 1]) or one per block ([ceil(out / b0), ceil(in / b1)], `block` or
    else the largest blocks that the grid's shape allows). Raises ValueError where the scale's shape fits none."""
    out, cols = codes.shape
    s = scale.float()
    if s.numel() == 1:
        return (codes.float() * s.reshape(())).to(dtype)
    if s.shape in ((out,), (out, 1)):
        return (codes.float() * s.reshape(out, 1)).to(dtype)
    if s.ndim != 2:
        raise ValueError(f"a scale of shape {tuple(s.shape)} fits no FP8 weight of shape {(out, cols)}")
    b0, b1 = block if block is not None else (-(-out // s.shape[0]), -(-cols // s.shape[1]))
    if s.shape != (-(-out // b0), -(-cols // b1)):
        raise ValueError(f"a block scale of shape {tuple(s.shape)} does not cover a {out} x {cols} weight in "
                         f"blocks of {b0} x {b1}")
    full = s.repeat_interleave(b0, dim=0)[:out].repeat_interleave(b1, dim=1)[:, :cols]
    return (codes.float() * full).to(dtype)
