"""The memory plan: what a model directory needs on a device under a config, item by item, against what the device has.

Owns: `memory_plan` (weights, the attention K/V pool, recurrent states, drafter, CUDA-graph and activation scratch,
runtime, headroom), `device_memory` (the profile's `engine.memory_mib`, else the visible CUDA device's total) and
`check_plan`, which refuses a plan that cannot fit before anything is loaded. Does not own: loading (ignis.model,
the backends) or the config rules (ignis.config).

Everything is counted from config.json files on the meta device (no weights are read), with the same classes the
engine allocates, so the numbers are the engine's own: the target from its config.json and quantization_config, the
lane cache from `LaneCache` and `KVPool`, a dflash2 drafter from its config.json and `ContextCache`; with
model.weights = "fp8"
the projections the loader converts count one byte a weight and four a row for the scale. Two items are estimates, and
say so: the scratch of a round (activations and logits of the largest round, and one dequantized weight while
4-bit products use the reference linear) and the runtime (CUDA context, cuBLAS workspace, allocator slack).

The K/V pool is planned as the engine settles it (ignis.engine.defaults.fit_pool): engine.kv_memory when set, else
every lane's whole context, or what the other items leave of the device (GPU_MEMORY_FRACTION of it) when that is
less. A plan fits when its total fits the device and the pool holds at least one lane's whole context; where the
memory left cannot hold even that, the pool is counted as every lane's whole context, so the plan says what the
config asks for.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ignis.config import IgnisConfig
from ignis.config.schema import AUTO
from ignis.errors import ArtifactError, ConfigError
from ignis.model.cache import LaneCache
from ignis.model.pool import PAGE, KVPool
from ignis.model.config import ModelConfig
from ignis.model.model import HybridModel
from ignis.quant.format import QuantConfig, quantized_name
from ignis.quant.fp8 import FP8, Fp8Linear, Fp8Weight, fp8_eligible
from ignis.quant.fp8_checkpoint import Fp8Checkpoint
from ignis.kernels import int4_mma
from ignis.quant.linear import QuantLinear, uses_mma

GIB = 2**30
RUNTIME = int(1.5 * GIB)  # CUDA context (~0.5 GiB), cuBLAS workspaces, allocator fragmentation


@dataclass(frozen=True)
class Item:
    name: str
    nbytes: int
    how: str


@dataclass(frozen=True)
class MemoryPlan:
    model: Path
    weights: str  # the target's format: "int4 (group 128)" or a dtype name
    device: str  # what the capacity is, in words
    capacity: int  # bytes; 0 when unknown (the CPU: host memory is not planned)
    items: tuple[Item, ...]
    kv_room: int = 0  # positions the K/V pool may take (engine.kv_memory's, or the memory left's)
    lane_positions: int = 0  # positions one lane's whole context takes in the pool, with a round's columns

    @property
    def total(self) -> int:
        return sum(i.nbytes for i in self.items)

    @property
    def headroom(self) -> int:
        return self.capacity - self.total

    @property
    def fits(self) -> bool:
        return (self.capacity == 0 or self.headroom >= 0) and self.kv_room >= self.lane_positions

    def render(self) -> str:
        lines = [f"# memory plan: {self.model} ({self.weights} weights) on {self.device}"]
        lines += [f"#   {i.name:<22} {i.nbytes / GIB:8.2f} GiB  {i.how}" for i in self.items]
        lines.append(f"#   {'total':<22} {self.total / GIB:8.2f} GiB")
        if self.capacity:
            verdict = "fits" if self.fits else "DOES NOT FIT"
            lines.append(f"#   {'device':<22} {self.capacity / GIB:8.2f} GiB")
            lines.append(f"#   {'headroom':<22} {self.headroom / GIB:8.2f} GiB  {verdict}")
        return "\n".join(lines) + "\n"


def _dtype(cfg: IgnisConfig, on_cuda: bool) -> torch.dtype:
    if cfg.model.dtype == "auto":
        return torch.bfloat16 if on_cuda else torch.float32
    dtype: torch.dtype = getattr(torch, cfg.model.dtype)
    return dtype


def on_cuda(cfg: IgnisConfig) -> bool:
    """Whether the engine would run on CUDA under `cfg` (auto: when a device is visible)."""
    if cfg.model.device == "auto":
        return torch.cuda.is_available()
    return cfg.model.device.startswith("cuda")


def device_memory(cfg: IgnisConfig) -> tuple[int, str]:
    """(bytes, description) of the memory the plan must fit: engine.memory_mib when set, else the CUDA device the
    engine would use; (0, "cpu") on the CPU."""
    if not on_cuda(cfg):
        return 0, "the CPU (host memory is not planned)"
    stated = cfg.engine.memory_mib * 2**20
    if torch.cuda.is_available():
        index = torch.device(cfg.model.device if cfg.model.device != "auto" else "cuda").index or 0
        props = torch.cuda.get_device_properties(index)
        if not stated or props.total_memory < stated:  # a smaller card than the profile's: the card decides
            return int(props.total_memory), f"{props.name} (cuda:{index}, {props.total_memory // 2**20} MiB)"
    if stated:
        return stated, f"{cfg.engine.memory_mib} MiB (engine.memory_mib)"
    return 0, "a CUDA device (none visible here and engine.memory_mib unset)"


def memory_plan(cfg: IgnisConfig, model_dir: Path) -> MemoryPlan:
    """The plan for serving `model_dir` (only its config.json files are read) under `cfg`.

    `spec.backend = "auto"` is settled as the engine settles it (ignis.engine.defaults.choose_backend); with
    `engine.context = 0` the plan takes the model's max_position_embeddings, or the longest context (a multiple of
    256) one lane can hold in the pool (the engine fits its own at start-up from the memory then free)."""
    from ignis.engine.defaults import CONTEXT_STEP, MIN_FITTED_CONTEXT, choose_backend

    cuda = on_cuda(cfg)
    if cfg.spec.backend == AUTO:
        backend, k, _ = choose_backend(cfg, model_dir, torch.device("cuda" if cuda else "cpu"))
        cfg = dataclasses.replace(cfg, spec=dataclasses.replace(cfg.spec, backend=backend, draft_tokens=k))
    if cfg.spec.backend == "dflash2" and cfg.spec.draft_weights == AUTO:
        # as the engine settles it (ignis.engine.defaults): the greedy copy where the rule makes one and it takes no
        # memory the K/V pool would have had
        plain = memory_plan(with_draft_weights(cfg, "model"), model_dir)
        if not greedy_copy_bytes(cfg, model_dir, ModelConfig.from_dir(model_dir), _dtype(cfg, cuda), cuda):
            return plain
        copied = memory_plan(with_draft_weights(cfg, "int4-greedy"), model_dir)
        pools = [{i.name: i.nbytes for i in p.items}["kv cache"] for p in (plain, copied)]
        same = copied.fits and pools[0] == pools[1] and copied.lane_positions == plain.lane_positions
        return copied if same else plain
    if cfg.engine.context:
        return _plan(cfg, model_dir, fitted=False)
    wanted = ModelConfig.from_dir(model_dir).max_position_embeddings
    plan = _plan(_with_context(cfg, wanted), model_dir, fitted=True)
    if plan.fits:
        return plan
    # One lane's whole context must fit the pool: start from the longest the pool's room holds (the drafter's
    # context cache grows with the context up to its window, so step down from there to the first plan that fits).
    columns = plan.lane_positions - wanted
    context = max(MIN_FITTED_CONTEXT, min(wanted, (plan.kv_room - columns) // CONTEXT_STEP * CONTEXT_STEP))
    plan = _plan(_with_context(cfg, context), model_dir, fitted=True)
    while not plan.fits and context > MIN_FITTED_CONTEXT:
        context -= CONTEXT_STEP
        plan = _plan(_with_context(cfg, context), model_dir, fitted=True)
    return plan


def _with_context(cfg: IgnisConfig, context: int) -> IgnisConfig:
    return dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, context=context))


def _plan(cfg: IgnisConfig, model_dir: Path, *, fitted: bool) -> MemoryPlan:
    cuda = on_cuda(cfg)
    dtype = _dtype(cfg, cuda)
    size = torch.finfo(dtype).bits // 8
    capacity, device = device_memory(cfg)
    fit = "the longest that fits" if capacity else "the model's longest; the engine fits it to memory at start-up"
    raw = json.loads((model_dir / "config.json").read_text())
    config = ModelConfig.from_dir(model_dir)
    quant = QuantConfig.of(raw, model_dir / "config.json")
    text = raw.get("text_config", raw)
    mtp = int(text.get("mtp_num_hidden_layers", 0) or 0) > 0
    fp8 = cfg.model.weights == "fp8" and quant is None  # converted as the model loads (ignis.quant.fp8)
    with torch.device("meta"):
        model = HybridModel(config, mtp=mtp)
        if quant is not None:
            _pack(model, quant.group_size, quant.head)
        if fp8:
            _to_fp8(model)
    weights = sum(_stored_bytes(name, t, size) for name, t in model.state_dict().items())
    if quant is not None and cuda and uses_mma(torch.device("cuda"), dtype):
        weights += _repack_growth(model, quant.group_size)
    act_order = quant is not None and quant.published is not None and quant.published.act_order
    if act_order:  # each act-order linear's held column order, int32 (ignis.quant.published.act_order)
        weights += sum(4 * m.in_features for m in model.modules() if isinstance(m, QuantLinear))
    largest = max((m.out_features * m.in_features for m in model.modules() if isinstance(m, QuantLinear)), default=0)

    ec, k = cfg.engine, cfg.spec.draft_tokens
    cache = LaneCache(config, lanes=ec.lanes, context=ec.context, max_cols=k + 1, device="meta", dtype=dtype)
    recurrent = cache.nbytes() - cache.pool.nbytes()
    head = (", output head too" if quant is not None and quant.head else "") + (", act-order" if act_order else "")
    fmt = (f"int4 (group {quant.group_size}{head})" if quant is not None else "fp8 e4m3 (made at load)" if fp8
           else str(dtype).removeprefix("torch."))
    source = (", read from an FP8 checkpoint" if quant is None and Fp8Checkpoint.of(raw.get("quantization_config"))
              else "")
    items = [
        Item("weights", weights, f"target, {fmt}{source}" + (" with its MTP layer" if mtp else "")),
        Item("recurrent states", recurrent, f"{sum(1 for t in config.layer_types if t != 'full_attention')} Gated "
                                            f"DeltaNet layers x {ec.lanes + 1} lanes, fp32, with the verify record"),
        _drafter(cfg, model_dir, config, dtype, cuda, quantized=quant is not None,
                 head_packed=quant is not None and quant.head),
    ]
    rows = ec.lanes * (k + 1)
    hidden = max(2 * config.intermediate_size, config.conv_dim + config.value_dim, 4 * config.hidden_size)
    scratch = 3 * rows * config.vocab_size * 4 + 4 * rows * hidden * size + largest * size
    how = f"estimate: logits and activations of a {ec.lanes} x {k + 1} round"
    if largest:
        how += ", one dequantized weight (reference 4-bit linear)"
    if cuda:
        items.append(Item("cuda graphs, scratch", scratch, how))
        items.append(Item("runtime", RUNTIME, "estimate: CUDA context, cuBLAS workspace, allocator slack"))
    kv, room, lane = _pool(cfg, config, dtype, capacity, weights, sum(i.nbytes for i in items[1:]), model_dir)
    if fitted:
        kv = dataclasses.replace(kv, how=kv.how + f" (engine.context = 0: {fit})")
    return MemoryPlan(model_dir, fmt, device, capacity, (items[0], kv, *items[1:]), room, lane)


def _pool(cfg: IgnisConfig, config: ModelConfig, dtype: torch.dtype, capacity: int, weights: int, others: int,
          model_dir: Path) -> tuple[Item, int, int]:
    """(the K/V pool's item, positions it may take, positions one lane's whole context takes), as the engine
    settles the pool (ignis.engine.defaults.fit_pool) with `weights` loaded and `others` bytes of other items."""
    from ignis.config import MAX_DRAFT_TOKENS
    from ignis.engine.defaults import GPU_MEMORY_FRACTION, pooled_layers

    ec, k = cfg.engine, cfg.spec.draft_tokens
    layers = sum(1 for t in config.layer_types if t == "full_attention") + pooled_layers(cfg, model_dir)

    def pool(pages: int) -> KVPool:
        made = KVPool(config, lanes=ec.lanes, positions=ec.context + MAX_DRAFT_TOKENS + 1, pages=pages,
                      device="meta", dtype=dtype)
        for _ in range(layers):
            made.layer()
        return made

    page_bytes = pool(1).page_bytes()
    lane_pages = -(-(ec.context + k + 1) // PAGE)
    full = ec.lanes * lane_pages
    if ec.kv_memory:
        room, why = ec.kv_memory // page_bytes, "engine.kv_memory"
    elif capacity:
        left = int(GPU_MEMORY_FRACTION * (capacity - weights - RUNTIME)) - (others - RUNTIME)
        room, why = max(0, left) // page_bytes, "the memory left"
    else:
        room, why = full, "every lane's whole context"
    pages = room if ec.kv_memory else min(full, room) if room >= lane_pages else full
    if pages == full:
        why = f"every lane's whole context: {ec.lanes} lanes x {ec.context + k + 1} positions"
    else:
        why += f", room for {pages // lane_pages} of the {ec.lanes} lanes' whole contexts of {ec.context}"
    made = pool(max(pages, 1))
    item = Item("kv cache", made.nbytes(), f"{layers} attention layers x {pages} pages of {PAGE} positions, {why}")
    return item, room * PAGE, lane_pages * PAGE


def check_plan(cfg: IgnisConfig, model_dir: Path) -> MemoryPlan:
    """The plan, or a ConfigError with its numbers when it cannot fit the device the engine would use."""
    plan = memory_plan(cfg, model_dir)
    if plan.capacity and plan.headroom < 0:
        parts = ", ".join(f"{i.name} {i.nbytes / GIB:.2f}" for i in plan.items)
        raise ConfigError("engine", f"this model and config need {plan.total / GIB:.2f} GiB but {plan.device} has "
                          f"{plan.capacity / GIB:.2f} GiB (GiB: {parts}; headroom {plan.headroom / GIB:.2f}); lower "
                          f"engine.lanes or engine.context, or quantize the weights (ignis quantize); `ignis config "
                          f"show --model` prints the plan")
    if not plan.fits:
        raise ConfigError("engine", f"the K/V pool can take {plan.kv_room} positions, fewer than one lane's whole "
                          f"context ({plan.lane_positions}); lower engine.context, raise engine.kv_memory or use a "
                          f"bigger device; `ignis config show --model` prints the plan")
    return plan


def weights_note(cfg: IgnisConfig, plan: MemoryPlan) -> str:
    """A comment line when the profile was sized for another weight format than the checkpoint holds, else ""."""
    want = cfg.model.weights
    held = ("int4" if plan.weights.startswith("int4") else "fp8" if plan.weights.startswith("fp8")
            else "bf16" if plan.weights == "bfloat16" else plan.weights)
    if want == "auto" or want == held:
        return ""
    fix = "convert it with `ignis quantize`" if want == "int4" else "the plan above counts it as it is"
    return (f"# note: model.weights = {want!r}: this profile was sized for {want} weights; the checkpoint holds "
            f"{plan.weights} ({fix})\n")


def _to_fp8(model: HybridModel) -> None:
    """Put an (empty) Fp8Linear in place of every projection the loader converts to fp8."""
    for name, module in list(model.named_modules()):
        if fp8_eligible(name, module):
            assert isinstance(module, torch.nn.Linear)
            parent, _, attr = name.rpartition(".")
            empty = Fp8Weight(torch.empty(module.weight.shape, dtype=FP8), torch.empty(module.out_features))
            setattr(model.get_submodule(parent), attr, Fp8Linear(empty))


def _pack(model: HybridModel, group: int, head: bool) -> None:
    """Put a QuantLinear in place of every linear `ignis quantize` packs (named as in the checkpoint)."""
    for name, module in list(model.named_modules()):
        stored = f"{name}.weight" if name.startswith("mtp.") else f"model.{name}.weight"
        if isinstance(module, torch.nn.Linear) and quantized_name(stored, tuple(module.weight.shape), group, head):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, QuantLinear(module.in_features, module.out_features, group))


def _repack_growth(model: HybridModel, group: int) -> int:
    """Bytes the loader's repacking for the mma kernel adds (ignis.quant.linear.to_mma): each row and group of a
    projection it takes holds its scale and -(magic + z) in 4 bytes, where the format stores 3."""
    return sum(m.out_features * (m.in_features // group) for m in model.modules()
               if isinstance(m, QuantLinear) and int4_mma.fits(m.out_features, m.in_features, group))


def _stored_bytes(name: str, t: torch.Tensor, size: int) -> int:
    if not t.dtype.is_floating_point or t.dtype == FP8:
        return t.numel() * t.element_size()
    if name.rsplit(".", 1)[-1] in ("A_log", "dt_bias", "fp8_scale"):
        return t.numel() * 4
    return t.numel() * size


def _proposal_head(cfg: IgnisConfig, drafter_dir: Path, target: ModelConfig, dtype: torch.dtype, cuda: bool, *,
                   quantized: bool, head_packed: bool) -> tuple[int, str]:
    """(bytes, head): what the dflash2 drafter's proposal head (or the mtp backend's) holds of its own beside the
    target's, and which head spec.draft_head gives, "auto" resolved as the backend resolves it
    (backends.dflash2.packed_head.resolve)."""
    from ignis.artifact import resolve_exact
    from ignis.backends.dflash2.model import INT4_GROUPS
    from ignis.backends.dflash2.packed_head import auto_int4, head_group, held_bytes
    from ignis.backends.dflash2.weights import SHORTLIST

    size = torch.finfo(dtype).bits // 8
    v, h = target.vocab_size, target.hidden_size
    device = torch.device("cuda" if cuda else "cpu")
    chosen = cfg.spec.draft_head
    if chosen == "auto":
        exact = resolve_exact(cfg, device)
        packed_size = 0 if head_packed else size
        mma = uses_mma(device, dtype)
        chosen = "int4" if auto_int4(v, h, packed_size, mma=mma, exact=exact, quantized=quantized) else "full"
    if chosen == "shortlist":
        return (drafter_dir / SHORTLIST).stat().st_size, chosen
    # a 4-bit copy of a 16-bit head; a hidden size that no group divides is refused at load
    if chosen == "int4" and not head_packed and h % INT4_GROUPS[-1] == 0:
        mma = uses_mma(device, dtype) and int4_mma.fits(v, h, head_group(h))
        return held_bytes(v, h, mma, size), chosen
    return 0, chosen


def proposal_head_bytes(cfg: IgnisConfig, model_dir: Path, target: ModelConfig, dtype: torch.dtype,
                        cuda: bool) -> int:
    """What the dflash2 drafter's proposal head and its greedy copy (or the mtp backend's head) will hold beside the
    target's and the drafter's own weights for `cfg` (a 4-bit copy of a 16-bit head or the shortlist's rows; the 4-bit
    copy of its layers' projections), for the model in `model_dir` as it is stored (4-bit or not, its head too or
    not): memory the engine reserves before it fits the K/V pool (ignis.engine.defaults)."""
    quant = QuantConfig.of(json.loads((model_dir / "config.json").read_text()), model_dir / "config.json")
    path = cfg.spec.drafter_dir(model_dir)
    head, _ = _proposal_head(cfg, path, target, dtype, cuda, quantized=quant is not None,
                             head_packed=quant is not None and quant.head)
    return head + greedy_copy_bytes(cfg, model_dir, target, dtype, cuda)


def with_draft_weights(cfg: IgnisConfig, weights: str) -> IgnisConfig:
    return dataclasses.replace(cfg, spec=dataclasses.replace(cfg.spec, draft_weights=weights))


def greedy_copy_bytes(cfg: IgnisConfig, model_dir: Path, target: ModelConfig, dtype: torch.dtype, cuda: bool) -> int:
    """What the dflash2 drafter's 4-bit copy of its layers' projections holds for `cfg` (0 where it makes none); with
    spec.draft_weights = "auto", the copy its rule makes apart from memory (backends.dflash2.greedy_copy.auto_copy),
    which the engine and `memory_plan` then keep only where the K/V pool loses nothing to it."""
    from ignis.backends.dflash2.config import DrafterConfig
    from ignis.backends.dflash2.weights import expected_shapes

    if cfg.spec.backend != "dflash2" or cfg.spec.draft_weights not in ("int4-greedy", AUTO):
        return 0
    try:
        shapes = expected_shapes(DrafterConfig.from_dir(cfg.spec.drafter_dir(model_dir), target))
    except ArtifactError:  # a drafter that does not fit the target is refused at load, with its reason
        return 0
    return _greedy_copy(cfg, shapes, dtype, cuda)[0]


def _greedy_copy(cfg: IgnisConfig, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
                 cuda: bool) -> tuple[int, str]:
    """(bytes, weights): what the dflash2 drafter's 4-bit copy of its layers' projections holds (0 where it has none)
    for checkpoint tensors of these shapes, and what spec.draft_weights gives, "auto" by its rule apart from memory
    (backends.dflash2.greedy_copy.resolve)."""
    from ignis.artifact import resolve_exact
    from ignis.backends.dflash2.greedy_copy import auto_makes_copy, copy_bytes
    from ignis.backends.dflash2.model import layer_projection

    device = torch.device("cuda" if cuda else "cpu")
    layers = [(s[0], s[1]) for name, s in shapes.items() if layer_projection(name)]
    chosen = cfg.spec.draft_weights
    if chosen == AUTO:
        chosen = "int4-greedy" if auto_makes_copy(layers, device, dtype, resolve_exact(cfg, device)) else "model"
    return (copy_bytes(layers, device, dtype) if chosen == "int4-greedy" else 0), chosen


def _drafter(cfg: IgnisConfig, model_dir: Path, target: ModelConfig, dtype: torch.dtype, cuda: bool, *,
             quantized: bool = False, head_packed: bool = False) -> Item:
    """The drafter's weights and its own cache; quantized: the target's projections are 4-bit; head_packed: its output
    head too (a 4-bit proposal head then reads it, no copy)."""
    ec = cfg.engine
    size = torch.finfo(dtype).bits // 8
    if cfg.spec.backend == "dflash2":
        from ignis.backends.dflash2.config import DrafterConfig
        from ignis.backends.dflash2.context import ContextCache
        from ignis.backends.dflash2.model import INT4_GROUPS, int4_layout
        from ignis.backends.dflash2.model import converted as projection
        from ignis.backends.dflash2.weights import expected_shapes

        path = cfg.spec.drafter_dir(model_dir)
        dcfg = DrafterConfig.from_dir(path, target)
        shapes = expected_shapes(dcfg)
        params = sum(int(torch.Size(s).numel()) for s in shapes.values())
        weights = params * size
        converted = [s for name, s in shapes.items() if projection(name)]
        if cfg.spec.draft_weights == "fp8":  # a byte a converted weight and an fp32 scale a row, not `size` bytes
            weights -= sum(int(torch.Size(s).numel()) * (size - 1) - 4 * s[0] for s in converted)
        elif cfg.spec.draft_weights == "int4":  # DrafterModel.to_int4: half a byte a weight, a scale and a zero a group
            groups, mma = int4_layout(converted, torch.device("cuda" if cuda else "cpu"), dtype)
            groups = [g or INT4_GROUPS[-1] for g in groups]  # a drafter no group divides is refused at load anyway
            held = 4 if mma else size + 1  # in the mma kernel's order: 4 bytes a row and group, not 3
            weights -= sum(out * cols * size - (out * cols // 2 + out * (cols // g) * held)
                           for (out, cols), g in zip(converted, groups, strict=True))
        context = ContextCache(dcfg, lanes=ec.lanes, context=ec.context, device=torch.device("meta"), dtype=dtype)
        head, chosen = _proposal_head(cfg, path, target, dtype, cuda, quantized=quantized, head_packed=head_packed)
        copy, projections = _greedy_copy(cfg, shapes, dtype, cuda)
        form = {"fp8": ", projections in fp8", "int4": ", projections in 4-bit",
                "int4-greedy": ", a 4-bit copy of its layers for greedy rounds"}.get(projections, "")
        form += {"shortlist": ", shortlist head", "int4": ", 4-bit head"}.get(chosen, "")
        return Item("drafter", weights + copy + context.nbytes() + head,
                    f"dflash2, {params / 1e9:.2f} B parameters{form} + its context K/V ({dcfg.num_layers} layers)")
    if cfg.spec.backend == "mtp":
        head, _ = _proposal_head(cfg, model_dir, target, dtype, cuda, quantized=quantized, head_packed=head_packed)
        form = ", the output head in 4 bits" if head else ""
        return Item("drafter", head, f"mtp{form}: its layer's K/V is in the pool (weights are the target's)")
    return Item("drafter", 0, f"spec.backend = {cfg.spec.backend!r}")
