"""The dflash2 backend's pieces: the exact window, the drafter's load-time checks, the selector's walk and its q.

Greedy equality inside the engine is in test_dflash2.py; here the backend is driven directly, so the context it
keeps can be compared with a reference that recomputes everything from the raw tapped rows.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import structlog
import torch
from safetensors.torch import load_file, save_file

from ignis.backends.base import BackendContext, Choice, Observation, ProposeIn
from ignis.backends.dflash2 import greedy_copy
from ignis.backends.dflash2.backend import DFlash2
from ignis.backends.dflash2.config import DFLASH, DrafterConfig, drafter_config_json
from ignis.backends.dflash2.model import Selector
from ignis.backends.dflash2.selector import pick, select, transform
from ignis.backends.dflash2.shortlist import dequantize, quantize
from ignis.backends.dflash2.weights import SHORTLIST, WEIGHTS, save_random_drafter
from ignis.config import load_config
from ignis.engine.accept import accept_sampled
from ignis.engine.sampling import make_generator, target_probs
from ignis.errors import ArtifactError, ConfigError
from ignis.model.config import ModelConfig
from ignis.model.loader import load_model
from ignis.params import SamplingParams
from tiny import tiny_checkpoint, tiny_config
from tools.artifact.build_shortlist import build as build_shortlist

VOCAB = 256
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), seed=4, mtp=False, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def target(ckpt: Path) -> ModelConfig:
    return ModelConfig.from_dir(ckpt)


def backend(ckpt: Path, drafter: Path, k: int = 7, head: str = "full", lanes: int = 2,
            weights: str = "model") -> DFlash2:
    overrides = {"model.path": str(ckpt), "spec.backend": "dflash2", "spec.draft_tokens": k,
                 "spec.drafter": str(drafter), "spec.draft_head": head, "engine.lanes": lanes,
                 "spec.draft_weights": weights}
    config = load_config(profile="cpu", overrides=overrides)
    model = load_model(ckpt, device=CPU, dtype=torch.float32, exact=False)
    return DFlash2(BackendContext(model, config, ckpt, lanes, 256, CPU, torch.float32))


def _observation(lane: int, start: int, taps: torch.Tensor) -> Observation:
    n = taps.shape[0]
    return Observation(lane=lane, start=start, tokens=torch.zeros(n, dtype=torch.long), following=0,
                       hidden=torch.zeros(n, 1), taps=taps)


def _reference_hidden(be: DFlash2, taps: torch.Tensor, anchor: int, window: int) -> torch.Tensor:
    """The block's rows recomputed from scratch: every context row's K/V, and the mask written out from the format's
    rule (context key p visible to the query at q iff q - p < window on sliding layers; causal layers see block
    rows up to their own)."""
    cfg, s, rows = be.cfg, taps.shape[0], be.cfg.block_size
    kv = be.model.context_kv(taps, torch.arange(s))
    q_pos = s + torch.arange(rows)
    masks = []
    for i, kind in enumerate(cfg.layer_types):
        ctx = torch.ones(rows, s, dtype=torch.bool)
        if kind == "sliding_attention":
            ctx = (q_pos[:, None] - torch.arange(s)[None, :]) < window
        own = torch.tril(torch.ones(rows, rows, dtype=torch.bool)) if cfg.causal[i] else torch.ones(rows, rows).bool()
        masks.append(torch.cat([ctx, own], dim=1)[None])
    x = be.target.embed(torch.tensor([[anchor] + [cfg.mask_token_id] * (rows - 1)]))
    return be.model.block(x, q_pos[None], [(k[None], v[None]) for k, v in kv], masks)[0, 1:]


@pytest.mark.parametrize("is_causal", [False, None])
def test_context_longer_than_the_window_gives_the_drafts_of_a_from_scratch_window(
    ckpt: Path, target: ModelConfig, tmp_path: Path, is_causal: bool | None
) -> None:
    window = 16
    drafter = save_random_drafter(tmp_path / "d", target, seed=1, layer_types=["sliding_attention", "full_attention"],
                                  sliding_window=window, is_causal=is_causal)
    be = backend(ckpt, drafter)
    assert be.cfg.causal == ((True, False) if is_causal is None else (False, False))
    g = torch.Generator().manual_seed(0)
    width = len(be.tap_layers) * target.hidden_size
    taps = [torch.randn(45, width, generator=g), torch.randn(9, width, generator=g)]
    with torch.inference_mode():
        be.observe([_observation(1, 0, torch.randn(30, width, generator=g))])  # a finished request's context...
        be.reset(1)  # ...must vanish when the lane is reused
        be.observe([_observation(0, 0, taps[0][:30]), _observation(1, 0, taps[1][:4])])  # prefill beyond the window
        cuts = [30, 31, 34, 39, 45]  # then commits of 1, 3, 5 and 6 rows
        for a, b in zip(cuts, cuts[1:]):
            extra = [_observation(1, 4, taps[1][4:])] if a == 30 else []
            be.observe([_observation(0, a, taps[0][a:b]), *extra])
        anchors = torch.tensor([5, 6])
        inp = ProposeIn(lanes=[0, 1], anchors=anchors, positions=torch.tensor([45, 9]), k=7, temperatures=[0.0, 0.0],
                        generators=[g, g], span=45)
        got = be.hidden(torch.tensor([0, 1]), anchors, inp.positions, 7, 45)
        want = torch.stack([_reference_hidden(be, taps[i], int(anchors[i]), window) for i in range(2)])
        # The ring's K/V and a from-scratch context add in different orders: rows up to about 5 differ by up to 2e-5
        # in fp32 on some CPUs' BLAS (AMD EPYC, OpenBLAS 0.3.31); a window one position longer moves them by about 4.
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        # The check can tell the window from one position more.
        assert not torch.allclose(got[0], _reference_hidden(be, taps[0], 5, window + 1), rtol=1e-4, atol=1e-4)
        sel = be.model.candidate_selector
        expected, _ = select(be.cfg, sel, want, be.target.logits(want), None, anchors, Choice(torch.zeros(2), None),
                             VOCAB)
        assert torch.equal(be.propose(inp).tokens, expected)


@pytest.mark.parametrize("weights", ["model", "fp8"])
def test_a_dense_drafters_layers_hold_their_keys_and_values_in_one_buffer(ckpt: Path, target: ModelConfig,
                                                                          tmp_path: Path, weights: str) -> None:
    """Fused, a dense drafter's layers keep q | k | v in one [L, rows, H] buffer, so that `context_weights` (every
    layer's k | v, one batched product for the context) is a view of the weights the layers' own products read; a
    converted drafter's projections are not dense, and have none."""
    be = backend(ckpt, save_random_drafter(tmp_path / "d", target, num_layers=3), weights=weights)
    stacked = be.model.context_weights
    if weights == "fp8":
        assert stacked is None
        return
    assert stacked is not None and stacked.shape[0] == 3
    for i, layer in enumerate(be.model.layers):
        att = layer.self_attn
        assert torch.equal(stacked[i], torch.cat([att.k_proj.weight, att.v_proj.weight]))
        assert stacked[i].data_ptr() == att.k_proj.weight.data_ptr()  # a view: no second copy
        assert att.qkv_proj.data_ptr() == att.q_proj.weight.data_ptr()


def test_draft_tokens_above_the_trained_width_is_refused_naming_it(ckpt: Path, target: ModelConfig,
                                                                   tmp_path: Path) -> None:
    drafter = save_random_drafter(tmp_path / "d", target, block_size=4)
    with pytest.raises(ConfigError) as err:
        backend(ckpt, drafter, k=5)
    assert err.value.key == "spec.draft_tokens" and "at most 3 drafts" in str(err.value)
    assert backend(ckpt, drafter, k=3).draft_tokens == 3


def test_an_int4_drafter_whose_inputs_the_groups_do_not_divide_is_refused_naming_the_key(
        ckpt: Path, target: ModelConfig, tmp_path: Path) -> None:
    drafter = save_random_drafter(tmp_path / "d", target, intermediate_size=96)  # down_proj: 96 inputs
    with pytest.raises(ConfigError) as err:
        backend(ckpt, drafter, weights="int4")
    assert err.value.key == "spec.draft_weights" and "down_proj takes 96 inputs" in str(err.value)
    with pytest.raises(ConfigError) as err:
        backend(ckpt, drafter, weights="int4-greedy")
    assert err.value.key == "spec.draft_weights" and "down_proj takes 96 inputs" in str(err.value)
    assert backend(ckpt, drafter).draft_tokens == 7  # the same drafter in its own precision loads


def test_auto_draft_weights_make_the_greedy_copy_for_a_large_16bit_drafter_on_a_gpu_only(
        ckpt: Path, target: ModelConfig, tmp_path: Path) -> None:
    """spec.draft_weights = "auto", apart from memory (the engine's settling, tests/test_defaults.py):
    "int4-greedy" for 16-bit layer projections of 1 GiB or more where the 4-bit mma kernel runs, outside exact mode;
    "model" otherwise, as on this CPU."""
    gib = greedy_copy.AUTO_BYTES
    assert greedy_copy.auto_copy(3 * gib, 2, mma=True, exact=False)
    assert not greedy_copy.auto_copy(gib - 1, 2, mma=True, exact=False)  # the built-in's is MiBs
    assert not greedy_copy.auto_copy(3 * gib, 4, mma=True, exact=False)  # fp32: no mma product
    assert not greedy_copy.auto_copy(3 * gib, 2, mma=False, exact=False)
    assert not greedy_copy.auto_copy(3 * gib, 2, mma=True, exact=True)
    b = backend(ckpt, save_random_drafter(tmp_path / "d", target), weights="auto")
    assert b.draft_weights == "model" and b.greedy_model is None
    assert b.settled_spec == {"draft_head": "full", "draft_weights": "model"}


@pytest.mark.parametrize("head", ["full", "shortlist", "int4", "auto"])
def test_draft_head_is_logged_at_load(ckpt: Path, target: ModelConfig, tmp_path: Path, head: str) -> None:
    """The head the drafter proposes through, as resolved: "auto" on the CPU is the target's own ("full")."""
    drafter = save_random_drafter(tmp_path / "d", target)
    build_shortlist(ckpt, drafter / SHORTLIST, torch.arange(VOCAB), size=64, group=16)
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    try:
        with structlog.testing.capture_logs() as logs:
            backend(ckpt, drafter, head=head)
    finally:
        structlog.configure(**saved)
    events = [e for e in logs if e["event"] == "ignis.runtime.draft_head"]
    assert len(events) == 1 and events[0]["draft_head"] == ("full" if head == "auto" else head)
    assert events[0]["shortlist_tokens"] == (64 if head == "shortlist" else None)


def test_drafter_tensors_are_checked_and_bare_or_suffixed_codebooks_load(
    ckpt: Path, target: ModelConfig, tmp_path: Path
) -> None:
    drafter = save_random_drafter(tmp_path / "d", target)
    tensors = load_file(drafter / WEIGHTS)
    codebook = tensors["candidate_selector.successor_codebook"]
    save_file({(k + ".weight" if k.endswith("_codebook") else k): v for k, v in tensors.items()}, drafter / WEIGHTS)
    assert torch.equal(backend(ckpt, drafter).model.candidate_selector.successor_codebook, codebook)

    save_file({k: v for k, v in tensors.items() if k != "layers.1.mlp_conv.base_kernel"}, drafter / WEIGHTS)
    with pytest.raises(ArtifactError, match=r"missing: layers\.1\.mlp_conv\.base_kernel"):
        backend(ckpt, drafter)
    save_file({**tensors, "fc.weight": tensors["fc.weight"][:, 1:].contiguous()}, drafter / WEIGHTS)
    with pytest.raises(ArtifactError, match=r"wrong shape: fc\.weight"):
        backend(ckpt, drafter)
    save_file(tensors, drafter / WEIGHTS)
    with pytest.raises(ArtifactError, match=r"shortlist\.safetensors"):
        backend(ckpt, drafter, head="shortlist")
    config = drafter / "config.json"
    config.write_text(config.read_text().replace('"DFlash2DraftModel"', f'"{DFLASH}"'))
    with pytest.raises(ArtifactError, match=r"does not describe: candidate_selector\."):
        backend(ckpt, drafter)


def test_shortlist_quantization_round_trips_within_half_a_step() -> None:
    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(2))
    packed, scales = quantize(w, 16)
    assert packed.dtype == torch.uint8 and packed.shape == (40, 32) and scales.shape == (40, 4)
    back = dequantize(packed, scales, 16)
    step = scales.float().repeat_interleave(16, dim=1)
    assert ((back - w).abs() <= step / 2 + 1e-6).all()


def _selector_setup(vocab: int, top_k: int, seed: int) -> tuple[DrafterConfig, Selector]:
    target = ModelConfig.from_dict(tiny_config(vocab_size=vocab, model_type="qwen3_5_text"))
    config = drafter_config_json(target, mask_token_id=vocab - 1, target_layer_ids=[1], selector_rank=8,
                                 selector_top_k=top_k, output_multiplier=0.7, final_logit_softcapping=3.0)
    cfg = DrafterConfig.from_dict(config, target)
    sel = Selector(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in sel.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / 2)
    return cfg, sel.requires_grad_(False)


def test_greedy_selector_walks_the_candidates_by_logit_plus_markov_edge() -> None:
    vocab, n, k = 64, 3, 5
    cfg, sel = _selector_setup(vocab, top_k=6, seed=0)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(n, k, cfg.hidden_size, generator=g)
    logits = torch.round(torch.randn(n, k, vocab, generator=g) * 4) / 4  # ties: the smaller id ranks first
    anchors = torch.tensor([3, 9, 60])
    tokens, q = select(cfg, sel, hidden, logits, None, anchors, Choice(torch.zeros(n), None), vocab)
    assert q is None
    with torch.no_grad():
        for lane in range(n):
            prev = int(anchors[lane])
            for t in range(k):
                row = logits[lane, t].tolist()
                cands = sorted(range(vocab), key=lambda c: (-row[c], c))[: cfg.selector_top_k]
                hp = sel.hidden_projection.weight @ hidden[lane, t]
                scores = [float(transform(cfg, torch.tensor(row[c])))
                          + float((sel.predecessor_codebook[prev] * hp * sel.successor_codebook[c]).sum())
                          for c in cands]
                prev = cands[max(range(len(cands)), key=lambda i: (scores[i], -i))]
                assert int(tokens[lane, t]) == prev, f"lane {lane} slot {t}"


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


CUTS = {"uncut": None, "top_k": (2, 1.0, 0.0), "top_p": (0, 0.6, 0.0), "min_p": (0, 1.0, 0.4)}


@pytest.mark.parametrize("cut", list(CUTS))
@pytest.mark.parametrize("drafter", ["selector", "v1", "v1-shortlist"])
def test_rejection_sampling_with_the_drafters_q_keeps_the_target_distribution(drafter: str, cut: str) -> None:
    """Drafts drawn by the backend's own sampler with its q, then the engine's acceptance: every emitted token is
    distributed as the target's p (the speculation issue's statistical test, with this backend's q), also when the
    request's top-k, top-p or min-p cut q; the cut q is the uncut one cut by the host sampler's rule."""
    vocab, k, trials = 8, 2, 20000
    cfg, sel = _selector_setup(vocab, top_k=4, seed=3)
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(1, k, cfg.hidden_size, generator=g).expand(trials, -1, -1)
    logits = (torch.randn(1, k, vocab, generator=g) * 2).expand(trials, -1, -1)
    temps, u = torch.full((trials,), 0.7), torch.rand(trials, k, generator=g, dtype=torch.float64)
    anchors = torch.full((trials,), 2)
    ids = torch.tensor([6, 1, 3, 0, 5])

    def draw_drafts(choice: Choice) -> tuple[torch.Tensor, torch.Tensor | None]:
        if drafter == "selector":
            return select(cfg, sel, hidden, logits, None, anchors, choice, vocab)
        if drafter == "v1":
            return pick(cfg, logits, None, choice, vocab)
        tokens, q = pick(cfg, logits[:, :, : ids.numel()], ids, choice, vocab)
        assert torch.isin(tokens, ids).all()
        return tokens, q

    tokens, q = draw_drafts(Choice(temps, u))
    assert q is not None
    if CUTS[cut] is not None:
        top_k, top_p, min_p = CUTS[cut]
        uncut = q[0, 0]
        tokens, q = draw_drafts(Choice(temps, u, torch.full((trials,), top_k), torch.full((trials,), top_p),
                                       torch.full((trials,), min_p)))
        assert q is not None
        # slot 0's q does not depend on earlier draws: the uncut q, cut as the host cuts a request's p
        want = target_probs(uncut.log()[None], SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p,
                                                               min_p=min_p))[0]
        assert int((want > 0).sum()) < int((uncut > 0).sum())  # the cut removes something
        torch.testing.assert_close(q[0, 0], want)
    # The drafts follow q: at slot 0 q is the same for every trial.
    drawn = torch.bincount(tokens[:, 0], minlength=vocab).double() / trials
    assert _tv(drawn, q[0, 0].double()) < 0.02
    # A target near the drafter, so that second tokens are common enough to be checked too.
    p = 0.5 * torch.softmax(torch.randn(k + 1, vocab, generator=g) * 1.5, dim=-1)
    p[:k] += 0.5 * q.mean(dim=0)
    p[k] += 0.5 / vocab
    first = torch.zeros(vocab, dtype=torch.float64)
    second = torch.zeros(vocab, dtype=torch.float64)
    gen = make_generator(5)
    for i in range(trials):
        drafts = tokens[i].tolist()
        v = accept_sampled(drafts, p, q[i], gen)
        emitted = drafts[: v.accepted] + [v.token]
        first[emitted[0]] += 1
        if len(emitted) > 1:
            second[emitted[1]] += 1
    assert _tv(first / trials, p[0].double()) < 0.03
    assert second.sum() > 2000 and _tv(second / second.sum(), p[1].double()) < 0.04
