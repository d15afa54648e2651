"""The drafter's training recipe: blocks see only the past, taps are the layers' own outputs, and the losses learn.

These run the training code at toy size on CPU; the real run uses the same functions on the GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ignis.backends.dflash2.config import DrafterConfig, drafter_config_json
from ignis.backends.dflash2.model import DrafterModel
from ignis.backends.dflash2.weights import load_drafter, save_drafter
from ignis.model.batch import Batch, Segment
from ignis.model.cache import LaneCache
from ignis.model.config import ModelConfig
from ignis.model.loader import load_model
from tiny import tiny_checkpoint, tiny_config
from tools.artifact.drafter_data import tap_features
from tools.artifact.train_drafter import anchors_for, losses

VOCAB, SEQ, PROMPT = 128, 40, 16


def _drafter(seed: int = 0) -> tuple[DrafterModel, torch.Tensor]:
    target = ModelConfig.from_dict(tiny_config(vocab_size=VOCAB, model_type="qwen3_5_text"))
    config = drafter_config_json(target, num_layers=2, mask_token_id=VOCAB - 1, target_layer_ids=[1, 3],
                                 selector_rank=8, selector_top_k=8, intermediate_size=128)
    torch.manual_seed(seed)
    return DrafterModel(DrafterConfig.from_dict(config, target)), torch.randn(VOCAB, target.hidden_size) * 0.5


def _data(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, VOCAB - 1, (3, SEQ), generator=g)
    mask = torch.zeros(3, SEQ, dtype=torch.bool)
    mask[:, PROMPT:] = True
    return torch.randn(3, SEQ, 2 * 64, generator=g), tokens, mask


def test_a_block_sees_only_context_before_its_anchor() -> None:
    model, embed = _drafter()
    taps, tokens, mask = _data()
    anchors = torch.tensor([[20], [25], [30]])
    with torch.no_grad():
        base = losses(model, embed, taps, tokens, mask, anchors)["unary"]
        later = taps.clone()
        for i, a in enumerate(anchors[:, 0].tolist()):
            later[i, a:] = torch.randn_like(later[i, a:])  # the anchor's own features and everything after it
        assert torch.equal(losses(model, embed, later, tokens, mask, anchors)["unary"], base)
        earlier = taps.clone()
        earlier[:, 19] += 1.0
        assert not torch.allclose(losses(model, embed, earlier, tokens, mask, anchors)["unary"], base)


def test_training_steps_fit_a_batch_and_raise_teacher_forced_acceptance() -> None:
    model, embed = _drafter()
    taps, tokens, mask = _data()
    tokens[:, PROMPT:] = tokens[:, PROMPT - 1 : PROMPT].expand(-1, SEQ - PROMPT)  # a continuation to learn
    anchors = anchors_for(3, SEQ, PROMPT, 8, torch.Generator().manual_seed(2), torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(40):
        out = losses(model, embed, taps, tokens, mask, anchors)
        first = first if first is not None else out
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
    assert out["unary"] < first["unary"] / 4 and out["selector"] < first["selector"] / 4
    assert out["accepted_selector"] / out["blocks"] > 3.0


def test_saved_drafter_shards_reload_exactly(tmp_path: Path) -> None:
    model, _ = _drafter()
    config = drafter_config_json(ModelConfig.from_dict(tiny_config(vocab_size=VOCAB, model_type="qwen3_5_text")),
                                 num_layers=2, mask_token_id=VOCAB - 1, target_layer_ids=[1, 3], selector_rank=8,
                                 selector_top_k=8, intermediate_size=128)
    save_drafter(tmp_path, config, model, torch.float32, max_shard_bytes=64 * 1024)
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("model-*"))) > 2
    back = load_drafter(tmp_path, model.config, device=torch.device("cpu"), dtype=torch.float32)
    for (name, a), (_, b) in zip(sorted(model.state_dict().items()), sorted(back.state_dict().items())):
        assert torch.equal(a, b), name


@pytest.mark.filterwarnings("ignore")
def test_tap_features_are_the_layer_outputs_ignis_hands_the_drafter(tmp_path: Path) -> None:
    from transformers import Qwen3_5ForCausalLM

    ckpt = tiny_checkpoint(tmp_path, seed=2, mtp=False, vocab_size=VOCAB)
    ids = torch.randint(4, VOCAB, (1, 24), generator=torch.Generator().manual_seed(3))
    net = Qwen3_5ForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    layers = (1, 7)  # 7 is the last layer: transformers' hidden_states[-1] would be after the final norm
    got = tap_features(net, ids, layers, 4, torch.device("cpu"), torch.float32)[0]
    model = load_model(ckpt, device="cpu", dtype=torch.float32, exact=False)
    cache = LaneCache(model.config, lanes=1, context=64, max_cols=1, device="cpu", dtype=torch.float32)
    batch = Batch(tokens=ids[0], positions=torch.arange(24), segments=(Segment(0, 0, 0, 24),),
                  logit_rows=torch.tensor([23]))
    want = model(batch, cache, taps=layers).taps
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
