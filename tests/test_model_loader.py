"""Loading checkpoints: both public tensor layouts, sharded or not, and a clear ArtifactError for each broken one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import single_thread, tiny_checkpoint, tiny_config  # noqa: F401 - single_thread is a fixture
from transformers import Qwen3_5ForCausalLM

from ignis.errors import ArtifactError
from ignis.model.batch import Batch, Segment
from ignis.model.cache import LaneCache
from ignis.model.config import ModelConfig
from ignis.model.loader import load_model
from ignis.model.model import HybridModel

pytestmark = pytest.mark.usefixtures("single_thread")
PROMPT = torch.arange(3, 40)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("base"), seed=7, mtp=True)


def logits(model: HybridModel) -> torch.Tensor:
    n = len(PROMPT)
    cache = LaneCache(model.config, lanes=1, context=64, max_cols=1, device="cpu", dtype=torch.float32)
    return model(Batch(PROMPT, torch.arange(n), (Segment(0, 0, 0, n),), torch.arange(n)), cache).logits


def load(path: Path) -> HybridModel:
    return load_model(path, device="cpu", dtype=torch.float32, exact=True)


def copy_with(src: Path, dst: Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = config if config is not None else json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_sharded_checkpoint_loads_the_same_weights(base: Path, tmp_path: Path) -> None:
    Qwen3_5ForCausalLM.from_pretrained(base).save_pretrained(tmp_path, max_shard_size="60KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    sharded = load(tmp_path)
    assert sharded.mtp is None  # transformers drops mtp.* on save
    assert torch.equal(logits(sharded), logits(load(base)))


def test_conditional_generation_layout_loads(base: Path, tmp_path: Path) -> None:
    """Qwen3_5ForConditionalGeneration: text weights under model.language_model., a vision tower to ignore, the
    text architecture nested in text_config."""
    text = json.loads((base / "config.json").read_text())
    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": {**text, "model_type": "qwen3_5_text", "architectures": None},
        "vision_config": {"model_type": "qwen3_5_vision", "depth": 1},
        "tie_word_embeddings": False,
    }
    renamed = {}
    for name, t in load_file(str(base / "model.safetensors")).items():
        renamed[name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name] = t
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(3, 3)
    model = load(copy_with(base, tmp_path / "vl", renamed, config))
    reference = load(base)
    assert model.mtp is not None and reference.mtp is not None
    assert torch.equal(model.mtp.fc.weight, reference.mtp.fc.weight)
    assert torch.equal(logits(model), logits(reference))


def test_tied_embeddings_use_the_embedding_as_output_head(tmp_path: Path) -> None:
    path = tiny_checkpoint(tmp_path, seed=8, mtp=False, tie_word_embeddings=True)
    model = load(path)
    assert model.lm_head is None
    hidden = torch.randn(5, model.config.hidden_size)
    assert torch.equal(model.logits(hidden), hidden @ model.embed_tokens.weight.T)


def test_missing_tensor_names_it(base: Path, tmp_path: Path) -> None:
    tensors = load_file(str(base / "model.safetensors"))
    del tensors["model.layers.2.linear_attn.A_log"]
    broken = copy_with(base, tmp_path / "missing", tensors)
    with pytest.raises(ArtifactError, match=r"layers\.2\.linear_attn\.A_log.*missing"):
        load(broken)


def test_wrong_shape_names_tensor_and_both_shapes(base: Path, tmp_path: Path) -> None:
    tensors = load_file(str(base / "model.safetensors"))
    tensors["model.layers.3.self_attn.k_proj.weight"] = torch.zeros(7, 64)
    broken = copy_with(base, tmp_path / "shape", tensors)
    with pytest.raises(ArtifactError, match=r"layers\.3\.self_attn\.k_proj\.weight.*\(7, 64\).*\(64, 64\)"):
        load(broken)


def test_other_architecture_is_refused_by_name(base: Path, tmp_path: Path) -> None:
    config = {**tiny_config(), "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    other = copy_with(base, tmp_path / "llama", load_file(str(base / "model.safetensors")), config)
    with pytest.raises(ArtifactError, match=r"'llama'.*LlamaForCausalLM.*Qwen3_5ForCausalLM"):
        load(other)
    with pytest.raises(ArtifactError, match="mixture-of-experts"):
        ModelConfig.from_dict({**tiny_config(), "model_type": "qwen3_5_text", "num_experts": 8})


def test_missing_files_are_named(base: Path, tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="config.json"):
        load(tmp_path)
    (tmp_path / "config.json").write_text((base / "config.json").read_text())
    with pytest.raises(ArtifactError, match="model.safetensors"):
        load(tmp_path)


def test_config_reads_nested_text_config_and_legacy_rope_keys() -> None:
    text = {k: v for k, v in tiny_config().items() if k != "rope_parameters"}
    cfg = ModelConfig.from_dict(
        {
            "model_type": "qwen3_5",
            "text_config": {**text, "rope_theta": 1e7, "partial_rotary_factor": 0.5, "eos_token_id": 9},
        }
    )
    assert (cfg.rope_theta, cfg.partial_rotary_factor, cfg.rotary_dim) == (1e7, 0.5, 16)
    assert cfg.eos_token_ids == (9,)
    assert cfg.layer_types[3] == "full_attention" and cfg.attention_layers == (3, 7)
    assert cfg.mtp_num_hidden_layers == 0
    assert cfg.conv_dim == 2 * 2 * 16 + 4 * 16


def test_dummy_load_format_needs_only_config_json(base: Path, tmp_path: Path) -> None:
    """model.load_format = "dummy": config.json alone gives a model of its shapes with seeded random weights (the same
    for the same config), with its MTP layer when the config has one, and an engine serves it: for measuring a shape
    no checkpoint on disk holds."""
    from engines import make_engine, run

    from ignis.params import SamplingParams

    (tmp_path / "config.json").write_text((base / "config.json").read_text())
    first = load_model(tmp_path, device="cpu", dtype=torch.float32, exact=True, dummy=True)
    second = load_model(tmp_path, device="cpu", dtype=torch.float32, exact=True, dummy=True)
    assert first.mtp is not None
    shapes = {name: t.shape for name, t in load(base).state_dict().items()}
    assert {name: t.shape for name, t in first.state_dict().items()} == shapes
    assert torch.equal(logits(first), logits(second))
    assert not torch.equal(logits(first), logits(load(base)))
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = {backend: run(make_engine(tmp_path, backend, k, model={"load_format": "dummy"}), [[5, 6, 7, 8]], greedy)
            for backend, k in (("off", 0), ("mtp", 3))}
    assert outs["off"]["0"].token_ids == outs["mtp"]["0"].token_ids
    assert len(outs["off"]["0"].token_ids) == 12
