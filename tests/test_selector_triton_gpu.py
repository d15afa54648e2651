"""The selector's kernels on a real GPU at the 27B's vocabulary (248,320) and hidden size (5,120): the two-launch CUDA
top-k against the order's reference, the 4-bit head's rescoring and the greedy walk against the torch path they
replace (small integers in bf16 make every sum exact, so any difference is a wrong pick, not a rounding), and all of
them under CUDA-graph replay. Needs CUDA; CI has none (tests/test_kernels_selector_triton.py runs the same kernels in
Triton's interpreter)."""

from __future__ import annotations

import pytest
import torch

from ignis.backends.base import Choice
from ignis.backends.dflash2 import selector
from ignis.backends.dflash2.packed_head import PackedHead
from ignis.kernels import selector_triton, topk_cuda
from ignis.kernels.topk import topk_reference

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

CUDA = torch.device("cuda")
BF16 = torch.bfloat16
VOCAB, HIDDEN = 248320, 5120


@pytest.mark.parametrize("rows", [1, 7, 14, 56, 300])
@pytest.mark.parametrize("k", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_topk_is_the_references_order_at_the_vocabulary(rows: int, k: int, dtype: torch.dtype) -> None:
    g = torch.Generator(device=CUDA).manual_seed(rows * k)
    x = (torch.round(torch.randn(rows, VOCAB, generator=g, device=CUDA) * 8) / 8).to(dtype)  # ties at every rank
    x[0, 5], x[0, 6] = -0.0, float("inf")
    x[-1, VOCAB - 1] = float("nan")
    values, ids = topk_cuda.topk(x, k)
    want_values, want_ids = topk_reference(x, k)
    assert torch.equal(ids, want_ids)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(values.view(bits), want_values.view(bits))


def test_topk_of_special_rows() -> None:
    """Rows that stress the filter: all equal (every key passes until the list fills, then the smallest columns
    win), ascending (every element is inserted), negative with -inf, a short row, and rows a stride apart."""
    wide = torch.randn(6, VOCAB + 64, device=CUDA)
    x = wide[:, :VOCAB]  # rows VOCAB + 64 apart
    x[0] = 1.0
    x[1] = torch.arange(VOCAB, device=CUDA, dtype=torch.float32)
    x[2] = -torch.rand(VOCAB, device=CUDA) - 1
    x[2, ::1000] = float("-inf")
    x[3] = float("nan")
    for k in (1, 7, 16, 32):
        values, ids = topk_cuda.topk(x, k)
        want_values, want_ids = topk_reference(x, k)
        assert torch.equal(ids, want_ids), k
        assert torch.equal(values.view(torch.int32), want_values.view(torch.int32)), k
    short = torch.randn(3, 40, device=CUDA, dtype=BF16)
    assert torch.equal(topk_cuda.topk(short, 32)[1], topk_reference(short, 32)[1])


def _integers(shape: tuple[int, ...], low: int, high: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device=CUDA).manual_seed(seed)
    return torch.randint(low, high, shape, generator=g, device=CUDA).to(BF16)


def test_the_packed_heads_fused_candidates_are_its_torch_paths_at_the_27b_head(monkeypatch: pytest.MonkeyPatch) -> None:
    dense = _integers((VOCAB, HIDDEN), -3, 4, 1)
    head = PackedHead(dense, exact=False)
    for lanes in (1, 2):  # 7 and 14 rows: the 4-bit head's rows
        hidden = _integers((lanes, 7, HIDDEN), -2, 3, lanes)
        with torch.inference_mode():
            logits = head.logits(hidden)
            monkeypatch.setattr(selector, "FUSED", True)
            assert selector.fused_on(logits)
            got = head.candidates(hidden, logits, 16)
            monkeypatch.setattr(selector, "FUSED", False)  # the torch path
            want = head.candidates(hidden, logits, 16)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def test_rescore_and_topk_replay_in_a_graph() -> None:
    dense = _integers((VOCAB, HIDDEN), -3, 4, 2)
    hidden = _integers((7, HIDDEN), -2, 3, 3)
    logits = torch.randn(7, VOCAB, device=CUDA, dtype=BF16)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        return selector_triton.rescore(hidden, dense, topk_cuda.topk(logits, 32)[1], 16)

    first = step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    logits.copy_(torch.randn(7, VOCAB, device=CUDA, dtype=BF16))
    graph.replay()
    want = step()
    assert torch.equal(out[1], want[1]) and torch.equal(out[0], want[0]) and not torch.equal(first[1], want[1])


def test_the_walk_making_its_edges_picks_what_the_loop_picks_at_the_27b_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    from ignis.backends.dflash2.config import DrafterConfig, drafter_config_json
    from ignis.backends.dflash2.model import Selector
    from test_dflash2_ring_gpu import ARCH
    from tools.round_work import QWEN35_27B

    from ignis.model.config import ModelConfig

    target = ModelConfig.from_dict(QWEN35_27B | ARCH)
    cfg = DrafterConfig.from_dict(drafter_config_json(
        target, num_layers=5, num_heads=32, num_kv_heads=8, head_dim=128, block_size=8,
        mask_token_id=target.vocab_size - 1, target_layer_ids=[1, 2, 3, 4, 5], selector_rank=256,
        selector_top_k=16), target)
    sel = Selector(cfg).to(CUDA, BF16)
    with torch.no_grad():  # small integers: every edge exact in fp32, ties frequent
        sel.predecessor_codebook.copy_(_integers(sel.predecessor_codebook.shape, -1, 2, 4))
        sel.successor_codebook.copy_(_integers(sel.successor_codebook.shape, -1, 2, 5))
        sel.hidden_projection.weight.copy_(_integers(sel.hidden_projection.weight.shape, 0, 2, 6))
    n, k = 8, 7
    hidden = _integers((n, k, HIDDEN), 0, 2, 7)
    for flat in (False, True):
        logits = torch.zeros(n, k, VOCAB, device=CUDA) if flat else torch.round(
            torch.randn(n, k, VOCAB, device=CUDA, generator=torch.Generator(device=CUDA).manual_seed(8)) * 4)
        anchors = torch.randint(0, VOCAB, (n,), device=CUDA, generator=torch.Generator(device=CUDA).manual_seed(9))
        choice = Choice(torch.zeros(n, device=CUDA), None)
        with torch.inference_mode():
            monkeypatch.setattr(selector, "FUSED", True)
            got, _ = selector.select(cfg, sel, hidden, logits, None, anchors, choice, VOCAB)
            monkeypatch.setattr(selector, "FUSED", False)  # the torch path
            want, _ = selector.select(cfg, sel, hidden, logits, None, anchors, choice, VOCAB)
        assert torch.equal(got, want), flat
