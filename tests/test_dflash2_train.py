"""The drafter's training recipe: blocks see only the past, taps are the layers' own outputs, the losses learn, the
distillation terms read the target's distribution at the row each label was drawn from, and splitting a step into
micro-batches changes nothing but memory.

These run the training code at toy size on CPU; the real run uses the same functions on the GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ignis.backends.dflash2.config import DrafterConfig, drafter_config_json
from ignis.backends.dflash2.model import DrafterModel, block_mask, shared_context_mask
from ignis.backends.dflash2.weights import load_drafter, save_drafter
from ignis.model.config import ModelConfig
from ignis.model.loader import load_model
from ignis.model.ops import RMSNorm
from ignis.train.generate import Sequences
from ignis.train.loop import Loop, Recipe
from ignis.train.memory import micro_batch_for
from ignis.engine.accept import accept_sampled
from ignis.engine.device_sampling import shape_probs
from ignis.train.recipe import Teacher, _cut, _rejected, anchors_for, losses
from ignis.train.taps import Tapper, tap_features
from tiny import tiny_checkpoint, tiny_config

VOCAB, SEQ, PROMPT = 128, 40, 16
GAMMA = 4.0


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


@pytest.mark.parametrize("window,causal", [(12, False), (None, True)])
def test_blocks_sharing_one_context_attend_as_each_block_alone(window: int | None, causal: bool) -> None:
    """Training gives a sequence's blocks one copy of its context (`shared_context_mask`), serving one each
    (`block_mask`): every block row's hidden state is the same either way, windows and causality included."""
    target = ModelConfig.from_dict(tiny_config(vocab_size=VOCAB, model_type="qwen3_5_text"))
    config = drafter_config_json(target, num_layers=2, mask_token_id=VOCAB - 1, target_layer_ids=[1, 3],
                                 layer_types=["sliding_attention" if window else "full_attention", "full_attention"],
                                 sliding_window=window, is_causal=causal, selector_rank=8, selector_top_k=8,
                                 intermediate_size=128)
    torch.manual_seed(0)
    model = DrafterModel(DrafterConfig.from_dict(config, target)).eval()
    cfg = model.config
    b, per, rows = 2, 3, cfg.width + 1
    g = torch.Generator().manual_seed(2)
    taps = torch.randn(b * SEQ, 2 * 64, generator=g)
    anchors = torch.tensor([[5, 30, 17], [22, 9, 31]])
    pos = torch.arange(SEQ)
    q_pos = anchors.reshape(-1)[:, None] + torch.arange(rows)  # [n, B], sequence-major
    owner = torch.arange(b).repeat_interleave(per)
    x = torch.randn(b * per, rows, cfg.hidden_size, generator=g)
    with torch.no_grad():
        kv = model.context_kv(taps, pos.repeat(b))
        alone = model.block(
            x, q_pos, [(kk.view(b, SEQ, *kk.shape[1:])[owner], vv.view(b, SEQ, *vv.shape[1:])[owner]) for kk, vv in kv],
            [block_mask(cfg, i, pos.expand(b * per, -1), q_pos) for i in range(cfg.num_layers)])
        shared = model.block(
            x, q_pos, [(kk.view(b, SEQ, *kk.shape[1:]), vv.view(b, SEQ, *vv.shape[1:])) for kk, vv in kv],
            [shared_context_mask(cfg, i, pos.expand(b, -1), q_pos.view(b, per, rows)) for i in range(cfg.num_layers)])
    torch.testing.assert_close(shared, alone, rtol=1e-5, atol=1e-5)


def test_a_block_sees_only_context_before_its_anchor() -> None:
    model, embed = _drafter()
    taps, tokens, mask = _data()
    anchors = torch.tensor([[20], [25], [30]])
    with torch.no_grad():
        base = losses(model, embed, embed, taps, tokens, mask, anchors, GAMMA)["unary"]
        later = taps.clone()
        for i, a in enumerate(anchors[:, 0].tolist()):
            later[i, a:] = torch.randn_like(later[i, a:])  # the anchor's own features and everything after it
        assert torch.equal(losses(model, embed, embed, later, tokens, mask, anchors, GAMMA)["unary"], base)
        earlier = taps.clone()
        earlier[:, 19] += 1.0
        assert not torch.allclose(losses(model, embed, embed, earlier, tokens, mask, anchors, GAMMA)["unary"], base)


def test_training_steps_fit_a_batch_and_raise_teacher_forced_acceptance() -> None:
    model, embed = _drafter()
    taps, tokens, mask = _data()
    tokens[:, PROMPT:] = tokens[:, PROMPT - 1 : PROMPT].expand(-1, SEQ - PROMPT)  # a continuation to learn
    anchors = anchors_for(mask, 8, torch.Generator().manual_seed(2))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(40):
        out = losses(model, embed, embed, taps, tokens, mask, anchors, GAMMA)
        first = first if first is not None else out
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
    assert out["unary"] < first["unary"] / 4 and out["selector"] < first["selector"] / 4
    assert out["accepted_selector"] / out["blocks"] > 3.0


def test_a_grown_drafter_computes_its_starts_function_and_trains_its_new_layers() -> None:
    from ignis.train.run import grown, load_grown

    start, embed = _drafter()
    with torch.no_grad():  # a start whose every layer adds something
        for p in start.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    target = ModelConfig.from_dict(tiny_config(vocab_size=VOCAB, model_type="qwen3_5_text"))
    config = drafter_config_json(target, num_layers=2, mask_token_id=VOCAB - 1, target_layer_ids=[1, 3],
                                 selector_rank=8, selector_top_k=8, intermediate_size=128)
    bigger = grown(config, 2)
    assert bigger["num_hidden_layers"] == 4 and len(bigger["layer_types"]) == 4 and config["num_hidden_layers"] == 2
    torch.manual_seed(5)
    model = DrafterModel(DrafterConfig.from_dict(bigger, target))
    load_grown(model, start)
    taps, tokens, mask = _data()
    anchors = anchors_for(mask, 8, torch.Generator().manual_seed(2))
    want = losses(start, embed, embed, taps, tokens, mask, anchors, GAMMA)
    got = losses(model, embed, embed, taps, tokens, mask, anchors, GAMMA)
    for name in ("loss", "unary", "selector"):
        assert torch.equal(got[name], want[name]), name
    got["loss"].backward()
    for layer in model.layers[2:]:  # the new layers start silent but learn
        assert float(layer.self_attn.o_proj.weight.detach().abs().max()) == 0.0
        assert float(layer.self_attn.o_proj.weight.grad.abs().max()) > 0.0
        assert float(layer.mlp.down_proj.weight.grad.abs().max()) > 0.0


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


def test_anchors_are_completion_tokens_followed_by_one() -> None:
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[0, 4:10] = True  # 5 anchors possible: 4..8
    mask[1, 9:12] = True  # 2 possible: 9, 10
    got = anchors_for(mask, 4, torch.Generator().manual_seed(0))
    assert len(set(got[0].tolist())) == 4 and all(4 <= a <= 8 for a in got[0].tolist())
    assert sorted(got[1].tolist()) == [0, 0, 9, 10]  # the rest point at position 0, a prompt token: no weight


def _grads(model: DrafterModel, out: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    out["loss"].backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_distillation_off_leaves_the_hard_loss_and_its_gradients_exactly() -> None:
    taps, tokens, mask = _data()
    anchors = anchors_for(mask, 8, torch.Generator().manual_seed(2))
    last = torch.randn(3, SEQ, 64, generator=torch.Generator().manual_seed(6))
    model, embed = _drafter()
    hard = losses(model, embed, embed, taps, tokens, mask, anchors, GAMMA)
    assert hard["soft_unary"] == 0 and hard["soft_selector"] == 0
    assert torch.equal(hard["loss"], hard["unary"] + hard["selector"])
    off = losses(model, embed, embed, taps, tokens, mask, anchors, GAMMA, teacher=Teacher(last, RMSNorm(64, 1e-6), 0.0))
    assert off["soft_unary"] > 0 and off["soft_selector"] > 0  # computed, and weighted 0
    assert torch.equal(off["loss"], hard["loss"])
    for a, b in zip(_grads(model, hard), _grads(model, off), strict=True):
        assert torch.equal(a, b)


def test_the_total_variation_is_the_chance_the_verifier_rejects_a_draft_from_q() -> None:
    """`_rejected(p, q)` = 1 - sum min(p, q) is what the engine's rejection sampling turns down, drawn from q."""
    g = torch.Generator().manual_seed(11)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0, 0.0])
    q = torch.tensor([0.1, 0.4, 0.1, 0.0, 0.3, 0.1])
    assert abs(float(_rejected(p, q)) - 0.5) < 1e-6  # 1 - (0.1 + 0.3 + 0.1)
    n = 20000
    drafts = torch.multinomial(q, n, replacement=True, generator=g).tolist()
    rejected = sum(accept_sampled([d], torch.stack([p, p]), q[None], g).accepted == 0 for d in drafts)
    assert abs(rejected / n - 0.5) < 0.015  # binomial spread 0.0035


def test_total_variation_terms_join_the_loss_with_their_weight_alone() -> None:
    taps, tokens, mask = _data()
    anchors = anchors_for(mask, 8, torch.Generator().manual_seed(2))
    last = torch.randn(3, SEQ, 64, generator=torch.Generator().manual_seed(6))
    model, embed = _drafter()
    norm = RMSNorm(64, 1e-6)
    base = losses(model, embed, embed, taps, tokens, mask, anchors, GAMMA, teacher=Teacher(last, norm, 1.0))
    assert base["tv_unary"] == 0 and 0 < base["tv_selector"] < 1  # reported, not trained
    with_tv = losses(model, embed, embed, taps, tokens, mask, anchors, GAMMA, teacher=Teacher(last, norm, 1.0, 0.5))
    assert 0 < with_tv["tv_unary"] < 1 and torch.equal(with_tv["tv_selector"], base["tv_selector"])
    torch.testing.assert_close(with_tv["loss"], base["loss"] + 0.5 * (with_tv["tv_unary"] + with_tv["tv_selector"]),
                               rtol=1e-6, atol=0)
    assert any(not torch.equal(a, b) for a, b in zip(_grads(model, base), _grads(model, with_tv), strict=True))

    def one_hot_on_labels() -> Teacher:  # p one-hot on each slot's label: 1 - sum min(p, q) = 1 - q(label)
        onehot = torch.zeros(3, SEQ, 64)
        onehot[:, : SEQ - 1] = embed[tokens[:, 1:]]
        return Teacher(onehot, lambda h: 1000.0 * h, 0.0, 1.0)

    with torch.no_grad():
        got = losses(model, embed, embed, taps, tokens, mask, anchors, GAMMA, teacher=one_hot_on_labels())
    # Per slot 1 - q(label) = 1 - exp(-ce), a concave function of ce: the weighted mean lies below it at the mean ce.
    assert 0 < got["tv_unary"] <= 1 - torch.exp(-got["unary"]) + 1e-6
    assert 0 < got["tv_selector"] <= 1 - torch.exp(-got["selector"]) + 1e-6


def test_a_cut_total_variation_is_the_rejection_a_cut_request_is_served() -> None:
    """--tv-cut 20,0.95: p and q shaped as the engine shapes them for a request with top-k 20 and top-p 0.95
    (device_sampling.shape_probs), then 1 - sum min(p, q); the cut is a constant mask, so the kept logits still get
    a gradient; the loss differs from the uncut one, and a cut that cuts nothing (0, 1.0) gives the uncut loss."""
    g = torch.Generator().manual_seed(3)
    logits = (2.0 * torch.randn(5, 3, 40, generator=g)).requires_grad_()
    cut = _cut(logits, (20, 0.95))
    n = 15
    served = shape_probs(logits.detach().reshape(n, 40), torch.ones(n), torch.full((n,), 20), torch.full((n,), 0.95),
                         torch.zeros(n)).view(5, 3, 40)
    torch.testing.assert_close(cut.detach(), served, rtol=0, atol=0)
    assert bool(((cut > 0).sum(-1) < 20).all())  # top-p took more than top-k did
    cut.sum(-1).mean().backward()  # rows sum to 1: no gradient through the normalisation
    p = torch.softmax(torch.randn(5, 3, 40, generator=g), -1)
    loss = _rejected(_cut(p.log(), (20, 0.95)), _cut(logits, (20, 0.95))).mean()
    logits.grad = None
    loss.backward()
    assert logits.grad is not None and bool((logits.grad != 0).any())
    torch.testing.assert_close(_cut(logits.detach(), (0, 1.0)), logits.detach().softmax(-1))

    taps, tokens, mask = _data()
    anchors = anchors_for(mask, 8, torch.Generator().manual_seed(2))
    last = torch.randn(3, SEQ, 64, generator=torch.Generator().manual_seed(6))
    model, embed = _drafter()
    norm = RMSNorm(64, 1e-6)
    uncut = losses(model, embed, embed, taps, tokens, mask, anchors, GAMMA, teacher=Teacher(last, norm, 0.0, 1.0))
    same = losses(model, embed, embed, taps, tokens, mask, anchors, GAMMA,
                  teacher=Teacher(last, norm, 0.0, 1.0, (0, 1.0)))
    cut_loss = losses(model, embed, embed, taps, tokens, mask, anchors, GAMMA,
                      teacher=Teacher(last, norm, 0.0, 1.0, (4, 0.8)))
    for key in ("tv_unary", "tv_selector"):
        torch.testing.assert_close(same[key], uncut[key])
        assert 0 < cut_loss[key] < 1 and not torch.equal(cut_loss[key], uncut[key])


def test_the_teacher_of_slot_k_is_the_targets_distribution_after_position_a_plus_k_minus_1() -> None:
    """A teacher one-hot on each position's next token makes every soft term its hard twin; one row later it is not."""
    taps, tokens, mask = _data()
    anchors = anchors_for(mask, 8, torch.Generator().manual_seed(2))
    model, embed = _drafter()

    def one_hot_on(shift: int) -> Teacher:
        last = torch.zeros(3, SEQ, 64)
        last[:, : SEQ - shift] = embed[tokens[:, shift:]]  # row t: the token at t + shift
        return Teacher(last, lambda h: 1000.0 * h, 1.0)  # a "final norm" that makes head(h) one-hot on h's token

    teacher = one_hot_on(1)
    p = teacher.probs(embed, torch.arange(3), torch.arange(SEQ - 1).expand(3, -1))
    assert torch.equal(p.argmax(-1), tokens[:, 1:]) and torch.equal(p.max(-1).values, torch.ones(3, SEQ - 1))
    with torch.no_grad():
        got = losses(model, embed, embed, taps, tokens, mask, anchors, GAMMA, teacher=teacher)
        torch.testing.assert_close(got["soft_unary"], got["unary"], rtol=1e-6, atol=0)
        torch.testing.assert_close(got["soft_selector"], got["selector"], rtol=1e-6, atol=0)
        torch.testing.assert_close(got["loss"], 2 * (got["unary"] + got["selector"]), rtol=1e-6, atol=0)
        late = losses(model, embed, embed, taps, tokens, mask, anchors, GAMMA, teacher=one_hot_on(2))
        for key in ("unary", "selector"):
            assert abs(late[f"soft_{key}"] - got[key]) > 0.1, key


def _sequences(seed: int = 4) -> Sequences:
    g = torch.Generator().manual_seed(seed)
    lengths, prompts = [30, 40, 26, 35, 40, 33], [8, 12, 6, 10, 16, 9]
    tokens = torch.randint(4, VOCAB - 1, (sum(lengths),), generator=g).numpy().astype("int32")
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]).numpy()
    return Sequences(tokens, starts, torch.tensor(prompts).numpy(), torch.ones(len(lengths), dtype=torch.bool).numpy())


@pytest.mark.parametrize(("distill", "tv"), [(0.0, 0.0), (0.5, 0.0), (0.0, 0.5)])
def test_micro_batches_give_the_step_of_the_whole_batch(distill: float, tv: float) -> None:
    data = _sequences()
    gen = torch.Generator().manual_seed(5)
    taps, last = torch.randn(6, 40, 2 * 64, generator=gen), torch.randn(6, 40, 64, generator=gen)
    final_norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        final_norm.weight.normal_(0.0, 0.3, generator=gen)

    def features(rows: list[int], tokens: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return taps[rows, : tokens.shape[1]], last[rows, : tokens.shape[1]]

    grads = []
    for micro in (6, 4, 1):
        model, embed = _drafter(seed=3)
        loop = Loop(model, embed, embed, features, data, list(range(6)), Recipe(6, 4, 1e-3, 1, GAMMA, 7, distill, tv),
                    torch.device("cpu"), final_norm)
        loop.micro = micro
        loop.step(0.0)  # the generator moves on as for the whole batch, whatever the split
        loop.opt.step = lambda: None  # type: ignore[method-assign,assignment,return-value]
        seen = loop.step(0.0)
        grads.append((torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]), seen))
    for g, seen in grads[1:]:
        torch.testing.assert_close(g, grads[0][0], rtol=1e-4, atol=1e-7)
        assert seen["blocks"] == grads[0][1]["blocks"] and seen["blocks"] > 0
        for key in ("loss", "soft_unary", "soft_selector", "tv_unary", "tv_selector"):
            assert abs(seen[key] - grads[0][1][key]) < 1e-5, key
    seen = grads[0][1]  # any teacher reports the soft terms and the selector's total variation; tv_unary costs more
    assert (seen["soft_unary"] > 0) == (seen["tv_selector"] > 0) == (distill > 0 or tv > 0)
    assert (seen["tv_unary"] > 0) == (tv > 0)


def test_micro_batch_fits_what_is_left() -> None:
    gib = 2**30
    assert micro_batch_for(free=80 * gib, fixed=8 * gib, per_sequence=2 * gib, requested=32) == 30  # 0.85*80-8 = 60
    assert micro_batch_for(free=80 * gib, fixed=0, per_sequence=gib // 4, requested=32) == 32
    assert micro_batch_for(free=4 * gib, fixed=8 * gib, per_sequence=gib, requested=32) == 1


@pytest.mark.filterwarnings("ignore")
def test_tap_features_are_the_layer_outputs_transformers_computes(tmp_path: Path) -> None:
    """Several sequences of different lengths in one packed pass give each layer's own output (transformers'
    hidden_states[l + 1] for l < last; the last layer's output is before the final norm, so read with a hook)."""
    from transformers import Qwen3_5ForCausalLM

    ckpt = tiny_checkpoint(tmp_path, seed=2, mtp=False, vocab_size=VOCAB)
    g = torch.Generator().manual_seed(3)
    lengths = [24, 9, 17]
    tokens = torch.zeros(3, 24, dtype=torch.long)
    for i, n in enumerate(lengths):
        tokens[i, :n] = torch.randint(4, VOCAB, (n,), generator=g)
    layers = (1, 7)
    model = load_model(ckpt, device="cpu", dtype=torch.float32, exact=False)
    got = Tapper(model, layers, torch.device("cpu"), torch.float32)(tokens, lengths)
    assert torch.equal(got[1, 9:], torch.zeros_like(got[1, 9:]))  # padding stays empty
    net = Qwen3_5ForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    seen: dict[int, torch.Tensor] = {}
    hooks = [net.model.layers[l].register_forward_hook(
        lambda _m, _i, out, l=l: seen.__setitem__(l, out[0] if isinstance(out, tuple) else out)) for l in layers]
    try:
        for i, n in enumerate(lengths):
            with torch.no_grad():
                net.model(tokens[i : i + 1, :n])
            want = torch.cat([seen[l][0] for l in layers], dim=-1)
            torch.testing.assert_close(got[i, :n], want, rtol=1e-4, atol=1e-4)
    finally:
        for h in hooks:
            h.remove()


@pytest.mark.parametrize("cache", ["auto", "off"])
def test_the_teachers_last_layer_is_tapped_alone_or_shared_with_the_drafter(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache: str) -> None:
    """With distillation the features add the last layer's outputs: an extra tap when the drafter does not read it
    (and the cache's fit check counts it), its own columns when it does; the drafter's features are the same."""
    from ignis.train import taps as taps_module

    sizes: list[int] = []

    def fits(nbytes: int, device: torch.device) -> bool:
        sizes.append(nbytes)
        return True

    monkeypatch.setattr(taps_module, "tap_cache_fits", fits)
    model = load_model(tiny_checkpoint(tmp_path, seed=2, mtp=False, vocab_size=VOCAB), device="cpu",
                       dtype=torch.float32, exact=False)
    final, cpu = len(model.layers) - 1, torch.device("cpu")
    data, rows = _sequences(), [1, 0, 4]
    tokens, _ = data.batch(rows)
    lengths = [int(data.lengths()[r]) for r in rows]
    want = Tapper(model, (final,), cpu, torch.float32)(tokens, lengths)
    for layers in ((1, 3), (1, final)):
        plain, _ = tap_features(model, layers, data, cpu, torch.float32, cache, lambda _: None)
        both, _ = tap_features(model, layers, data, cpu, torch.float32, cache, lambda _: None, last=True)
        taps, none = plain(rows, tokens, lengths)
        got, last = both(rows, tokens, lengths)
        assert none is None and last is not None and torch.equal(got, taps)
        torch.testing.assert_close(last, want, rtol=1e-5, atol=1e-6)  # cached: computed in a pass over other rows
        if final in layers:
            assert torch.equal(last, taps[..., 64:])  # the drafter's own columns
    if cache == "auto":
        assert sizes[1] == sizes[0] * 3 // 2 and sizes[2] == sizes[3] == sizes[0]  # one more layer of 2; shared: none
