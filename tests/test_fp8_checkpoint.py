"""FP8 checkpoints load in the model's dtype (ignis.quant.fp8_checkpoint): Qwen's block-scaled release layout, read
as transformers reads it (its own dequantization of the same files is the reference), and compressed-tensors'
float-quantized FP8 weights, written and read back by that library's own compressor. From there `model.weights =
"fp8"` makes ignis's per-channel FP8, the memory plan counts what is held, and variants that do not fit are refused
naming the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tiny import tiny_config

from ignis.errors import ArtifactError
from ignis.model.batch import Batch, Segment
from ignis.model.cache import LaneCache
from ignis.model.loader import load_model
from ignis.model.model import HybridModel
from ignis.quant.fp8 import Fp8Linear
from ignis.quant.fp8_checkpoint import dequantize

BLOCK = 32  # the tiny model's widths are multiples of it, or narrower (Qwen's releases: 128)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118


def _fp8_target(name: str, t: torch.Tensor) -> bool:
    """The projections a release stores in FP8 (its gates, head and embedding keep their precision)."""
    return name.endswith("_proj.weight") and t.ndim == 2 and "in_proj_a" not in name and "in_proj_b" not in name


def _block_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (e4m3 codes, fp32 scale [ceil(out / BLOCK), ceil(in / BLOCK)]): each block's absolute maximum
    mapped to e4m3's largest value, as the block-scaled releases are made."""
    out, cols = w.shape
    rows, groups = -(-out // BLOCK), -(-cols // BLOCK)
    pad = torch.zeros(rows * BLOCK, groups * BLOCK)
    pad[:out, :cols] = w.float()
    blocks = pad.reshape(rows, BLOCK, groups, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    codes = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(rows * BLOCK, groups * BLOCK)
    return codes[:out, :cols].contiguous(), scale


def _block_dense(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The weight the block-scaled codes stand for, in fp32: each BLOCK x BLOCK block of codes times its scale."""
    out, cols = codes.shape
    pad = torch.zeros(scale.shape[0] * BLOCK, scale.shape[1] * BLOCK)
    pad[:out, :cols] = codes.float()
    blocks = pad.reshape(scale.shape[0], BLOCK, scale.shape[1], BLOCK) * scale[:, None, :, None]
    return blocks.reshape(pad.shape)[:out, :cols].contiguous()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a block-scaled FP8 checkpoint written as Qwen's FP8 releases are, the same weights dequantized in fp32)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    root = tmp_path_factory.mktemp("fp8")
    torch.manual_seed(0)
    Qwen3_5ForCausalLM(Qwen3_5TextConfig(**tiny_config())).eval().save_pretrained(root / "dense")
    shutil.copytree(root / "dense", root / "fp8")
    stored, dense = {}, {}
    for name, t in _tensors(root / "dense").items():
        if _fp8_target(name, t):
            codes, scale = _block_fp8(t)
            stored |= {name: codes, f"{name}_scale_inv": scale}
            dense[name] = _block_dense(codes, scale)
        else:
            stored[name] = dense[name] = t
    save_file(stored, str(root / "fp8" / "model.safetensors"), metadata={"format": "pt"})
    save_file(dense, str(root / "dense" / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((root / "fp8" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [BLOCK, BLOCK],
                                     "modules_to_not_convert": ["lm_head", "in_proj_a", "in_proj_b"]}
    (root / "fp8" / "config.json").write_text(json.dumps(config))
    return root / "fp8", root / "dense"


def _logits(model: HybridModel) -> torch.Tensor:
    ids = torch.arange(3, 40)
    n = len(ids)
    cache = LaneCache(model.config, lanes=1, context=n + 8, max_cols=1, device="cpu", dtype=torch.float32)
    return model(Batch(ids, torch.arange(n), (Segment(0, 0, 0, n),), torch.arange(n)), cache).logits


def test_a_block_scaled_checkpoint_loads_as_transformers_reads_it(checkpoints: tuple[Path, Path]) -> None:
    from transformers import Qwen3_5ForCausalLM

    fp8, dense = checkpoints
    ours = load_model(fp8, device="cpu", dtype=torch.float32, exact=True)
    plain = load_model(dense, device="cpu", dtype=torch.float32, exact=True)
    for (name, a), (_, b) in zip(ours.state_dict().items(), plain.state_dict().items(), strict=True):
        assert torch.equal(a, b), name  # codes times their block's scale, in fp32
    hf = Qwen3_5ForCausalLM.from_pretrained(fp8, dtype=torch.float32).eval()  # dequantized: no FP8 GPU here
    with torch.no_grad():
        want = hf(torch.arange(3, 40)[None]).logits[0]
    got = _logits(ours)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4


def test_fp8_weights_from_an_fp8_checkpoint_and_the_plan(checkpoints: tuple[Path, Path]) -> None:
    """model.weights = "fp8" turns the loaded weights into ignis's per-channel FP8; the plan counts the load."""
    from ignis.config import load_config
    from ignis.plan import memory_plan

    fp8, dense = checkpoints
    model = load_model(fp8, device="cpu", dtype=torch.float32, exact=True, fp8=True)
    assert any(isinstance(m, Fp8Linear) for m in model.modules())
    plain = load_model(dense, device="cpu", dtype=torch.float32, exact=True, fp8=True)
    assert torch.equal(_logits(model), _logits(plain))
    held = load_model(fp8, device="cpu", dtype=torch.float32, exact=True)
    plan = memory_plan(load_config(profile="cpu"), fp8)
    weights = next(i for i in plan.items if i.name == "weights")
    assert weights.nbytes == sum(t.nbytes for t in held.state_dict().values())
    assert "read from an FP8 checkpoint" in weights.how and plan.weights == "float32"


def test_ignis_quantize_reads_an_fp8_checkpoint_through_its_scales(checkpoints: tuple[Path, Path],
                                                                     tmp_path: Path) -> None:
    """`ignis quantize` of the FP8 checkpoint writes what it writes for the same weights dequantized: the same
    tensors (the scales dropped), the same config."""
    from ignis.cli import main

    fp8, dense = checkpoints
    assert main(["quantize", str(fp8), str(tmp_path / "from-fp8"), "--group", "64"]) == 0
    assert main(["quantize", str(dense), str(tmp_path / "from-dense"), "--group", "64"]) == 0
    got, want = _tensors_of(tmp_path / "from-fp8"), _tensors_of(tmp_path / "from-dense")
    assert got.keys() == want.keys() and any(n.endswith(".qweight") for n in got)
    assert all(torch.equal(got[n], want[n]) for n in want)
    configs = [json.loads((tmp_path / d / "config.json").read_text()) for d in ("from-fp8", "from-dense")]
    assert configs[0]["quantization_config"] == configs[1]["quantization_config"]


def test_a_sharded_fp8_checkpoint_finds_each_scale_in_whichever_shard_holds_it(checkpoints: tuple[Path, Path],
                                                                               tmp_path: Path) -> None:
    """Weights and their scales split over two shards, every scale in the other shard from its weight: the load and
    `ignis quantize` read them as from one file."""
    from ignis.cli import main

    fp8, _ = checkpoints
    dst = tmp_path / "sharded"
    shutil.copytree(fp8, dst)
    tensors = _tensors(fp8)
    (dst / "model.safetensors").unlink()
    weights = sorted(n for n in tensors if not n.endswith("_scale_inv"))
    first = set(weights[::2]) | {f"{n}_scale_inv" for n in weights[1::2] if f"{n}_scale_inv" in tensors}
    shards = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": set(tensors) - first}
    for shard, names in shards.items():
        save_file({n: tensors[n] for n in names}, str(dst / shard), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: shard for shard, names in shards.items() for n in names}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    assert any(index["weight_map"][n] != index["weight_map"][f"{n}_scale_inv"] for n in weights
               if f"{n}_scale_inv" in tensors)
    one = load_model(fp8, device="cpu", dtype=torch.float32, exact=True).state_dict()
    two = load_model(dst, device="cpu", dtype=torch.float32, exact=True).state_dict()
    assert one.keys() == two.keys() and all(torch.equal(one[n], two[n]) for n in one)
    assert main(["quantize", str(fp8), str(tmp_path / "q1"), "--group", "64"]) == 0
    assert main(["quantize", str(dst), str(tmp_path / "q2"), "--group", "64"]) == 0
    got, want = _tensors_of(tmp_path / "q2"), _tensors_of(tmp_path / "q1")
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


def _tensors_of(root: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in root.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            out |= {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
    return out


def test_compressed_tensors_fp8_weights_load_as_that_library_decompresses_them(checkpoints: tuple[Path, Path],
                                                                               tmp_path: Path) -> None:
    """Per-channel FP8 (llm-compressor's FP8 W8A8, `float-quantized`): written by compressed-tensors' compressor and
    config writer; every weight equals its own decompression."""
    from compressed_tensors.compressors import FloatQuantizationCompressor, ModelCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    _, dense = checkpoints
    scheme = QuantizationScheme(
        targets=["Linear"], weights=QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True),
        input_activations=QuantizationArgs(num_bits=8, type="float", strategy="token", dynamic=True, symmetric=True))
    dst = tmp_path / "ct-fp8"
    shutil.copytree(dense, dst)
    stored, want = {}, {}
    for name, t in _tensors(dense).items():
        if not _fp8_target(name, t):
            stored[name] = t
            continue
        scale = t.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0  # [out, 1]
        packed = dict(FloatQuantizationCompressor.compress({"weight": t, "weight_scale": scale}, scheme))
        stem = name.removesuffix(".weight")
        stored |= {f"{stem}.{k}": v for k, v in packed.items()}
        want[name] = FloatQuantizationCompressor.decompress(packed, scheme)["weight"]
    assert stored[next(iter(want))].dtype == torch.float8_e4m3fn
    save_file(stored, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = QuantizationConfig(config_groups={"group_0": scheme}, format="float-quantized",
                                quantization_status="compressed", ignore=["lm_head"])
    ModelCompressor(quantization_config=config).update_config(str(dst))
    ours = load_model(dst, device="cpu", dtype=torch.float32, exact=True)
    held = ours.state_dict()
    for name, w in want.items():
        assert torch.equal(held[name.removeprefix("model.")], w.float()), name


def test_fp8_variants_that_do_not_fit_are_refused_naming_the_field(checkpoints: tuple[Path, Path],
                                                                    tmp_path: Path) -> None:
    fp8, _ = checkpoints
    dst = tmp_path / "bad"
    shutil.copytree(fp8, dst)
    config = json.loads((dst / "config.json").read_text())
    good = config["quantization_config"]
    for change, field in (({"fmt": "e5m2"}, "fmt"), ({"weight_block_size": [128]}, "weight_block_size"),
                          ({"weight_block_size": [16, 16]}, "weight_scale_inv")):
        config["quantization_config"] = good | change
        (dst / "config.json").write_text(json.dumps(config))
        with pytest.raises(ArtifactError, match=field):
            load_model(dst, device="cpu", dtype=torch.float32, exact=True)
    config["quantization_config"] = good
    (dst / "config.json").write_text(json.dumps(config))
    tensors = _tensors(fp8)
    del tensors[next(n for n in tensors if n.endswith("_scale_inv"))]
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(ArtifactError, match="no .*weight_scale_inv"):
        load_model(dst, device="cpu", dtype=torch.float32, exact=True)


def test_dequantize_takes_every_scale_shape() -> None:
    codes = torch.tensor([[1.0, 2.0, 3.0], [4.0, -5.0, 6.0]]).to(torch.float8_e4m3fn)
    w = codes.float()
    assert torch.equal(dequantize(codes, torch.tensor(2.0), None, torch.float32), w * 2)
    rows = torch.tensor([[2.0], [3.0]])
    assert torch.equal(dequantize(codes, rows, None, torch.float32), w * rows)
    assert torch.equal(dequantize(codes, rows[:, 0], None, torch.float32), w * rows)
    blocks = torch.tensor([[2.0, 3.0]])  # one row block, column blocks of 2 (the last partial)
    assert torch.equal(dequantize(codes, blocks, (2, 2), torch.float32), w * torch.tensor([[2.0, 2.0, 3.0]]))
    assert torch.equal(dequantize(codes, blocks, None, torch.float32), w * torch.tensor([[2.0, 2.0, 3.0]]))
    with pytest.raises(ValueError, match="does not cover"):
        dequantize(codes, blocks, (1, 2), torch.float32)
