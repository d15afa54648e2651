"""The dflash2 drafter's ring kernels on a real GPU, in bf16 at the 27B drafter's shape (5 layers of 5,120, 32 heads,
8 KV heads of 128) and the built-in drafter's: `ring.block` against `DrafterModel.block` over the gathered context,
`ring.write` against `context_kv` + `write_rows`, and both under CUDA-graph replay. Needs CUDA; CI has none (the
interpreter runs the same kernels on the CPU in tests/test_dflash2_ring.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ignis.backends.dflash2 import ring
from ignis.backends.dflash2.config import DrafterConfig, drafter_config_json
from ignis.backends.dflash2.context import ContextCache
from ignis.backends.dflash2.weights import random_drafter, spread_layer_ids
from ignis.model.config import ModelConfig
from tiny import tiny_config
from tools.round_work import QWEN35_27B

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

CUDA = torch.device("cuda")
BF16 = torch.bfloat16
LANES, CONTEXT = 8, 600
ARCH = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text"}


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """|got - want| / |want| over the whole tensor, in fp32."""
    return float((got.float() - want.float()).norm() / want.float().norm())


def drafter(shape: str) -> tuple[DrafterConfig, torch.nn.Module]:
    if shape == "27b":
        target = ModelConfig.from_dict(QWEN35_27B | ARCH)
        cfg = DrafterConfig.from_dict(drafter_config_json(
            target, num_layers=5, num_heads=32, num_kv_heads=8, head_dim=128, block_size=8,
            mask_token_id=target.vocab_size - 1, target_layer_ids=spread_layer_ids(target.num_hidden_layers, 5),
            selector_rank=256, selector_top_k=16), target)
    else:
        target = ModelConfig.from_dict(tiny_config() | ARCH | {"hidden_size": 384, "num_attention_heads": 6,
                                                         "num_key_value_heads": 2, "head_dim": 64})
        cfg = DrafterConfig.from_dict(drafter_config_json(
            target, num_layers=5, intermediate_size=1024, mask_token_id=3, target_layer_ids=[1, 3, 5, 6, 7],
            sliding_window=64), target)
    model = random_drafter(cfg, seed=1, device=CUDA, dtype=BF16)
    model.fuse()
    model.rope.precompute(CONTEXT + cfg.block_size + 1, CUDA, BF16)
    return cfg, model


def filled(cfg: DrafterConfig, model: torch.nn.Module, seed: int,
           dtype: torch.dtype = BF16) -> tuple[ContextCache, torch.Tensor]:
    """A cache whose lanes hold 40..516 committed rows (written by the torch path), and each lane's length."""
    g = torch.Generator(device=CUDA).manual_seed(seed)
    cache = ContextCache(cfg, lanes=LANES, context=CONTEXT, device=CUDA, dtype=dtype)
    lengths = torch.tensor([40 + 68 * i for i in range(LANES)], device=CUDA)
    width = len(cfg.target_layer_ids) * cfg.hidden_size
    with torch.inference_mode():
        for lane in range(LANES):
            n = int(lengths[lane])
            taps = torch.randn(n, width, generator=g, device=CUDA).to(dtype)
            pos = torch.arange(n, device=CUDA)
            cache.write([lane], [0], [n], model.context_kv(taps, pos), CUDA)  # rows a ring can show, no slot twice
    return cache, lengths


def drafter_pair(shape: str) -> tuple[DrafterConfig, torch.nn.Module, torch.nn.Module]:
    """The drafter in bf16 and the same random weights in fp32 (bf16's are these rounded)."""
    cfg, model = drafter(shape)
    exact = random_drafter(cfg, seed=1, device=CUDA, dtype=torch.float32)
    exact.fuse()
    exact.rope.precompute(CONTEXT + cfg.block_size + 1, CUDA, torch.float32)
    return cfg, model, exact


def block_inputs(cfg: DrafterConfig, lengths: torch.Tensor, lanes: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device=CUDA).manual_seed(3)
    lane_ix = torch.arange(LANES, device=CUDA).flip(0)[:lanes]
    q_pos = lengths[lane_ix][:, None] + torch.arange(cfg.block_size, device=CUDA)
    x = torch.randn(lanes, cfg.block_size, cfg.hidden_size, generator=g, device=CUDA)
    return lane_ix, q_pos, x


@pytest.mark.parametrize("shape", ["27b", "builtin"])
@pytest.mark.parametrize("lanes", [1, 8])
def test_one_layers_ring_attention_equals_the_gathered_torch_path(shape: str, lanes: int) -> None:
    """One layer's attention over the same bf16 inputs: the kernel (norms, RoPE, masks, online softmax) against
    Attention.forward over the gathered context and block_mask, within bf16's roundings."""
    from ignis.kernels import drafter_triton

    cfg, model = drafter(shape)
    cache, lengths = filled(cfg, model, seed=2)
    lane_ix, q_pos, x = block_inputs(cfg, lengths, lanes)
    x = x.to(BF16)
    att = model.layers[0].self_attn
    cos, sin = model.rope.precomputed(BF16, x.device)
    window = cfg.sliding_window if cfg.layer_types[0] == "sliding_attention" else None
    with torch.inference_mode():
        kv, masks = cache.gather(lane_ix, q_pos, CONTEXT)
        tc, ts = model.rope.tables(q_pos.reshape(-1), BF16)
        want = att(x, tc, ts, kv[0][0], kv[0][1], masks[0])
        qkv = F.linear(x.reshape(-1, cfg.hidden_size), att.qkv_proj)
        k, v, held = cache.rings()[0]
        got = att.o_proj(drafter_triton.ring_attention(qkv, att.q_norm.weight, att.k_norm.weight, att.q_norm.eps, cos,
                                                       sin, k, v, held, lane_ix, q_pos, CONTEXT, window,
                                                       cfg.causal[0], att.num_heads)).view_as(want)
    assert relative(got, want) < 1e-2, relative(got, want)


@pytest.mark.parametrize("shape", ["27b", "builtin"])
@pytest.mark.parametrize("lanes", [1, 8])
def test_ring_block_is_as_close_to_fp32_as_the_torch_path(shape: str, lanes: int) -> None:
    """Five layers in bf16 drift from the fp32 drafter by a few percent whichever path runs them (random weights
    amplify each rounding): the ring path may not drift further than the torch path does. It also replays in a
    CUDA graph to the same bits."""
    cfg, model, exact = drafter_pair(shape)
    cache, lengths = filled(cfg, model, seed=2)
    cache32, _ = filled(cfg, exact, seed=2, dtype=torch.float32)
    lane_ix, q_pos, x32 = block_inputs(cfg, lengths, lanes)
    x = x32.to(BF16)
    span = CONTEXT
    with torch.inference_mode():
        kv, masks = cache32.gather(lane_ix, q_pos, span)
        truth = exact.block(x32, q_pos, kv, masks)
        kv, masks = cache.gather(lane_ix, q_pos, span)
        torch_path = model.block(x, q_pos, kv, masks)
        got = ring.block(model, x, q_pos, cache.rings(), lane_ix, span)
        assert relative(got, truth) < 1.25 * relative(torch_path, truth), (relative(got, truth),
                                                                            relative(torch_path, truth))

        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            ring.block(model, x, q_pos, cache.rings(), lane_ix, span)  # warm-up: Triton compiles outside capture
            with torch.cuda.graph(graph):
                out = ring.block(model, x, q_pos, cache.rings(), lane_ix, span)
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, got)


@pytest.mark.parametrize("shape", ["27b", "builtin"])
def test_ring_write_equals_context_kv_and_write_rows(shape: str) -> None:
    cfg, model = drafter(shape)
    cache, lengths = filled(cfg, model, seed=4)
    other, _ = filled(cfg, model, seed=4)
    g = torch.Generator(device=CUDA).manual_seed(5)
    cols = cfg.block_size
    positions = (lengths[:, None] + torch.arange(cols, device=CUDA)).reshape(-1)
    accepted = torch.arange(LANES, device=CUDA) % cols
    kept = torch.arange(cols, device=CUDA)[None, :] <= accepted[:, None]
    lane_ix = torch.where(kept, torch.arange(LANES, device=CUDA)[:, None], LANES).reshape(-1)
    taps = torch.randn(LANES * cols, len(cfg.target_layer_ids) * cfg.hidden_size, generator=g, device=CUDA, dtype=BF16)
    with torch.inference_mode():
        cache.write_rows(lane_ix, positions, model.context_kv(taps, positions))
        ring.write(model, taps, positions, lane_ix, other.rings())
    for (k, v, pos), (k2, v2, pos2) in zip(cache.rings(), other.rings()):
        assert torch.equal(pos[:LANES], pos2[:LANES])
        assert relative(k2[:LANES], k[:LANES]) < 1e-2 and relative(v2[:LANES], v[:LANES]) < 1e-2, (
            relative(k2[:LANES], k[:LANES]), relative(v2[:LANES], v[:LANES]))
