"""Published 4-bit checkpoints that fit ignis's int4 arithmetic: GPTQ (desc_act false) and AWQ (GEMM), repacked at load.

Owns: reading their `quantization_config` (`published_config`), which stored tensors make up one packed linear
(`stored_names`) and turning them into ignis's layout (`repack`: qweight uint8 [out, in/2] low nibble first, scales
[out, in/group], qzeros uint8 [out, in/group]; ignis.quant.format). Does not own: the model or the files
(ignis.model.loader) or the product (ignis.quant.linear). docs/quantization.md says which layouts fit and why.

Both store, per linear, W[o, c] = (q[c, o] - z[c // group, o]) * s[c // group, o] with:
- GPTQ (AutoGPTQ / GPTQModel, format "gptq" or "gptq_v2"): `qweight` int32 [in / 8, out], eight codes of consecutive
  input columns an int32, lowest nibble first; `qzeros` int32 [in / group, out / 8], eight output columns an int32,
  lowest nibble first, holding z - 1 in the "gptq" format (a historical offset) and z in "gptq_v2"; `scales` fp16
  [in / group, out]; `g_idx` int32 [in], which must be c // group (act-order checkpoints do not fit).
- AWQ (AutoAWQ, version "gemm"): `qweight` int32 [in, out / 8] and `qzeros` int32 [in / group, out / 8], eight output
  columns an int32 in the order 0, 2, 4, 6, 1, 3, 5, 7 (nibble i holds column 8j + AWQ_ORDER[i]); `scales` fp16
  [in / group, out].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ignis.quant.format import GROUPS, pack

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
METHODS = ("gptq", "awq")


@dataclass(frozen=True)
class Published:
    method: str  # "gptq" or "awq"
    group_size: int
    zeros_offset: int  # added to every stored zero point: 1 for the "gptq" format, else 0


def published_config(q: dict[str, Any]) -> Published:
    """A GPTQ or AWQ `quantization_config` -> what the repack needs. Raises ValueError naming the field that does
    not fit ignis's kernel."""
    method = str(q.get("quant_method", "")).lower()
    bits = q.get("bits", q.get("w_bit"))
    group = q.get("group_size", q.get("q_group_size"))
    if bits != 4:
        raise ValueError(f"bits is {bits!r}; ignis reads 4-bit {method} checkpoints")
    if group not in GROUPS:
        raise ValueError(f"group_size is {group!r}; ignis reads groups of {' or '.join(map(str, GROUPS))} columns")
    if method == "gptq":
        if q.get("desc_act"):
            raise ValueError("desc_act is true (act-order): a group's columns are not contiguous, which ignis's "
                             "kernel needs; re-quantize with desc_act false")
        fmt = str(q.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"checkpoint_format is {fmt!r}; ignis reads 'gptq' and 'gptq_v2' (un-permute Marlin or "
                             f"other repacks to GPTQ first)")
        return Published("gptq", int(group), 1 if fmt == "gptq" else 0)
    if method == "awq":
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"version is {version!r}; ignis reads AWQ's 'gemm' layout")
        if q.get("zero_point", True) is False:
            raise ValueError("zero_point is false; ignis reads AWQ checkpoints with zero points")
        return Published("awq", int(group), 0)
    raise ValueError(f"quant_method {method!r} is not one of {', '.join(METHODS)}")


def stored_names(method: str) -> tuple[str, ...]:
    """The tensors a packed linear `P` stores, as suffixes of `P.`: the optional ones last."""
    return ("qweight", "qzeros", "scales", "g_idx") if method == "gptq" else ("qweight", "qzeros", "scales")


def _nibbles(words: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int32 [..., n] -> uint8 [..., 8 n]: nibble i of word j is element 8 j + order[i]."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    parts = torch.stack([(w >> (4 * i)) & 0xF for i in range(8)], dim=-1)  # [..., n, 8]: nibble i
    out = torch.empty_like(parts)
    out[..., list(order)] = parts
    return out.reshape(*words.shape[:-1], -1).to(torch.uint8)


def repack(
    pub: Published, tensors: dict[str, torch.Tensor], out_features: int, in_features: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One linear's stored tensors (by suffix) -> ignis's (qweight uint8 [out, in/2], scales fp16 [out, in/group],
    qzeros uint8 [out, in/group]). Raises ValueError on a shape that does not match the linear."""
    groups = in_features // pub.group_size
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    want = {"qweight": (in_features // 8, out_features) if pub.method == "gptq" else (in_features, out_features // 8),
            "qzeros": (groups, out_features // 8), "scales": (groups, out_features)}
    for name, shape in want.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"{name} has shape {tuple(tensors[name].shape)}, expected {shape} for a "
                             f"{out_features} x {in_features} linear in groups of {pub.group_size}")
    if pub.method == "gptq":
        codes = _nibbles(qweight.t()).t()  # [in, out]: the words run along the input
        zeros = (_nibbles(qzeros).to(torch.int16) + pub.zeros_offset) & 0xF
        g_idx = tensors.get("g_idx")
        if g_idx is not None and not torch.equal(g_idx.to(torch.int64).reshape(-1),
                                                 torch.arange(in_features) // pub.group_size):
            raise ValueError("g_idx is not column // group_size (an act-order checkpoint); ignis's kernel needs "
                             "contiguous groups")
    else:
        codes = _nibbles(qweight, AWQ_ORDER)  # [in, out]
        zeros = _nibbles(qzeros, AWQ_ORDER).to(torch.int16)
    return pack(codes.t().contiguous()), scales.t().contiguous(), zeros.t().contiguous().to(torch.uint8)
