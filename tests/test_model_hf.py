"""ignis's hybrid model against transformers' Qwen3_5ForCausalLM, the reference implementation, on CPU in fp32:
prefill and decode logits within 1e-4 relative error, identical greedy tokens, one lane and four lanes at once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tiny import single_thread, tiny_checkpoint, tiny_config  # noqa: F401 - single_thread is a fixture
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5TextRotaryEmbedding

from ignis.model.batch import Batch, Segment
from ignis.model.cache import AttnState, LaneCache
from ignis.model.loader import load_model
from ignis.model.model import HybridModel

PROMPT_LENGTHS = (1, 9, 64, 100)
pytestmark = pytest.mark.usefixtures("single_thread")
DECODE_STEPS = 64


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@dataclass
class Reference:
    prompt: torch.Tensor  # [P] int64
    prefill: torch.Tensor  # [P, V] float32: transformers' logits of every prompt row
    tokens: list[int]  # transformers' greedy tokens: the first from the prefill, then one per decode step
    decode: list[torch.Tensor]  # DECODE_STEPS x [V] float32, with transformers' own cache


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen3_5ForCausalLM saved with save_pretrained, weights perturbed off transformers' init so that every
    norm weight, gate bias and conv tap matters."""
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**tiny_config())).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("dt_bias"):
                p.add_(0.5 * torch.randn_like(p))
            elif name.endswith("conv1d.weight"):
                p.uniform_(-0.5, 0.5)
    path = tmp_path_factory.mktemp("hf")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_model(hf_dir: Path) -> Qwen3_5ForCausalLM:
    return Qwen3_5ForCausalLM.from_pretrained(hf_dir).eval()


@pytest.fixture(scope="module")
def ours(hf_dir: Path) -> HybridModel:
    return load_model(hf_dir, device="cpu", dtype=torch.float32, exact=True)


@pytest.fixture(scope="module")
def references(hf_model: Qwen3_5ForCausalLM) -> list[Reference]:
    gen = torch.Generator().manual_seed(1)
    refs = []
    with torch.no_grad():
        for n in PROMPT_LENGTHS:
            prompt = torch.randint(3, 512, (n,), generator=gen)
            out = hf_model(prompt[None], use_cache=True)
            cache, prefill = out.cache, out.logits[0]
            tokens, decode = [int(prefill[-1].argmax())], []
            for _ in range(DECODE_STEPS):
                out = hf_model(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
                cache = out.cache
                decode.append(out.logits[0, -1])
                tokens.append(int(decode[-1].argmax()))
            refs.append(Reference(prompt, prefill, tokens, decode))
    return refs


def run_lanes(model: HybridModel, refs: list[Reference], lanes: list[int]) -> tuple[list[torch.Tensor], list[list]]:
    """Prefill every reference prompt on its lane in one packed batch, then decode all lanes together, feeding
    transformers' greedy tokens. Returns per lane: prefill logits [P, V] and the decode logits per step."""
    cache = LaneCache(model.config, lanes=4, context=256, max_cols=1, device="cpu", dtype=torch.float32)
    segs, offset = [], 0
    for ref, lane in zip(refs, lanes, strict=True):
        segs.append(Segment(lane=lane, offset=offset, start=0, length=len(ref.prompt), prefill=True))
        offset += len(ref.prompt)
    tokens = torch.cat([r.prompt for r in refs])
    positions = torch.cat([torch.arange(len(r.prompt)) for r in refs])
    out = model(Batch(tokens, positions, tuple(segs), torch.arange(offset)), cache)
    prefill = [out.logits[s.offset : s.offset + s.length] for s in segs]
    decode: list[list[torch.Tensor]] = [[] for _ in refs]
    for step in range(DECODE_STEPS):
        segs = [
            Segment(lane=lane, offset=i, start=len(r.prompt) + step, length=1)
            for i, (r, lane) in enumerate(zip(refs, lanes, strict=True))
        ]
        batch = Batch(
            tokens=torch.tensor([r.tokens[step] for r in refs]),
            positions=torch.tensor([s.start for s in segs]),
            segments=tuple(segs),
            logit_rows=torch.arange(len(refs)),
        )
        logits = model(batch, cache).logits
        for i in range(len(refs)):
            decode[i].append(logits[i])
    return prefill, decode


def check_lane(ref: Reference, prefill: torch.Tensor, decode: list[torch.Tensor]) -> None:
    assert rel_err(prefill, ref.prefill) < 1e-4
    assert torch.equal(prefill.argmax(-1), ref.prefill.argmax(-1))
    assert int(prefill[-1].argmax()) == ref.tokens[0]
    for step, (got, want) in enumerate(zip(decode, ref.decode, strict=True)):
        assert rel_err(got, want) < 1e-4, f"decode step {step}"
        assert int(got.argmax()) == ref.tokens[step + 1], f"greedy token differs at decode step {step}"


def test_one_lane_matches_transformers(ours: HybridModel, references: list[Reference]) -> None:
    for ref in references:
        prefill, decode = run_lanes(ours, [ref], [2])
        check_lane(ref, prefill[0], decode[0])


def test_four_lanes_at_once_match_transformers(ours: HybridModel, references: list[Reference]) -> None:
    prefill, decode = run_lanes(ours, references, [3, 0, 2, 1])
    for i, ref in enumerate(references):
        check_lane(ref, prefill[i], decode[i])


def test_taps_are_transformers_hidden_states(ours: HybridModel, hf_model: Qwen3_5ForCausalLM) -> None:
    prompt = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hf = hf_model(prompt[None], output_hidden_states=True)
    cache = LaneCache(ours.config, lanes=1, context=64, max_cols=1, device="cpu", dtype=torch.float32)
    taps = (5, 0, 3)
    out = ours(Batch(prompt, torch.arange(40), (Segment(0, 0, 0, 40, prefill=True),), torch.tensor([39])), cache, taps=taps)
    h = ours.config.hidden_size
    assert out.taps is not None and out.taps.shape == (40, len(taps) * h)
    for i, layer in enumerate(taps):
        assert rel_err(out.taps[:, i * h : (i + 1) * h], hf.hidden_states[layer + 1][0]) < 1e-4


def test_random_checkpoint_loads_in_transformers_too(tmp_path: Path) -> None:
    path = tiny_checkpoint(tmp_path, seed=4, mtp=True)
    hf = Qwen3_5ForCausalLM.from_pretrained(path).eval()
    model = load_model(path, device="cpu", dtype=torch.float32, exact=True)
    assert model.mtp is not None
    prompt = torch.randint(3, 512, (70,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf(prompt[None]).logits[0]
    cache = LaneCache(model.config, lanes=1, context=128, max_cols=1, device="cpu", dtype=torch.float32)
    got = model(Batch(prompt, torch.arange(70), (Segment(0, 0, 0, 70, prefill=True),), torch.arange(70)), cache).logits
    assert rel_err(got, want) < 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_mtp_head_is_fc_then_a_transformers_attention_layer(tmp_path: Path) -> None:
    """MTP = norm(layer(fc([norm_e(embedding), norm_h(hidden)]))), the layer being transformers' own decoder layer."""
    path = tiny_checkpoint(tmp_path, seed=6, mtp=True)
    model = load_model(path, device="cpu", dtype=torch.float32, exact=True)
    mtp = model.mtp
    assert mtp is not None
    hf_config = Qwen3_5TextConfig.from_pretrained(path)
    layer = Qwen3_5DecoderLayer(hf_config, model.config.attention_layers[0]).eval()
    own = mtp.state_dict()
    layer.load_state_dict({k.removeprefix("layers.0."): v for k, v in own.items() if k.startswith("layers.0.")})
    gen = torch.Generator().manual_seed(5)
    n = 30
    embeds = model.embed(torch.randint(3, 512, (n,), generator=gen))
    hidden = torch.randn(n, model.config.hidden_size, generator=gen)
    positions = torch.arange(n)
    k = torch.zeros(2, 64, model.config.num_key_value_heads, model.config.head_dim)
    v = torch.zeros_like(k)
    got = mtp(embeds, hidden, positions, (Segment(lane=1, offset=0, start=0, length=n, prefill=True),),
              AttnState.contiguous(k, v))
    with torch.no_grad():
        u = torch.cat([mtp.pre_fc_norm_embedding(embeds), mtp.pre_fc_norm_hidden(hidden)], -1) @ mtp.fc.weight.T
        rope = Qwen3_5TextRotaryEmbedding(hf_config)
        causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
        want = mtp.norm(layer(u[None], position_embeddings=rope(u[None], positions[None]), attention_mask=causal)[0])
    assert rel_err(got, want) < 1e-4
    # Decoding the last row alone against the K/V the first n-1 rows left gives the same bits as the full pass.
    k2, v2 = torch.zeros_like(k), torch.zeros_like(v)
    kv2 = AttnState.contiguous(k2, v2)
    mtp(embeds[:-1], hidden[:-1], positions[:-1], (Segment(1, 0, 0, n - 1, prefill=True),), kv2)
    last = mtp(embeds[-1:], hidden[-1:], positions[-1:], (Segment(1, 0, n - 1, 1),), kv2)
    assert torch.equal(last[0], got[-1])
