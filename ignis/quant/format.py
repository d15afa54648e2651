"""The ignis int4 format: group-wise asymmetric 4-bit weights with float16 scales and 4-bit zero points.

Owns: which checkpoint tensors are quantized (`quantized_name`), quantizing one weight (`quantize`), unpacking and
dequantizing it (`dequantize`), and the `quantization_config` block of config.json (`QuantConfig`). Does not own:
reading or writing files (ignis.quant.convert, ignis.model.loader) or the matrix product (ignis.quant.linear).

A weight W [out, in] is cut into groups of `group` consecutive input columns per output row. Each group g of row r
has a scale s[r, g] (float16) and a zero point z[r, g] (an integer 0..15), and each weight a code q in 0..15:

    W[r, c] ~= (q[r, c] - z[r, c // group]) * s[r, c // group]

Stored, for a linear whose weight is `P.weight`:
    P.qweight  uint8   [out, in / 2]      byte j of a row holds column 2j in its low nibble, 2j + 1 in its high one
    P.scales   float16 [out, in / group]
    P.qzeros   uint8   [out, in / group]  one zero point a byte (values 0..15)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ignis.errors import ArtifactError

if TYPE_CHECKING:
    from ignis.quant.published import Published

METHOD = "ignis-int4"
BITS = 4
GROUPS = (64, 128)
LEVELS = 2**BITS - 1  # 15: the largest code
SUFFIXES = ("qweight", "scales", "qzeros")
# Projections quantized: the decoder layers' attention, Gated DeltaNet and MLP matrices, which hold almost all of the
# weights and are read once per decode step. Everything else keeps its precision (docs/quantization.md says why).
PROJECTIONS = frozenset({
    "q_proj", "k_proj", "v_proj", "o_proj",  # gated attention
    "in_proj_qkv", "in_proj_z", "out_proj",  # Gated DeltaNet
    "gate_proj", "up_proj", "down_proj",  # MLP
})


@dataclass(frozen=True)
class QuantConfig:
    """The `quantization_config` of a converted checkpoint's config.json, or of a published layout that ignis repacks
    at load (`published`: GPTQ, AWQ or compressed-tensors, ignis.quant.published)."""

    bits: int = BITS
    group_size: int = 128
    published: Published | None = None
    head: bool = False  # the output head (lm_head) is stored packed too (`ignis quantize --head`)

    def __post_init__(self) -> None:
        if self.bits != BITS:
            raise ValueError(f"only {BITS}-bit weights are supported, got bits = {self.bits}")
        if self.group_size not in GROUPS:
            raise ValueError(f"group size must be one of {', '.join(map(str, GROUPS))}, got {self.group_size}")

    def to_json(self) -> dict[str, Any]:
        kept = "embed_tokens, " + ("" if self.head else "lm_head, ")
        return {"quant_method": METHOD, "bits": self.bits, "group_size": self.group_size, "zero_point": True,
                "scale_dtype": "float16", "packing": "uint8, low nibble first", "head": self.head,
                "kept": kept + "norms, in_proj_a, in_proj_b, conv1d, A_log, dt_bias, mtp.*"}

    @staticmethod
    def of(config: dict[str, Any], where: Path) -> QuantConfig | None:
        """The quantization of a config.json dict; None for a checkpoint in its own precision or one whose FP8 weights
        load in the model dtype. Raises ArtifactError for a quantization ignis does not read (another method, bits or
        group)."""
        q = config.get("quantization_config")
        if q is None:
            return None
        from ignis.quant.fp8_checkpoint import Fp8Checkpoint
        from ignis.quant.published import METHODS, published_config

        try:
            if Fp8Checkpoint.of(q) is not None:
                return None  # FP8 weights load in the model dtype (ignis.quant.fp8_checkpoint)
        except ValueError as e:
            raise ArtifactError(f"{where}: quantization_config: {e}") from e

        if isinstance(q, dict) and str(q.get("quant_method", "")).lower() in METHODS:
            try:
                pub = published_config(q)
            except ValueError as e:
                raise ArtifactError(f"{where}: quantization_config: {e}") from e
            return QuantConfig(group_size=pub.group_size, published=pub, head=pub.head)
        if not isinstance(q, dict) or q.get("quant_method") != METHOD:
            method = q.get("quant_method") if isinstance(q, dict) else q
            raise ArtifactError(f"{where}: quantization_config.quant_method is {method!r}; ignis reads {METHOD!r} "
                                f"checkpoints (made by `ignis quantize`), 4-bit GPTQ, AWQ and compressed-tensors ones, "
                                f"FP8 ones (docs/quantization.md) and unquantized ones")
        try:
            return QuantConfig(bits=int(q.get("bits", 0)), group_size=int(q.get("group_size", 0)),
                               head=bool(q.get("head", False)))
        except (TypeError, ValueError) as e:
            raise ArtifactError(f"{where}: quantization_config: {e}") from e

    @staticmethod
    def from_dir(root: Path) -> QuantConfig | None:
        path = root / "config.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ArtifactError(f"{path}: cannot read ({e})") from e
        return QuantConfig.of(config, path)


def quantized_name(name: str, shape: tuple[int, ...], group: int, head: bool = False) -> bool:
    """Whether the checkpoint tensor `name` of `shape` is stored quantized with groups of `group` columns: the
    decoder layers' projections, and with `head` the output head (lm_head) too."""
    if not name.endswith(".weight") or len(shape) != 2 or name.startswith(("mtp.", "model.visual.", "visual.")):
        return False
    module = name.rsplit(".", 2)[-2]
    return (module in PROJECTIONS or (head and module == "lm_head")) and shape[1] % group == 0


def quantize(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [out, in] (any float dtype) -> (qweight uint8 [out, in/2], scales float16 [out, in/group],
    qzeros uint8 [out, in/group]): min-max over each group, widened to include 0 so zeros stay exact."""
    out, cols = weight.shape
    if cols % group:
        raise ValueError(f"{cols} input columns are not a multiple of the group size {group}")
    w = weight.detach().float().reshape(out, cols // group, group)
    lo = w.amin(-1).clamp(max=0.0)
    hi = w.amax(-1).clamp(min=0.0)
    # The scale is rounded up to float16 first (so 15 steps still span the group) and codes are chosen against the
    # scale the reader multiplies by: every weight then comes back within half a step.
    exact = ((hi - lo) / LEVELS).clamp(min=2.0**-14)
    scales = exact.half()
    scales = torch.where(scales.float() < exact, torch.nextafter(scales, torch.full_like(scales, torch.inf)), scales)
    s = scales.float()
    zeros = torch.round(-lo / s).clamp(0, LEVELS)
    codes = (torch.round(w / s[..., None]) + zeros[..., None]).clamp(0, LEVELS).to(torch.uint8).reshape(out, cols)
    return pack(codes), scales, zeros.to(torch.uint8)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [out, in] in 0..15 -> [out, in/2]: column 2j in the low nibble of byte j, 2j + 1 in the high."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack(qweight: torch.Tensor) -> torch.Tensor:
    """qweight uint8 [out, in/2] -> codes uint8 [out, in]."""
    return torch.stack([qweight & 0xF, qweight >> 4], dim=-1).reshape(qweight.shape[0], -1)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight [out, in] in `dtype` that the packed tensors stand for: (q - z) * s, computed in float32."""
    codes = unpack(qweight).float()
    out, cols = codes.shape
    groups = scales.shape[1]
    w = (codes.reshape(out, groups, cols // groups) - qzeros.float()[..., None]) * scales.float()[..., None]
    return w.reshape(out, cols).to(dtype)
