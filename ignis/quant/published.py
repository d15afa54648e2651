"""Published 4-bit checkpoints that fit ignis's int4 arithmetic, repacked at load: GPTQ (desc_act false or true), AWQ
(GEMM) and compressed-tensors' pack-quantized W4A16 (llm-compressor's output, which vLLM reads).

Owns: reading their `quantization_config` (`published_config`), which stored tensors make up one packed linear
(`stored_names`, `codes_name`) and turning them into ignis's layout (`repack`: qweight uint8 [out, in/2] low nibble
first, scales [out, in/group], qzeros uint8 [out, in/group]; ignis.quant.format), with the input columns in group
order where an act-order checkpoint stored them otherwise (`act_order`). Does not own: the model or the files
(ignis.model.loader) or the product (ignis.quant.linear). docs/quantization.md says which layouts fit and why.

All store, per linear, W[o, c] = (q[c, o] - z[c // group, o]) * s[c // group, o] with:
- GPTQ (AutoGPTQ / GPTQModel, format "gptq" or "gptq_v2"): `qweight` int32 [in / 8, out], eight codes of consecutive
  input columns an int32, lowest nibble first; `qzeros` int32 [in / group, out / 8], eight output columns an int32,
  lowest nibble first, holding z - 1 in the "gptq" format (a historical offset) and z in "gptq_v2"; `scales` fp16
  [in / group, out]; `g_idx` int32 [in], c // group, or with desc_act (act-order) any assignment of `group` columns
  to each group: column c is then in group g_idx[c] (the `group` in place of c // group above).
- AWQ (AutoAWQ, version "gemm"): `qweight` int32 [in, out / 8] and `qzeros` int32 [in / group, out / 8], eight output
  columns an int32 in the order 0, 2, 4, 6, 1, 3, 5, 7 (nibble i holds column 8j + AWQ_ORDER[i]); `scales` fp16
  [in / group, out].
- compressed-tensors ("pack-quantized" format, weights int, 4 bits, strategy "group", no activation quantization):
  `weight_packed` int32 [out, in / 8], eight input columns an int32, lowest nibble first, each code stored as q + 8
  for its signed q in -8..7; `weight_scale` [out, in / group]; `weight_zero_point` int32 [out / 8, in / group], eight
  output rows an int32 along the output, lowest nibble first, z + 8 for its signed z (asymmetric schemes only: a
  symmetric one stores none, z = 0); `weight_shape` [out, in]. In unsigned terms that is (q - z) with z = 8 where
  symmetric, the format's own arithmetic. With `actorder` "group" a `weight_g_idx` [in] assigns the columns to groups
  as GPTQ's g_idx does.

An act-order linear is held with its input columns sorted by group (a stable sort, so each group's columns keep their
order): the codes' columns are moved, the scales and zero points stay, and the product takes x's columns in the same
order first (ignis.quant.linear.Permuted), as vLLM's Marlin kernels do for these checkpoints.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from ignis.quant.format import GROUPS, pack

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
COMPRESSED = "compressed-tensors"
METHODS = ("gptq", "awq", COMPRESSED)
# compressed-tensors' preset names that a config group may hold instead of a scheme: (symmetric, group size)
PRESETS = {"W4A16": (True, 128), "W4A16_ASYM": (False, 128)}


@dataclass(frozen=True)
class Published:
    method: str  # one of METHODS
    group_size: int
    zeros_offset: int  # added to every stored zero point: 1 for the "gptq" format, else 0
    symmetric: bool = False  # no zero points stored: z is the middle code, 8 (compressed-tensors' symmetric schemes)
    head: bool = False  # the output head (lm_head) is stored packed too
    act_order: bool = False  # the config says columns are assigned to groups by a stored g_idx (desc_act, actorder)


def published_config(q: dict[str, Any]) -> Published:
    """A GPTQ, AWQ or compressed-tensors `quantization_config` -> what the repack needs. Raises ValueError naming the
    field that does not fit ignis's kernel."""
    method = str(q.get("quant_method", "")).lower()
    if method == COMPRESSED:
        return _compressed_tensors(q)
    bits = q.get("bits", q.get("w_bit"))
    group = q.get("group_size", q.get("q_group_size"))
    if bits != 4:
        raise ValueError(f"bits is {bits!r}; ignis reads 4-bit {method} checkpoints")
    if group not in GROUPS:
        raise ValueError(f"group_size is {group!r}; ignis reads groups of {' or '.join(map(str, GROUPS))} columns")
    if method == "gptq":
        fmt = str(q.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"checkpoint_format is {fmt!r}; ignis reads 'gptq' and 'gptq_v2' (un-permute Marlin or "
                             f"other repacks to GPTQ first)")
        return Published("gptq", int(group), 1 if fmt == "gptq" else 0, head=bool(q.get("lm_head", False)),
                         act_order=bool(q.get("desc_act", False)))
    if method == "awq":
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"version is {version!r}; ignis reads AWQ's 'gemm' layout")
        if q.get("zero_point", True) is False:
            raise ValueError("zero_point is false; ignis reads AWQ checkpoints with zero points")
        return Published("awq", int(group), 0)
    raise ValueError(f"quant_method {method!r} is not one of {', '.join(METHODS)}")


def _compressed_tensors(q: dict[str, Any]) -> Published:
    """compressed-tensors' config (as its ModelCompressor writes it into config.json) -> what the repack needs: every
    config group a pack-quantized W4A16 scheme, all of one group size and symmetry."""
    if q.get("quantization_status") != "compressed":
        raise ValueError(f"quantization_status is {q.get('quantization_status')!r}; ignis reads 'compressed' "
                         f"checkpoints, whose weights are stored packed")
    for field in ("transform_config", "sparsity_config"):
        if q.get(field):
            raise ValueError(f"{field} is set; ignis reads compressed-tensors checkpoints without transforms or "
                             f"sparsity (plain pack-quantized weights)")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError("config_groups is empty; ignis reads one or more pack-quantized W4A16 schemes")
    kinds: set[tuple[bool, int]] = set()
    targets: list[str] = []
    act_order = False
    for name, scheme in groups.items():
        if isinstance(scheme, list):  # a preset's name and its targets
            if name.upper() not in PRESETS:
                raise ValueError(f"config_groups.{name} is the preset {name!r}; ignis reads {' and '.join(PRESETS)}")
            kinds.add(PRESETS[name.upper()])
            targets += scheme
            continue
        symmetric, group, ordered = _scheme(f"config_groups.{name}", scheme, q.get("format"))
        kinds.add((symmetric, group))
        act_order |= ordered
        targets += scheme.get("targets") or []
    if len(kinds) > 1:
        raise ValueError(f"config_groups mix schemes ({sorted(kinds)} as (symmetric, group_size)); ignis reads one "
                         f"scheme for every packed linear")
    (symmetric, group), = kinds
    ignored = q.get("ignore") or []
    head = any(_matches(t, "lm_head") for t in targets) and not any(_matches(i, "lm_head") for i in ignored)
    return Published(COMPRESSED, group, 0, symmetric=symmetric, head=head, act_order=act_order)


def _scheme(where: str, scheme: Any, fmt: Any) -> tuple[bool, int, bool]:
    """One config group's scheme -> (symmetric, group size, act-order groups); ValueError naming the field where it
    does not fit."""
    if not isinstance(scheme, dict):
        raise ValueError(f"{where} is {scheme!r}, not a quantization scheme")
    fmt = scheme.get("format") or fmt
    if fmt != "pack-quantized":
        raise ValueError(f"{where}.format is {fmt!r}; ignis reads 'pack-quantized' 4-bit integer weights")
    for part in ("input_activations", "output_activations"):
        if scheme.get(part) is not None:
            raise ValueError(f"{where}.{part} is set; ignis reads weight-only schemes (W4A16): its kernel "
                             f"multiplies unquantized activations")
    w = scheme.get("weights") or {}
    for field, want in {"type": "int", "num_bits": 4, "strategy": "group"}.items():
        if w.get(field) != want:
            raise ValueError(f"{where}.weights.{field} is {w.get(field)!r}; ignis reads {want!r}")
    if w.get("group_size") not in GROUPS:
        raise ValueError(f"{where}.weights.group_size is {w.get('group_size')!r}; ignis reads groups of "
                         f"{' or '.join(map(str, GROUPS))} columns")
    if w.get("dynamic"):
        raise ValueError(f"{where}.weights.dynamic is {w.get('dynamic')!r}; ignis reads stored scales")
    order = w.get("actorder")
    if order not in (None, False, True, "group", "dynamic", "weight", "static"):
        raise ValueError(f"{where}.weights.actorder is {order!r}; ignis reads 'group' (a stored weight_g_idx), "
                         f"'weight' and none")
    return bool(w.get("symmetric", True)), int(w["group_size"]), order in (True, "group", "dynamic")


def _matches(target: str, module: str) -> bool:
    """Whether a compressed-tensors target or ignore entry names `module`, a linear: its name, a "re:" pattern
    matching it, or the class "Linear"."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target in (module, "Linear")


def codes_name(method: str) -> str:
    """The stored tensor that marks a linear as packed, as a suffix of its name."""
    return "weight_packed" if method == COMPRESSED else "qweight"


def stored_names(pub: Published) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The tensors a packed linear `P` stores, as suffixes of `P.`: (those it must hold, those it may)."""
    if pub.method == COMPRESSED:
        required = ("weight_packed", "weight_scale") + (() if pub.symmetric else ("weight_zero_point",))
        return required, ("weight_shape", "weight_g_idx")
    if pub.method == "gptq":
        return ("qweight", "qzeros", "scales"), ("g_idx",)
    return ("qweight", "qzeros", "scales"), ()


def _nibbles(words: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int32 [..., n] -> uint8 [..., 8 n]: nibble i of word j is element 8 j + order[i]."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    parts = torch.stack([(w >> (4 * i)) & 0xF for i in range(8)], dim=-1)  # [..., n, 8]: nibble i
    out = torch.empty_like(parts)
    out[..., list(order)] = parts
    return out.reshape(*words.shape[:-1], -1).to(torch.uint8)


def repack(
    pub: Published, tensors: dict[str, torch.Tensor], out_features: int, in_features: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One linear's stored tensors (by suffix) -> ignis's (qweight uint8 [out, in/2], scales fp16 [out, in/group],
    qzeros uint8 [out, in/group]) and, for an act-order linear, the order its input columns are held in (`act_order`;
    else None). Raises ValueError on a shape that does not match the linear or a group index that does not fit."""
    if pub.method == COMPRESSED:
        return _repack_compressed(pub, tensors, out_features, in_features)
    groups = in_features // pub.group_size
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    want = {"qweight": (in_features // 8, out_features) if pub.method == "gptq" else (in_features, out_features // 8),
            "qzeros": (groups, out_features // 8), "scales": (groups, out_features)}
    for name, shape in want.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"{name} has shape {tuple(tensors[name].shape)}, expected {shape} for a "
                             f"{out_features} x {in_features} linear in groups of {pub.group_size}")
    order = None
    if pub.method == "gptq":
        codes = _nibbles(qweight.t()).t()  # [in, out]: the words run along the input
        zeros = (_nibbles(qzeros).to(torch.int16) + pub.zeros_offset) & 0xF
        order = act_order(tensors.get("g_idx"), "g_idx", in_features, pub.group_size)
        if order is not None:
            codes = codes[order.long()]
    else:
        codes = _nibbles(qweight, AWQ_ORDER)  # [in, out]
        zeros = _nibbles(qzeros, AWQ_ORDER).to(torch.int16)
    return pack(codes.t().contiguous()), scales.t().contiguous(), zeros.t().contiguous().to(torch.uint8), order


def _repack_compressed(
    pub: Published, tensors: dict[str, torch.Tensor], out_features: int, in_features: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    groups = in_features // pub.group_size
    want = {"weight_packed": (out_features, in_features // 8), "weight_scale": (out_features, groups),
            "weight_zero_point": (out_features // 8, groups)}
    for name, shape in want.items():
        if name in tensors and tuple(tensors[name].shape) != shape:
            raise ValueError(f"{name} has shape {tuple(tensors[name].shape)}, expected {shape} for a "
                             f"{out_features} x {in_features} linear in groups of {pub.group_size}")
    stated = tensors.get("weight_shape")
    if stated is not None and stated.reshape(-1).tolist() != [out_features, in_features]:
        raise ValueError(f"weight_shape is {stated.reshape(-1).tolist()}, expected [{out_features}, {in_features}]")
    order = act_order(tensors.get("weight_g_idx"), "weight_g_idx", in_features, pub.group_size)
    codes = _nibbles(tensors["weight_packed"])  # [out, in]: q + 8, the words along the input
    if order is not None:
        codes = codes[:, order.long()]
    if pub.symmetric:
        zeros = torch.full((out_features, groups), 8, dtype=torch.uint8)
    else:
        zeros = _nibbles(tensors["weight_zero_point"].t()).t()  # [out, groups]: z + 8, the words along the output
    return pack(codes.contiguous()), tensors["weight_scale"].contiguous(), zeros.contiguous(), order


def act_order(g_idx: torch.Tensor | None, name: str, in_features: int, group: int) -> torch.Tensor | None:
    """The order in which a linear's input columns are held, int32 [in]: held column j is the checkpoint's column
    order[j], so that each group's columns are contiguous (j // group), as the kernel reads them; None where they
    already are (no g_idx, or column // group). ValueError where the index does not give every group `group` columns.
    """
    if g_idx is None:
        return None
    g = g_idx.to(torch.int64).reshape(-1)
    groups = in_features // group
    if g.numel() != in_features:
        raise ValueError(f"{name} has {g.numel()} entries, expected one for each of the {in_features} input columns")
    if torch.equal(g, torch.arange(in_features) // group):
        return None
    if int(g.min()) < 0 or int(g.max()) >= groups:
        raise ValueError(f"{name} holds groups {int(g.min())}..{int(g.max())}, outside 0..{groups - 1}")
    sizes = torch.bincount(g, minlength=groups)
    if not bool((sizes == group).all()):
        bad = int(torch.nonzero(sizes != group)[0])
        raise ValueError(f"{name} gives group {bad} {int(sizes[bad])} columns; ignis reads groups of group_size "
                         f"({group}) columns each")
    return torch.argsort(g, stable=True).to(torch.int32)
