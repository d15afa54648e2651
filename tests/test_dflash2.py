"""The dflash2 backend in the engine: greedy output equals `off` token for token, whatever the drafter proposes.

Two drafters in the published layouts beside a tiny target: a DFlash2 drafter whose selector holds the bigram table
of the target's own greedy outputs (so most drafts are accepted and every commit path runs: several rows per lane,
lanes finishing mid-block), and a random plain DFlash (v1) drafter (so nearly every draft is rejected). Each runs
with the target's output head and with a 4-bit shortlist head.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from engines import prompts, run
from ignis.backends.dflash2.config import DFLASH, DrafterConfig
from ignis.backends.dflash2.weights import SHORTLIST, load_drafter, save_drafter, save_random_drafter
from ignis.config import load_config
from ignis.engine.core import Engine
from ignis.model.config import ModelConfig
from ignis.model.loader import load_model
from ignis.params import SamplingParams
from ignis.quant.fp8 import Fp8Linear
from ignis.quant.linear import QuantLinear
from tiny import tiny_checkpoint
from tools.artifact.build_shortlist import build as build_shortlist
from tools.artifact.build_shortlist import count_ids

VOCAB = 512


def make_engine(ckpt: Path, drafter: Path, k: int, lanes: int, head: str = "full", weights: str = "model",
                **extra: Any) -> Engine:
    overrides: dict[str, Any] = {
        "model.path": str(ckpt), "spec.backend": "dflash2", "spec.draft_tokens": k, "spec.drafter": str(drafter),
        "spec.draft_head": head, "spec.draft_weights": weights, "engine.lanes": lanes, "log.level": "warning",
        **extra,
    }
    return Engine(load_config(profile="cpu", overrides=overrides))


def bigram_drafter(path: Path, ckpt: Path, sequences: list[list[int]]) -> Path:
    """A DFlash2 drafter that proposes each token's most frequent successor in `sequences`.

    The selector's codebooks hold the table (predecessor = identity, successor row = the successor's one-hot
    column). The hidden projection reads one coordinate j of the rows' final hidden state, and no layer writes to j,
    so on MASK rows it is the MASK embedding's, scaled by a positive 1/rms: the table's gain stays positive while
    the random layers, attending to the context, still move the logits."""
    target = ModelConfig.from_dir(ckpt)
    save_random_drafter(path, target, seed=5, num_layers=2, taps=3, selector_rank=VOCAB, selector_top_k=VOCAB)
    config = json.loads((path / "config.json").read_text())
    model = load_drafter(path, DrafterConfig.from_dict(config, target), device=torch.device("cpu"), dtype=torch.float32)
    mask = target.vocab_size - 1
    with torch.no_grad():
        emb = load_model(ckpt, device="cpu", dtype=torch.float32, exact=False).embed(torch.tensor(mask))
        j = int(emb.argmax())
        for layer in model.layers:
            layer.self_attn.o_proj.weight[j] = 0.0
            layer.mlp.down_proj.weight[j] = 0.0
        # The MASK embedding is small beside what the random layers add: a large gain keeps the table decisive.
        gain = 1e4 * float(emb.pow(2).mean().sqrt()) / float(emb[j])
        projection = torch.zeros(VOCAB, target.hidden_size)
        projection[:, j] = gain / model.norm.weight[j]
        model.candidate_selector.hidden_projection.weight.copy_(projection)
        model.candidate_selector.predecessor_codebook.copy_(torch.eye(VOCAB))
        successors: dict[int, Counter[int]] = {}
        for seq in sequences:
            for a, b in zip(seq, seq[1:]):
                successors.setdefault(a, Counter())[b] += 1
        table = torch.zeros(VOCAB, VOCAB)
        for a, counts in successors.items():
            table[counts.most_common(1)[0][0], a] = 1.0  # successor codebook row c, column a: edge a -> c
        model.candidate_selector.successor_codebook.copy_(table)
    save_drafter(path, config, model, torch.float32)
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), seed=3, mtp=False, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def work() -> tuple[list[list[int]], list[SamplingParams]]:
    ps = prompts(20, VOCAB, seed=1, lo=2, hi=32)
    return ps, [SamplingParams(max_tokens=4 + (3 * i) % 10, temperature=0.0, ignore_eos=True) for i in range(len(ps))]


@pytest.fixture(scope="module")
def reference(ckpt: Path, work) -> dict[str, list[int]]:
    ps, params = work
    overrides = {"model.path": str(ckpt), "spec.backend": "off", "engine.lanes": 4, "log.level": "warning"}
    out = run(Engine(load_config(profile="cpu", overrides=overrides)), ps, params)
    return {k: v.token_ids for k, v in out.items()}


@pytest.fixture(scope="module")
def drafters(ckpt: Path, work, reference, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    ps, _ = work
    root = tmp_path_factory.mktemp("drafters")
    sequences = [p[-1:] + reference[str(i)] for i, p in enumerate(ps)]
    target = ModelConfig.from_dir(ckpt)
    found = {
        "dflash2": bigram_drafter(root / "dflash2", ckpt, sequences),
        "dflash": save_random_drafter(root / "dflash", target, variant=DFLASH, seed=7, num_layers=2, taps=2,
                                      output_multiplier=0.5, final_logit_softcapping=8.0),
    }
    counts = count_ids(torch.tensor([t for s in sequences for t in s]), VOCAB)
    for path in found.values():
        build_shortlist(ckpt, path / SHORTLIST, counts, size=200, group=16, exclude=(VOCAB - 1,))
    return found


@pytest.mark.parametrize("head", ["full", "shortlist"])
@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("lanes", [1, 4])
@pytest.mark.parametrize("variant", ["dflash2", "dflash"])
def test_dflash2_greedy_equals_off_token_for_token(
    ckpt: Path, work, reference, drafters, variant: str, lanes: int, k: int, head: str
) -> None:
    ps, params = work
    engine = make_engine(ckpt, drafters[variant], k, lanes, head)
    out = run(engine, ps, params)
    for rid, ref in reference.items():
        assert out[rid].token_ids == ref, f"request {rid} diverged from off"
    s = engine.stats()
    assert s.rounds > 0 and s.drafted > 0
    assert all(a <= d for a, d in zip(s.position_accepted, s.position_drafted))
    if variant == "dflash2":
        # The bigram drafter knows most continuations: commits of several rows per lane happen at every width.
        assert s.accepted > s.drafted / 4


@pytest.mark.parametrize("model", [{}, {"model.exact": "off"}], ids=["exact", "fused"])
def test_an_fp8_drafter_keeps_greedy_output_and_its_drafts(ckpt: Path, work, reference, drafters,
                                                          model: dict[str, str]) -> None:
    """spec.draft_weights = "fp8": the drafter's projections in e4m3 (fused or not) still leave greedy output equal to
    off, and the bigram drafter's table survives the rounding: its drafts are still mostly accepted."""
    ps, params = work
    engine = make_engine(ckpt, drafters["dflash2"], 7, 4, weights="fp8", **model)
    converted = [m for m in engine.runner.backend.model.modules() if isinstance(m, Fp8Linear)]
    assert len(converted) == 1 + 2 * 7  # fc, and q, k, v, o, gate, up, down of each of the two layers
    out = run(engine, ps, params)
    for rid, ref in reference.items():
        assert out[rid].token_ids == ref, f"request {rid} diverged from off"
    s = engine.stats()
    assert s.accepted > s.drafted / 4


@pytest.mark.parametrize("model", [{}, {"model.exact": "off"}], ids=["exact", "fused"])
def test_an_int4_drafter_keeps_greedy_output_and_its_drafts(ckpt: Path, work, reference, drafters,
                                                           model: dict[str, str]) -> None:
    """spec.draft_weights = "int4": the drafter's projections as 4-bit codes (fused or not) still leave greedy output
    equal to off, each product is the dequantized weight's, and the bigram drafter's table survives the rounding."""
    ps, params = work
    engine = make_engine(ckpt, drafters["dflash2"], 7, 4, weights="int4", **model)
    drafter = engine.runner.backend.model
    packed = [m for m in drafter.modules() if isinstance(m, QuantLinear)]
    assert len(packed) == 1 + 2 * 7  # fc, and q, k, v, o, gate, up, down of each of the two layers
    dense = load_drafter(drafters["dflash2"], drafter.config, device=torch.device("cpu"), dtype=torch.float32)
    x = torch.randn(3, packed[0].in_features, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = packed[0].weight.dequantize()
        step = packed[0].scales.float().repeat_interleave(packed[0].group, dim=1)
        assert ((got - dense.fc.weight).abs() <= step / 2 * (1 + 1e-4)).all()  # the format's rounding: half a step
        torch.testing.assert_close(packed[0](x), x @ got.T, rtol=1e-5, atol=1e-5)
    out = run(engine, ps, params)
    for rid, ref in reference.items():
        assert out[rid].token_ids == ref, f"request {rid} diverged from off"
    s = engine.stats()
    assert s.accepted > s.drafted / 4


def _spy_forms(backend: Any) -> list[tuple[bool, int]]:
    """Records (whether the greedy copy ran, block rows) for every block pass the backend drafts."""
    seen: list[tuple[bool, int]] = []
    hidden = backend.hidden

    def spy(lane_ix: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        model = args[4] if len(args) > 4 else kw.get("model")
        seen.append((model is not None and model is backend.greedy_model, lane_ix.shape[0] * (args[2] + 1)))
        return hidden(lane_ix, *args, **kw)

    backend.hidden = spy
    return seen


@pytest.mark.parametrize("model", [{}, {"model.exact": "off"}], ids=["exact", "fused"])
def test_the_greedy_copy_drafts_greedy_rounds_of_few_rows_only(ckpt: Path, work, reference, drafters,
                                                               model: dict[str, str]) -> None:
    """spec.draft_weights = "int4-greedy": the drafter keeps its own projections and gains a 4-bit copy of its
    layers' (sharing every other tensor), which greedy rounds of at most 16 block rows (two lanes of 7 drafts) read
    and every other round does not; greedy output still equals off, and a sampled lane drafts with the drafter as it
    is."""
    ps, params = work
    engine = make_engine(ckpt, drafters["dflash2"], 7, 4, weights="int4-greedy", **model)
    backend = engine.runner.backend
    drafter, copy = backend.model, backend.greedy_model
    assert copy is not None and backend.draft_weights == "int4-greedy"
    assert not any(isinstance(m, QuantLinear) for m in drafter.modules())
    assert len([m for m in copy.modules() if isinstance(m, QuantLinear)]) == 2 * 7  # fc stays the drafter's
    assert copy.fc.weight is drafter.fc.weight and copy.norm.weight is drafter.norm.weight
    assert copy.candidate_selector.successor_codebook is drafter.candidate_selector.successor_codebook
    packed = sum(t.nbytes for m in copy.modules() if isinstance(m, QuantLinear) for t in m.buffers())
    dense = load_drafter(drafters["dflash2"], drafter.config, device=torch.device("cpu"), dtype=torch.float32)
    own = sum(t.nbytes for t in (*dense.parameters(), *dense.buffers()))
    assert backend.nbytes() == own + packed + backend.cache.nbytes() + backend.offsets.nbytes + backend.masks.nbytes
    seen = _spy_forms(backend)
    out = run(engine, ps, params)
    for rid, ref in reference.items():
        assert out[rid].token_ids == ref, f"request {rid} diverged from off"
    assert any(used for used, _ in seen) and any(not used for used, _ in seen)
    assert all(used == (rows <= 16) for used, rows in seen)
    assert engine.stats().accepted > engine.stats().drafted / 4  # the table survives the 4-bit rounding
    seen.clear()
    assert run(engine, ps[:1], params[0])["0"].token_ids == reference["0"]
    assert seen and all(used and rows <= 8 for used, rows in seen)
    seen.clear()
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    run(engine, ps[:1], sampled)  # a lane alone: few enough rows, but it samples
    assert seen and not any(used for used, _ in seen)


@pytest.mark.parametrize("model", [{}, {"model.exact": "off"}], ids=["exact", "fused"])
def test_a_4bit_proposal_head_keeps_greedy_output_and_every_token(ckpt: Path, work, reference, drafters,
                                                                  model: dict[str, str]) -> None:
    """spec.draft_head = "int4": the target's whole head in 4-bit codes proposes (no token left out, unlike the
    shortlist), its logits are the dequantized head's, each weight within half a step of the target's, and greedy
    output still equals off."""
    ps, params = work
    engine = make_engine(ckpt, drafters["dflash2"], 7, 4, head="int4", **model)
    backend = engine.runner.backend
    head = backend.packed_head
    assert head is not None and backend.shortlist is None and head.module is not None
    target = engine.model.embed_tokens.weight if engine.model.lm_head is None else engine.model.lm_head.weight
    got = head.module.weight.dequantize()
    step = head.module.scales.float().repeat_interleave(head.module.group, dim=1)
    assert got.shape == target.shape == (VOCAB, target.shape[1])
    assert ((got - target).abs() <= step / 2 * (1 + 1e-4)).all()  # the format's rounding: half a step
    x = torch.randn(5, target.shape[1], generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(head.logits(x), x @ got.T, rtol=1e-5, atol=1e-5)
    assert head.nbytes() == sum(t.nbytes for t in head.module.buffers()) > 0
    out = run(engine, ps, params)
    for rid, ref in reference.items():
        assert out[rid].token_ids == ref, f"request {rid} diverged from off"
    s = engine.stats()
    assert s.accepted > s.drafted / 4


def test_the_engine_reports_the_head_auto_settled_on(ckpt: Path, drafters) -> None:
    """spec.draft_head = "auto" (the default) on the CPU is the target's own head, and the engine's config and info
    say so rather than "auto"."""
    engine = make_engine(ckpt, drafters["dflash2"], 7, 2, head="auto")
    assert engine.runner.backend.packed_head is None and engine.runner.backend.draft_head == "full"
    assert engine.config.spec.draft_head == "full" and engine.info.draft_head == "full"


def test_sampled_drafts_are_reproducible_and_accepted(ckpt: Path, work, drafters) -> None:
    """Seeded sampling with the selector's own q: the same request gives the same tokens, and drafts get accepted."""
    ps, _ = work
    params = [SamplingParams(max_tokens=24, temperature=t, top_p=0.95, top_k=20, seed=11 + i, ignore_eos=True)
              for i, t in enumerate([0.6, 1.0, 0.0, 0.8])]
    runs = []
    for _ in range(2):
        engine = make_engine(ckpt, drafters["dflash2"], 7, 4)
        runs.append(run(engine, ps[:4], params))
    assert all(runs[0][r].token_ids == runs[1][r].token_ids for r in runs[0])
    assert engine.stats().accepted > 0


def test_builtin_drafter_keeps_greedy_output_and_commits_several_tokens_a_round() -> None:
    """The shipped pair: with the trained drafter (full, shortlist and 4-bit heads) greedy output is the target's own, and
    rounds commit well over one token on held-out code."""
    from tokenizers import Tokenizer

    from ignis.artifact import BUILTIN

    tok = Tokenizer.from_file(str(BUILTIN / "tokenizer.json"))
    lines = (BUILTIN / "heldout_prompts.jsonl").read_text().splitlines()[:4]
    ps = [tok.encode(json.loads(line)["prompt"]).ids[-96:] for line in lines]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def engine(**spec: Any) -> Engine:
        overrides = {"engine.lanes": 2, "log.level": "warning", **{f"spec.{k}": v for k, v in spec.items()}}
        return Engine(load_config(profile="cpu", overrides=overrides))

    want = run(engine(backend="off"), ps, params)  # plain decoding, said explicitly: the default speculates
    for head in ("full", "shortlist", "int4"):
        spec = engine(backend="dflash2", draft_tokens=7, draft_head=head)
        got = run(spec, ps, params)
        assert all(got[r].token_ids == want[r].token_ids for r in want), head
        s = spec.stats()
        assert s.accepted > s.rounds, f"{head}: {s.accepted} drafts accepted in {s.rounds} rounds"
