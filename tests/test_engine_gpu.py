"""The model and the round on a real GPU: fla agrees with the torch path, bf16 logits track the exact CPU model, and
speculative greedy output equals plain decoding up to near-ties. Needs CUDA; CI has none."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engines import make_engine
from ignis.artifact import BUILTIN
from ignis.engine.core import Engine
from ignis.ipc.messages import EngineRequest
from ignis.model.batch import Batch, Segment
from ignis.model.cache import LaneCache
from ignis.model.delta_rule import fla_chunk
from ignis.model.loader import load_model
from ignis.params import SamplingParams
from ignis.tokenizer import Tokenizer

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Parse the arguments and run.\"\"\"\n"


def _prefill_logits(device: str, dtype: torch.dtype, exact: bool) -> torch.Tensor:
    model = load_model(BUILTIN, device=device, dtype=dtype, exact=exact)
    ids = torch.tensor(Tokenizer.from_dir(BUILTIN).encode(PROMPT), device=device)
    n = ids.shape[0]
    cache = LaneCache(model.config, lanes=1, context=256, max_cols=1, device=device, dtype=dtype)
    batch = Batch(ids, torch.arange(n, device=device), (Segment(0, 0, 0, n, prefill=True),), torch.arange(n, device=device))
    return model(batch, cache).logits.float().cpu()


@pytest.mark.parametrize("first", [1, 7, 16])
def test_a_prefill_in_two_chunks_gives_the_logits_of_one(first: int) -> None:
    """The second chunk starts at `first` (a masked attention: queries at first.., keys 0..n-1), as a long prompt's
    later chunks and a resumed retained slot run; it must give the rows the one-chunk prefill gives."""
    model = load_model(BUILTIN, device="cuda", dtype=torch.bfloat16, exact=False)
    ids = torch.tensor(Tokenizer.from_dir(BUILTIN).encode(PROMPT), device="cuda")
    n = ids.shape[0]
    rows = torch.arange(n, device="cuda")

    def run(cuts: list[int]) -> torch.Tensor:
        cache = LaneCache(model.config, lanes=1, context=256, max_cols=1, device="cuda", dtype=torch.bfloat16)
        out = []
        for a, b in itertools.pairwise(cuts):
            seg = (Segment(0, 0, a, b - a, prefill=True),)
            out.append(model(Batch(ids[a:b], rows[a:b], seg, torch.arange(b - a, device="cuda")), cache).logits)
        return torch.cat(out).float().cpu()

    whole, split = run([0, n]), run([0, first, n])
    err = float((split - whole).norm() / whole.norm())
    assert err < 2e-2, err
    assert float((split.argmax(-1) == whole.argmax(-1)).float().mean()) > 0.9


def test_a_later_prefill_chunk_attends_bottom_right_without_a_mask_in_memory() -> None:
    """A 27B-shaped attention layer (24 query heads on 4 KV heads, width 256): a 512-row chunk at position 65,024 of a
    prompt attends as the boolean-mask SDPA does, and without scores or a mask of the whole span in memory (at
    262,144 keys those would be tens of GiB)."""
    from ignis.model.attention import GatedAttention
    from ignis.model.config import ModelConfig
    from ignis.model.random import _full_config
    from tools.round_work import QWEN35_27B

    with torch.device("meta"):  # only its head counts and scale are used
        layer = GatedAttention(ModelConfig.from_dict(_full_config(QWEN35_27B, mtp=False)))
    length, n = 512, 65536
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(length, 24, 256, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(n, 4, 256, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(n, 4, 256, device="cuda", dtype=torch.bfloat16, generator=g)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    got = layer._attend_sdpa(q, k, v, n - length)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    assert peak < 64 * 2**20, f"{peak / 2**20:.0f} MiB for a 512 x 65,536 chunk"
    mask = torch.arange(n, device="cuda")[None, :] <= (n - length + torch.arange(length, device="cuda"))[:, None]
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None].float(), k.transpose(0, 1)[None].float(), v.transpose(0, 1)[None].float(),
        attn_mask=mask, scale=layer.scale, enable_gqa=True)[0].transpose(0, 1)
    err = float((got.float() - want).norm() / want.norm())
    assert err < 1e-2, err


def test_fla_is_used_only_where_it_agrees_with_torch() -> None:
    pytest.importorskip("fla")
    cfg = load_model(BUILTIN, device="cpu", dtype=torch.float32, exact=True).config
    kernel = fla_chunk(cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                       cfg.linear_value_head_dim, torch.bfloat16, torch.device("cuda"))
    assert kernel is not None, "fla is installed but disagrees with the torch chunked form at the built-in shape"


def test_packed_prefill_agrees_with_one_fla_call_a_segment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three prompts prefilled in one step: fla's packed call (cu_seqlens) against one call a segment, bf16."""
    pytest.importorskip("fla")
    from ignis.model import delta_rule, gdn

    model = load_model(BUILTIN, device="cuda", dtype=torch.bfloat16, exact=False)
    c = model.config
    shape = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
             torch.bfloat16, torch.device("cuda", 0))
    assert delta_rule.fla_varlen(*shape) is not None, "fla's packed call disagrees with the torch chunked form"
    ids = Tokenizer.from_dir(BUILTIN).encode(PROMPT * 8)
    lengths = [len(ids), 70, 129]
    assert len(ids) >= max(lengths)

    def run() -> tuple[torch.Tensor, LaneCache]:
        cache = LaneCache(c, lanes=3, context=512, max_cols=1, device="cuda", dtype=torch.bfloat16)
        segs, offset = [], 0
        for lane, n in enumerate(lengths):
            segs.append(Segment(lane, offset, 0, n, prefill=True))
            offset += n
        tokens = torch.tensor([t for n in lengths for t in ids[:n]], device="cuda")
        positions = torch.cat([torch.arange(n) for n in lengths]).cuda()
        return model(Batch(tokens, positions, tuple(segs), torch.arange(offset, device="cuda")), cache).logits, cache

    packed, packed_cache = run()
    with monkeypatch.context() as m:
        m.setattr(gdn, "prefill_kernels", lambda layer, exact, x: (delta_rule.fla_chunk(*shape), False))
        single, single_cache = run()
    err = float((packed.float() - single.float()).norm() / single.float().norm())
    assert err < 1e-2, err
    for a, b in zip(packed_cache.layers, single_cache.layers):
        if hasattr(a, "state"):
            assert float((a.state - b.state).norm() / b.state.norm()) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_logits_track_the_exact_cpu_model(dtype: torch.dtype) -> None:
    ref = _prefill_logits("cpu", torch.float32, exact=True)
    got = _prefill_logits("cuda", dtype, exact=False)
    err = float((got - ref).norm() / ref.norm())
    assert err < (1e-3 if dtype == torch.float32 else 3e-2), err
    agree = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    assert agree > (0.99 if dtype == torch.float32 else 0.9)


def _greedy(engine, ids: list[int], n: int) -> tuple[list[int], list[dict[int, float]]]:
    engine.add(EngineRequest(id="g", prompt_token_ids=ids, params=SamplingParams(max_tokens=n, temperature=0.0,
                                                                                 ignore_eos=True, logprobs=2)))
    tokens: list[int] = []
    logprobs: list[dict[int, float]] = []
    while True:
        for d in engine.step():
            tokens += d.token_ids
            logprobs += d.logprobs or []
            if d.finished:
                return tokens, logprobs


def _prepared(monkeypatch: pytest.MonkeyPatch, on: bool) -> None:
    """Switch the kernels that wait on a round's measurement, or that a round measured no faster (the CUDA C++
    recurrence holding a whole head with the gated norm, the CUDA C++ conv at every size, the streamed products), on
    or leave them as they are."""
    if on:
        from ignis.kernels import fused, gdn
        from ignis.model import ops

        monkeypatch.setattr(gdn, "CUDA_COLUMNS", True)
        monkeypatch.setattr(gdn, "CUDA_NORMED", True)
        monkeypatch.setattr(fused, "CUDA_CONV", True)
        monkeypatch.setattr(ops, "STREAMING", True)


@pytest.mark.parametrize("prepared", [False, True], ids=["default kernels", "prepared kernels"])
@pytest.mark.parametrize("backend,k", [("mtp", 3), ("dflash2", 7)])
def test_speculative_greedy_equals_off_up_to_near_ties(backend: str, k: int, prepared: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    _prepared(monkeypatch, prepared)
    ids = Tokenizer.from_dir(BUILTIN).encode(PROMPT)
    fp32 = {"device": "cuda", "dtype": "float32"}
    off, off_lp = _greedy(make_engine(BUILTIN, "off", model=fp32, lanes=1), ids, 96)
    spec, _ = _greedy(make_engine(BUILTIN, backend, draft_tokens=k, model=fp32, lanes=1), ids, 96)
    if off != spec:
        i = next(j for j, (a, b) in enumerate(zip(off, spec)) if a != b)
        top = sorted(off_lp[i].values(), reverse=True)
        assert top[0] - top[1] < 1e-3, f"diverged at {i} without a near-tie (gap {top[0] - top[1]:.2e})"


def _heldout(n: int) -> list[list[int]]:
    import json

    tok = Tokenizer.from_dir(BUILTIN)
    lines = (BUILTIN / "heldout_prompts.jsonl").read_text().splitlines()[:n]
    return [tok.encode(json.loads(line)["prompt"])[-200:] for line in lines]


@pytest.mark.parametrize("prepared", [False, True], ids=["default kernels", "prepared kernels"])
@pytest.mark.parametrize("backend,k", [("off", 0), ("mtp", 3), ("dflash2", 7)])
@pytest.mark.parametrize("lanes", [1, 8])
def test_graph_rounds_give_the_eager_rounds_tokens(backend: str, k: int, lanes: int, prepared: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The captured round replays exactly the kernels the eager device round runs: same bf16 tokens."""
    _prepared(monkeypatch, prepared)

    def check(engine: Engine, graphs: bool) -> None:
        assert engine.runner.device_round is not None and engine.runner.device_prefill is not None
        assert bool(engine.runner.device_round.graphs) == graphs == bool(engine.runner.device_prefill.graphs)

    graph, eager = _graph_and_eager_tokens(BUILTIN, backend, k, lanes, check)
    assert graph == eager


@pytest.mark.parametrize("head", ["auto", "int4"])
@pytest.mark.parametrize("lanes", [1, 8])
def test_graph_rounds_with_the_mtp_layer_drafting_slot_one_give_the_eager_rounds_tokens(
        lanes: int, head: str, tmp_path: Path) -> None:
    """A dflash2 drafter with first_draft "mtp" (random weights beside the built-in target): the MTP layer's first
    draft and its keys, then the drafter's block, captured in the round's graph, give the eager rounds' tokens; with
    spec.draft_head = "int4" slot 1 too is chosen among the 4-bit head's candidates."""
    from ignis.backends.dflash2.weights import save_random_drafter
    from ignis.model.config import ModelConfig

    model = tmp_path / "model"
    model.mkdir()
    for f in BUILTIN.iterdir():
        if f.name != "drafter":
            (model / f.name).symlink_to(f)
    save_random_drafter(model / "drafter", ModelConfig.from_dir(BUILTIN), seed=3, num_layers=2, taps=3,
                        first_draft="mtp", dtype=torch.bfloat16)

    def check(engine: Engine, graphs: bool) -> None:
        assert engine.runner.device_round is not None and bool(engine.runner.device_round.graphs) == graphs
        first = getattr(engine.backend, "first", None)
        assert first is not None and (first.head is not None) == (head == "int4")

    graph, eager = _graph_and_eager_tokens(model, "dflash2", 7, lanes, check, spec={"draft_head": head})
    assert graph == eager


@pytest.mark.parametrize("lanes", [1, 8])
def test_graph_rounds_of_mtp_through_the_4bit_head_give_the_eager_rounds_tokens(lanes: int) -> None:
    """The mtp backend with spec.draft_head = "int4": each draft's 4-bit logits, top-k and rescoring by the 16-bit
    rows, captured in the round's graph, give the eager rounds' tokens."""
    def check(engine: Engine, graphs: bool) -> None:
        assert engine.runner.device_round is not None and bool(engine.runner.device_round.graphs) == graphs
        assert getattr(engine.backend, "head", None) is not None

    graph, eager = _graph_and_eager_tokens(BUILTIN, "mtp", 3, lanes, check, spec={"draft_head": "int4"})
    assert graph == eager


def _graph_and_eager_tokens(path: Path, backend: str, k: int, lanes: int, check: Callable[[Engine, bool], None],
                            spec: dict[str, str] | None = None) -> list[dict[str, list[int]]]:
    """Greedy tokens of 8 held-out prompts from an engine over `path` (spec: its spec keys) with CUDA graphs, then
    from one without; `check` sees each engine and whether it captured, before it runs."""
    from engines import run

    ps = _heldout(8)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    outs = []
    for graphs in (True, False):
        engine = make_engine(path, backend, draft_tokens=k, profile="h200", spec=spec, lanes=lanes, context=1024,
                             cuda_graphs=graphs)
        check(engine, graphs)
        outs.append({rid: d.token_ids for rid, d in run(engine, ps, params).items()})
    return outs


@pytest.mark.parametrize("backend,k", [("off", 0), ("dflash2", 7)])
@pytest.mark.parametrize("lanes", [1, 8])
def test_chained_graph_rounds_give_single_rounds_tokens(backend: str, k: int, lanes: int,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """engine.rounds_per_sync = 2: rounds replayed back to back, the second from the first's outputs on the device,
    give the tokens of one round at a time, and did chain."""
    from engines import run
    from ignis.engine.device_round import DeviceRound

    ps = _heldout(8)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    outs, chained = [], []
    start = DeviceRound.start
    monkeypatch.setattr(DeviceRound, "start", lambda dr, decodes, n=1: (chained.append(n), start(dr, decodes, n))[1])
    for rounds in (2, 1):
        engine = make_engine(BUILTIN, backend, draft_tokens=k, profile="h200", lanes=lanes, context=1024,
                             rounds_per_sync=rounds)
        assert engine.runner.device_round is not None and engine.runner.device_round.graphs
        outs.append({rid: d.token_ids for rid, d in run(engine, ps, params).items()})
    assert outs[0] == outs[1] and 2 in chained


@pytest.mark.parametrize("backend,k", [("off", 0), ("dflash2", 7)])
@pytest.mark.parametrize("lanes", [1, 8])
def test_async_graph_rounds_give_the_synchronous_rounds_tokens(backend: str, k: int, lanes: int,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """engine.async_scheduling: each round's graph replayed before the host reads the last one, from its outputs on
    the device, gives the bits of rounds read one at a time, and rounds did follow one another. Under one key span
    and one lane bucket: a followed round's span covers a round more than the host has read, so near a rung of the
    span ladder it can take the next rung, whose attention splits its keys otherwise (ignis.kernels.attention.splits);
    and a lane whose request stopped runs one round more, so the others can stay a round longer in a larger bucket,
    whose bf16 products cuBLAS may sum otherwise. Either rounds the same tokens' sums otherwise, as a lane beside
    longer or more lanes does in any round."""
    from engines import run
    from ignis.engine import device_round
    from ignis.engine.device_round import DeviceRound

    monkeypatch.setattr(device_round, "MIN_SPAN", 1 << 20)  # one rung: every round reads the context's slots
    monkeypatch.setattr(device_round, "buckets", lambda lanes: [lanes])  # every round pads to the engine's lanes
    ps = _heldout(8)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    outs, follows = [], []
    follow = DeviceRound.follow
    monkeypatch.setattr(DeviceRound, "follow", lambda dr, launched: (follows.append(1), follow(dr, launched))[1])
    for overlap in (True, False):
        engine = make_engine(BUILTIN, backend, draft_tokens=k, profile="h200", lanes=lanes, context=1024,
                             async_scheduling=overlap)
        assert engine.runner.device_round is not None and len(engine.runner.device_round.spans) == 1
        outs.append({rid: d.token_ids for rid, d in run(engine, ps, params).items()})
    diverged = {rid: next((i for i, (a, b) in enumerate(zip(outs[0][rid], outs[1][rid])) if a != b), None)
                for rid in outs[1] if outs[0][rid] != outs[1][rid]}
    assert not diverged, f"first differing token of each request that differs: {diverged}"
    assert len(follows) >= 3, len(follows)  # eight lanes of 48 tokens: the rounds with room for two more


@pytest.mark.parametrize(("weights", "head"), [("int4", "full"), ("int4", "int4"), ("int4-greedy", "int4")])
@pytest.mark.parametrize("lanes", [1, 8])
def test_an_int4_drafter_in_graph_rounds_gives_the_eager_rounds_tokens(lanes: int, weights: str, head: str) -> None:
    """spec.draft_weights = "int4" (and spec.draft_head = "int4", the target's head in 4 bits): the drafter's
    projections (and head) held in the mma kernel's order run under capture, and the captured round gives the eager
    device round's tokens; so do greedy rounds of one and two lanes through the 4-bit copy of "int4-greedy"."""
    from engines import run
    from ignis.config import load_config
    from ignis.engine.core import Engine
    from ignis.quant.linear import QuantLinear

    ps = _heldout(8)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    outs = []
    for graphs in (True, False):
        engine = Engine(load_config(profile="h200", overrides={
            "model.path": str(BUILTIN), "spec.backend": "dflash2", "spec.draft_tokens": 7,
            "spec.draft_weights": weights, "spec.draft_head": head, "engine.lanes": lanes, "engine.context": 1024,
            "engine.cuda_graphs": graphs, "log.level": "warning"}))
        backend = engine.runner.backend
        drafter = backend.greedy_model if weights == "int4-greedy" else backend.model
        packed = [m for m in drafter.modules() if isinstance(m, QuantLinear)]
        assert packed and all(m.mma is not None for m in packed)
        packed_head = engine.runner.backend.packed_head
        assert (packed_head is not None and packed_head.module is not None and packed_head.module.mma is not None) \
            == (head == "int4")
        assert bool(engine.runner.device_round.graphs) == graphs
        outs.append({rid: d.token_ids for rid, d in run(engine, ps, params).items()})
    assert outs[0] == outs[1]


@pytest.fixture(scope="module")
def int4_builtin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in model converted to 4 bits (groups of 128, `ignis quantize`), its drafter beside it."""
    from ignis.quant.convert import convert

    path = tmp_path_factory.mktemp("int4") / "builtin-int4"
    convert(BUILTIN, path, group=128)
    return path


@pytest.mark.parametrize("backend,k", [("off", 0), ("dflash2", 7)])
@pytest.mark.parametrize("lanes", [1, 8])
def test_a_4bit_targets_graph_rounds_give_the_eager_rounds_tokens(backend: str, k: int, lanes: int,
                                                                 int4_builtin: Path) -> None:
    """A 4-bit target's rounds of at most 8 rows launch programmatic-dependent, the Gated DeltaNet's conv and
    recurrence (with its gated norm) among them: the captured rounds give the eager device rounds' tokens."""
    from ignis.kernels import launch

    def check(engine: Engine, graphs: bool) -> None:
        dr = engine.runner.device_round
        assert dr is not None and dr.pdl_rows == launch.PACKED_PDL_ROWS  # a repacked target's rounds
        assert bool(dr.graphs) == graphs

    graph, eager = _graph_and_eager_tokens(int4_builtin, backend, k, lanes, check)
    assert graph == eager


@pytest.mark.parametrize("backend,k", [("off", 0), ("dflash2", 7)])
def test_the_device_prefill_gives_the_host_prefills_first_token(backend: str, k: int) -> None:
    """In fp32, prompts of 1 to 200 tokens: the graph pieces' first token and its log-probability are the host
    prefill's (fla's chunked form against the pieces' recurrence)."""
    ps = [p[: 1 + 37 * i] for i, p in enumerate(_heldout(6))]
    fp32 = {"device": "cuda", "dtype": "float32"}
    outs = []
    for device in (True, False):
        engine = make_engine(BUILTIN, backend, draft_tokens=k, model=fp32, lanes=2, context=1024)
        assert engine.runner.device_prefill is not None and engine.runner.device_prefill.graphs
        if not device:
            engine.runner.device_prefill = None
        outs.append([_greedy(engine, ids, 1) for ids in ps])
    for (dev_ids, dev_lp), (host_ids, host_lp) in zip(*outs):
        assert dev_ids == host_ids
        t = dev_ids[0]
        assert abs(dev_lp[0][t] - host_lp[0][t]) < 1e-3, (dev_lp, host_lp)


@pytest.mark.parametrize("rows", [64, 256])
def test_a_long_piece_in_flas_chunked_form_leaves_the_recurrent_kernels_state(rows: int,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-lane piece of at least CHUNKED_COLUMNS rows runs fla's chunked recurrence: in bf16 every GDN layer's
    state after it and its last row's logits are the recurrent kernel's (CHUNKED_COLUMNS = 0), within the tolerance
    fla's own check allows in bf16 (fla's products take bf16 q, k, v; the recurrent kernel keeps them in fp32). fla
    does not pass its check in fp32 on the H200 (TF32 products), so fp32 engines keep the recurrent kernel."""
    from ignis.engine.request import Request
    from ignis.engine.sampling import make_generator
    from ignis.model import gdn
    from ignis.model.cache import GDNState

    engine = make_engine(BUILTIN, "off", model={"device": "cuda", "dtype": "bfloat16"}, lanes=1, context=1024,
                         cuda_graphs=False)
    dp, c = engine.runner.device_prefill, engine.model.config
    assert dp is not None and rows in dp.buffers
    assert fla_chunk(c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                     c.linear_value_head_dim, torch.bfloat16, torch.device("cuda", 0)) is not None
    ids = (_heldout(2)[0] + _heldout(2)[1])[:rows]
    r = Request(id="p", prompt=ids, params=SamplingParams(max_tokens=1, temperature=0.0), stop_ids=frozenset(),
                generator=make_generator(0), seed=0)
    r.lane = 0
    assert engine.pages.grow(0, rows)  # the lane's pages (the scheduler's work when a round runs)
    dp.cache.pool.map(engine.pages.take_updates())
    after = []
    for columns in (gdn.CHUNKED_COLUMNS, 0):
        monkeypatch.setattr(gdn, "CHUNKED_COLUMNS", columns)
        dp.cache.reset(0)
        dp.buffers[rows].load(r, 0, -1)
        dp.forward(dp.buffers[rows], dp.span(rows))
        states = [s.state[0].clone() for s in dp.cache.layers if isinstance(s, GDNState)]
        after.append((states, dp.logits.clone()))
    (chunked, lc), (recurrent, lr) = after
    for a, b in zip(chunked, recurrent):
        assert float((a - b).norm() / b.norm()) < 2e-2
    assert float((lc - lr).norm() / lr.norm()) < 2e-2


@pytest.mark.parametrize("drafter", ["default", "int4", "int4-greedy", "mtp", "mtp-int4"])
def test_seeded_sampling_on_the_gpu_is_the_same_alone_and_beside_others(drafter: str) -> None:
    """Alone the round runs one lane (7 draft rows), beside others four (28): with the 4-bit drafter (projections and
    head) the head then takes its two paths, 4-bit logits scored again below 16 rows and the 16-bit head above; the
    4-bit copy of "int4-greedy" drafts no sampled round, alone or not; mtp draws its sampled drafts from its own softmax
    over the vocabulary, or over the 4-bit head's candidates."""
    from engines import run
    from ignis.config import load_config

    def engine() -> Engine:
        spec = {"spec.draft_head": "int4", "spec.draft_weights": drafter} if drafter.startswith("int4") else {}
        if drafter == "mtp-int4":
            spec = {"spec.draft_head": "int4"}
        backend = {"spec.backend": "mtp", "spec.draft_tokens": 3} if drafter.startswith("mtp") else {
            "spec.backend": "dflash2", "spec.draft_tokens": 7}
        return Engine(load_config(profile="h200", overrides={
            "model.path": str(BUILTIN), **backend, "engine.lanes": 4, "engine.context": 1024, "log.level": "warning",
            **spec}))

    ps = _heldout(4)
    sampled = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, top_k=20, seed=99, ignore_eos=True)
    others = [SamplingParams(max_tokens=40, temperature=1.0, seed=i, ignore_eos=True) for i in range(3)]
    alone = run(engine(), ps[:1], sampled)["0"].token_ids
    crowd = run(engine(), ps, [sampled] + others)["0"].token_ids
    assert alone == crowd
