"""GPTQ, AWQ and compressed-tensors checkpoints load into ignis's int4 layout: the same codes, scales and zero points
written in each published layout (packed here the way AutoGPTQ and AutoAWQ pack them, and by compressed-tensors' own
compressor and config writer) give a model equal to the ignis-int4 one, and layouts that do not fit are refused with
the field named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tiny import tiny_checkpoint

from ignis.cli import main
from ignis.errors import ArtifactError
from ignis.model.batch import Batch, Segment
from ignis.model.cache import LaneCache
from ignis.model.loader import load_model
from ignis.model.model import HybridModel
from ignis.quant.format import unpack
from ignis.quant.linear import QuantLinear

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's order_map for 4 bits


def _words(nibbles: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """[..., 8 n] values 0..15 -> int32 [..., n]: word j gets element 8 j + order[i] in bits 4 i .. 4 i + 3."""
    x = nibbles.to(torch.int64).reshape(*nibbles.shape[:-1], -1, 8)
    word = torch.zeros(x.shape[:-1], dtype=torch.int64)
    for i, col in enumerate(order):
        word |= x[..., col] << (4 * i)
    return (word - ((word >> 31) << 32)).to(torch.int32)  # as the signed int32 the packers store


def _gptq(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int, v2: bool
) -> dict[str, torch.Tensor]:
    """codes [out, in], scales [out, in/group] fp16, zeros [out, in/group] -> GPTQ's tensors (qweight along the
    input)."""
    stored_zeros = zeros.to(torch.int64) if v2 else (zeros.to(torch.int64) - 1) & 0xF  # v1 stores z - 1
    return {"qweight": _words(codes).t().contiguous(), "qzeros": _words(stored_zeros.t().contiguous()),
            "scales": scales.t().contiguous(),
            "g_idx": (torch.arange(codes.shape[1]) // group).to(torch.int32)}


def _awq(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same as AutoAWQ's GEMM layout: words along the output in AWQ_ORDER."""
    return {"qweight": _words(codes.t().contiguous(), AWQ_ORDER), "qzeros": _words(zeros.t().contiguous(), AWQ_ORDER),
            "scales": scales.t().contiguous()}


def _compressed(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                symmetric: bool) -> dict[str, torch.Tensor]:
    """compressed-tensors' pack-quantized tensors of a linear, made by its own compressor from the weight the codes
    stand for, (q - z) * s (exact in fp32), its scales and its signed zero points (z - 8)."""
    from compressed_tensors.compressors import PackedQuantizationCompressor

    weight = (codes.float() - zeros.float().repeat_interleave(group, 1)) * scales.float().repeat_interleave(group, 1)
    state = {"weight": weight, "weight_scale": scales, "weight_zero_point": (zeros.to(torch.int16) - 8).to(torch.int8)}
    return dict(PackedQuantizationCompressor.compress(state, _scheme(group, symmetric)))


def _scheme(group: int, symmetric: bool):  # type: ignore[no-untyped-def]
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=4, type="int", symmetric=symmetric,
                                                                           strategy="group", group_size=group))


def _compressed_config(dst: Path, group: int, symmetric: bool) -> None:
    """compressed-tensors' own writer puts its quantization_config into dst/config.json, as llm-compressor saves."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig(config_groups={"group_0": _scheme(group, symmetric)}, format="pack-quantized",
                                quantization_status="compressed", ignore=["lm_head"])
    ModelCompressor(quantization_config=config).update_config(str(dst))


def packed_linears(path: Path) -> tuple[dict[str, torch.Tensor],
                                         dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """An ignis-int4 safetensors file -> (its tensors that are not a packed linear's, and for each packed linear by
    its stored name's stem, its codes [out, in], scales and zero points)."""
    with safe_open(str(path), "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
    stems = [n.removesuffix(".qweight") for n in tensors if n.endswith(".qweight")]
    linears = {s: (unpack(tensors[f"{s}.qweight"]), tensors[f"{s}.scales"], tensors[f"{s}.qzeros"]) for s in stems}
    parts = {f"{s}.{suffix}" for s in stems for suffix in ("qweight", "scales", "qzeros")}
    return {n: t for n, t in tensors.items() if n not in parts}, linears


def _relayout(src: Path, dst: Path, quant: dict[str, object] | None, layout: str) -> None:
    """Copy the ignis-int4 checkpoint `src` to `dst` with every packed linear rewritten in a published layout (for
    compressed-tensors, "ct" or "ct-sym", its quantization_config as that library writes it)."""
    shutil.copytree(src, dst)
    config = json.loads((src / "config.json").read_text())
    group = int(config["quantization_config"]["group_size"])
    config["quantization_config"] = quant
    if quant is None:
        del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    if layout.startswith("ct"):
        _compressed_config(dst, group, symmetric=layout == "ct-sym")
    out, linears = packed_linears(src / "model.safetensors")
    for stem, (codes, scales, zeros) in linears.items():
        if layout.startswith("ct"):
            packed = _compressed(codes, scales, zeros, group, symmetric=layout == "ct-sym")
        elif layout == "awq":
            packed = _awq(codes, scales, zeros)
        else:
            packed = _gptq(codes, scales, zeros, group, layout == "v2")
        out |= {f"{stem}.{k}": v for k, v in packed.items()}
    (dst / "model.safetensors").unlink()
    (dst / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(out, str(dst / "model.safetensors"))


@pytest.fixture(scope="module")
def int4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("published")
    src = tiny_checkpoint(root / "src", seed=7, mtp=True)
    assert main(["quantize", str(src), str(root / "int4"), "--group", "64"]) == 0
    return root / "int4"


@pytest.fixture(scope="module")
def int4_symmetric(int4: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same checkpoint with every zero point the middle code, 8: what a symmetric scheme stores without them."""
    dst = tmp_path_factory.mktemp("symmetric") / "int4"
    shutil.copytree(int4, dst)
    with safe_open(str(int4 / "model.safetensors"), "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
    save_file({n: torch.full_like(t, 8) if n.endswith(".qzeros") else t for n, t in tensors.items()},
              str(dst / "model.safetensors"))
    return dst


def _logits(model: HybridModel) -> torch.Tensor:
    ids = torch.arange(3, 30)
    n = len(ids)
    cache = LaneCache(model.config, lanes=1, context=n + 8, max_cols=1, device="cpu", dtype=torch.float32)
    return model(Batch(ids, torch.arange(n), (Segment(0, 0, 0, n),), torch.arange(n)), cache).logits


@pytest.mark.parametrize("layout", ["v1", "v2", "awq"])
def test_a_published_layout_loads_to_the_same_model(int4: Path, tmp_path: Path, layout: str) -> None:
    quant: dict[str, object] = (
        {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"} if layout == "awq"
        else {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False, "sym": False,
              "checkpoint_format": "gptq_v2" if layout == "v2" else "gptq"})
    _relayout(int4, tmp_path / layout, quant, layout)
    ours = load_model(int4, device="cpu", dtype=torch.float32, exact=True)
    theirs = load_model(tmp_path / layout, device="cpu", dtype=torch.float32, exact=True)
    for (name, a), (_, b) in zip(ours.named_modules(), theirs.named_modules(), strict=True):
        if isinstance(a, QuantLinear):
            assert isinstance(b, QuantLinear), name
            for buf in ("qweight", "scales", "qzeros"):
                assert torch.equal(getattr(a, buf), getattr(b, buf)), f"{name}.{buf}"
    assert torch.equal(_logits(ours), _logits(theirs))


@pytest.mark.parametrize("symmetric", [False, True], ids=["asymmetric", "symmetric"])
def test_a_compressed_tensors_checkpoint_loads_to_the_same_model(int4: Path, int4_symmetric: Path, tmp_path: Path,
                                                                 symmetric: bool) -> None:
    """llm-compressor's W4A16 output (pack-quantized, groups of 64; symmetric schemes store no zero points): packed by
    compressed-tensors' own compressor, its config written by its own writer."""
    src = int4_symmetric if symmetric else int4
    layout = "ct-sym" if symmetric else "ct"
    _relayout(src, tmp_path / layout, None, layout)
    with safe_open(str(tmp_path / layout / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert any(n.endswith(".weight_packed") for n in names) and not any(n.endswith(".qweight") for n in names)
    assert any(n.endswith(".weight_zero_point") for n in names) != symmetric
    ours = load_model(src, device="cpu", dtype=torch.float32, exact=True)
    theirs = load_model(tmp_path / layout, device="cpu", dtype=torch.float32, exact=True)
    packed = 0
    for (name, a), (_, b) in zip(ours.named_modules(), theirs.named_modules(), strict=True):
        if isinstance(a, QuantLinear):
            assert isinstance(b, QuantLinear), name
            packed += 1
            for buf in ("qweight", "scales", "qzeros"):
                assert torch.equal(getattr(a, buf), getattr(b, buf)), f"{name}.{buf}"
    assert packed and torch.equal(_logits(ours), _logits(theirs))
    from ignis.config import load_config
    from ignis.plan import memory_plan

    plan = memory_plan(load_config(profile="cpu"), tmp_path / layout)  # the plan counts what the load holds
    assert {i.name: i.nbytes for i in plan.items}["weights"] == sum(t.nbytes for t in theirs.state_dict().values())


def test_a_checkpoint_that_packs_the_mtp_layer_drafts_through_it(int4: Path, tmp_path: Path) -> None:
    """A published checkpoint may pack the MTP layer's linears too (`ignis quantize` keeps them): they load packed,
    and mtp's drafts on the device round (the layer's `decode`) leave greedy output equal to off's."""
    from engines import make_engine, prompts, run

    from ignis.params import SamplingParams
    from ignis.quant.format import quantize

    src = tmp_path / "mtp-packed"
    shutil.copytree(int4, src)
    with safe_open(str(int4 / "model.safetensors"), "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
    for name in [n for n in tensors if n.startswith("mtp.") and n.endswith("_proj.weight") or n == "mtp.fc.weight"]:
        stem = name.removesuffix(".weight")
        qweight, scales, qzeros = quantize(tensors.pop(name), 64)
        tensors |= {f"{stem}.qweight": qweight, f"{stem}.scales": scales, f"{stem}.qzeros": qzeros}
    save_file(tensors, str(src / "model.safetensors"))
    _relayout(src, tmp_path / "ct", None, "ct")
    model = load_model(tmp_path / "ct", device="cpu", dtype=torch.float32, exact=False)
    assert model.mtp is not None and isinstance(model.mtp.fc, QuantLinear)
    ps = prompts(3, 512, seed=4, lo=3, hi=20)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = {backend: run(make_engine(tmp_path / "ct", backend, k, model={"exact": "off"}, lanes=3), ps, params)
            for backend, k in (("off", 0), ("mtp", 3))}
    assert {i: d.token_ids for i, d in outs["mtp"].items()} == {i: d.token_ids for i, d in outs["off"].items()}


def test_compressed_tensors_schemes_that_do_not_fit_are_refused_naming_the_field(int4: Path, tmp_path: Path) -> None:
    _relayout(int4, tmp_path / "ct", None, "ct")
    path = tmp_path / "ct" / "config.json"
    config = json.loads(path.read_text())
    good = config["quantization_config"]
    weights = good["config_groups"]["group_0"]["weights"]
    for field, change in (
        ("format", {"format": "naive-quantized"}),
        ("quantization_status", {"quantization_status": "frozen"}),
        ("transform_config", {"transform_config": {"config_groups": {"u": {"type": "hadamard"}}}}),
        ("weights.num_bits", {"config_groups": {"group_0": {**good["config_groups"]["group_0"],
                                                            "weights": {**weights, "num_bits": 8}}}}),
        ("weights.strategy", {"config_groups": {"group_0": {**good["config_groups"]["group_0"],
                                                            "weights": {**weights, "strategy": "channel"}}}}),
        ("weights.actorder", {"config_groups": {"group_0": {**good["config_groups"]["group_0"],
                                                            "weights": {**weights, "actorder": "column"}}}}),
        ("input_activations", {"config_groups": {"group_0": {**good["config_groups"]["group_0"],
                                                             "input_activations": {"num_bits": 8, "type": "int"}}}}),
        ("mix schemes", {"config_groups": {**good["config_groups"], "group_1": {
            **good["config_groups"]["group_0"], "weights": {**weights, "group_size": 128}}}}),
    ):
        config["quantization_config"] = good | change
        path.write_text(json.dumps(config))
        with pytest.raises(ArtifactError, match=field):
            load_model(tmp_path / "ct", device="cpu", dtype=torch.float32, exact=True)


def test_a_compressed_tensors_head_is_packed_unless_ignored() -> None:
    from ignis.quant.format import QuantConfig

    scheme = {"format": None, "targets": ["Linear"], "weights": {"type": "int", "num_bits": 4, "strategy": "group",
                                                                 "group_size": 128, "symmetric": True}}
    base = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": scheme}}
    for ignore, head in ((["lm_head"], False), (["re:.*lm_head"], False), ([], True), (["re:.*in_proj_b$"], True)):
        q = QuantConfig.of({"quantization_config": base | {"ignore": ignore}}, Path("config.json"))
        assert q is not None and q.published is not None and q.head is head and q.published.symmetric, ignore
    q = QuantConfig.of({"quantization_config": {**base, "config_groups": {"W4A16_ASYM": ["Linear"]},
                                                "ignore": ["lm_head"]}}, Path("config.json"))
    assert q is not None and q.group_size == 128 and q.published is not None and not q.published.symmetric


def test_layouts_that_do_not_fit_are_refused_naming_the_field(int4: Path, tmp_path: Path) -> None:
    base = {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False}
    _relayout(int4, tmp_path / "g", base, "v1")
    config = json.loads((tmp_path / "g" / "config.json").read_text())
    for change, field in (({"bits": 8}, "bits"), ({"group_size": 32}, "group_size"),
                          ({"checkpoint_format": "marlin"}, "checkpoint_format"),
                          ({"quant_method": "awq", "version": "gemv"}, "version")):
        config["quantization_config"] = base | change
        (tmp_path / "g" / "config.json").write_text(json.dumps(config))
        with pytest.raises(ArtifactError, match=field):
            load_model(tmp_path / "g", device="cpu", dtype=torch.float32, exact=True)
    # a g_idx is read from the tensor even when the config does not say act-order: an assignment of whole groups is
    # held in group order (tests/test_quant_act_order.py), one that does not fill its groups is refused
    config["quantization_config"] = base
    (tmp_path / "g" / "config.json").write_text(json.dumps(config))
    with safe_open(str(tmp_path / "g" / "model.safetensors"), "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
    name = next(n for n in tensors if n.endswith(".g_idx") and int(tensors[n].max()) > 0)  # two groups at least
    save_file(tensors | {name: tensors[name].flip(0).contiguous()}, str(tmp_path / "g" / "model.safetensors"))
    model = load_model(tmp_path / "g", device="cpu", dtype=torch.float32, exact=True)
    assert model.get_submodule(name.removeprefix("model.").removesuffix(".g_idx")).order is not None
    save_file(tensors | {name: torch.zeros_like(tensors[name])}, str(tmp_path / "g" / "model.safetensors"))
    with pytest.raises(ArtifactError, match="g_idx"):
        load_model(tmp_path / "g", device="cpu", dtype=torch.float32, exact=True)


def test_a_gptq_head_loads_and_plans_as_ignis_packs_it(tmp_path: Path) -> None:
    """A GPTQ checkpoint whose head is quantized too (`"lm_head": true`) loads it as a QuantLinear holding the bytes
    `ignis quantize --head` makes, and the memory plan counts it packed."""
    from ignis.config import load_config
    from ignis.plan import memory_plan

    src = tiny_checkpoint(tmp_path / "src", seed=7, mtp=True)
    assert main(["quantize", str(src), str(tmp_path / "int4"), "--group", "64", "--head"]) == 0
    quant = {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False, "sym": False, "lm_head": True}
    _relayout(tmp_path / "int4", tmp_path / "gptq", quant, "v1")
    ours = load_model(tmp_path / "int4", device="cpu", dtype=torch.float32, exact=True)
    theirs = load_model(tmp_path / "gptq", device="cpu", dtype=torch.float32, exact=True)
    assert isinstance(ours.lm_head, QuantLinear) and isinstance(theirs.lm_head, QuantLinear)
    for buf in ("qweight", "scales", "qzeros"):
        assert torch.equal(getattr(ours.lm_head, buf), getattr(theirs.lm_head, buf)), buf
    assert torch.equal(_logits(ours), _logits(theirs))
    held = sum(t.nbytes for t in theirs.state_dict().values())
    plan = memory_plan(load_config(profile="cpu"), tmp_path / "gptq")
    assert {i.name: i.nbytes for i in plan.items}["weights"] == held
