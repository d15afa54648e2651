"""The selector's kernels after the proposal head: the CUDA C++ top-k compiles for sm_90 without spills, and the
Triton rescoring of the 4-bit head's candidates and greedy walk pick what the torch path they replace picks. The
Triton kernels run in Triton's interpreter on the CPU; small integers make every sum exact, so the kernels' other
order of summation cannot hide a wrong pick, and ties test the tie rules. The top-k's results are tested on the GPU
(tests/test_selector_triton_gpu.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")


@pytest.fixture
def on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The selector's fused paths run on CPU tensors (the Triton kernels in the interpreter; the top-k's reference)."""
    from ignis.backends.dflash2 import packed_head, selector

    monkeypatch.setattr(selector, "fused_on", lambda x: selector.FUSED)
    monkeypatch.setattr(packed_head, "fused_on", lambda x: selector.FUSED)


def test_the_topk_kernels_compile_for_sm90_without_spills() -> None:
    from ignis.kernels.launch import nvrtc_installed

    if not nvrtc_installed():
        pytest.skip("needs cuda-python's NVRTC bindings")
    from ignis.kernels import topk_cuda
    from ignis.kernels.nvrtc import compile_cubin
    from ignis.kernels.topk_cuda_kernel import SOURCE

    for bf16 in (0, 1):
        cubin = compile_cubin(SOURCE, "topk", "sm_90", (("BF16", bf16), ("UNROLL", topk_cuda.UNROLL)))
        assert cubin.spills == 0 and cubin.stack == 0, (bf16, cubin.registers, cubin.spills, cubin.stack)


def test_the_topk_kernel_refuses_what_it_does_not_take() -> None:
    from ignis.kernels import topk_cuda

    x = torch.randn(2, 100)
    assert not topk_cuda.fits(x, 4)  # CPU tensors: the kernels run on CUDA
    with pytest.raises(ValueError, match="topk_cuda takes"):
        topk_cuda.topk(x, 4)
    assert topk_cuda.chunks(7, 248320, 132) == 61 and topk_cuda.chunks(56, 248320, 132) == 19
    assert topk_cuda.chunks(1, 300, 132) == 1  # a short row: one chunk


def _integer_head(vocab: int, hidden: int, seed: int) -> torch.Tensor:
    return torch.randint(-3, 4, (vocab, hidden), generator=torch.Generator().manual_seed(seed)).float()


def test_rescore_takes_the_k_best_by_the_heads_rows_ties_to_the_smaller_id(on_cpu: None) -> None:
    from ignis.kernels import selector_triton

    vocab, hidden, rows, width, k = 400, 600, 5, 24, 16  # two slices of the hidden size, the last one short
    head = _integer_head(vocab, hidden, 1)
    head[301] = head[77]  # equal logits everywhere: 77 before 301
    g = torch.Generator().manual_seed(2)
    x = torch.randint(-2, 3, (rows, hidden), generator=g).float()
    wide = torch.stack([torch.randperm(vocab, generator=g)[:width] for _ in range(rows)])
    others = [t for t in torch.randperm(vocab, generator=g).tolist() if t not in (77, 301)]
    wide[0] = torch.tensor([301, 77, *others[: width - 2]])  # the later id first in the kernel's input
    x[0] = head[77] * 3  # 77 / 301 the row's best pair by far
    values, ids = selector_triton.rescore(x, head, wide, k)
    logits = torch.einsum("rwh,rh->rw", head[wide], x)  # exact: small integers
    by_id = wide.sort(dim=1)  # the reference's order: larger logit first, then the smaller id
    ranked = logits.gather(1, by_id.indices).sort(dim=1, descending=True, stable=True)
    assert torch.equal(ids, by_id.values.gather(1, ranked.indices[:, :k])) and torch.equal(values, ranked.values[:, :k])
    assert ids[0, :2].tolist() == [77, 301] and values[0, 0] == values[0, 1]
    with pytest.raises(ValueError, match="rescore takes"):
        selector_triton.rescore(x, head, wide, width + 1)


def test_the_packed_heads_fused_candidates_are_its_torch_paths(on_cpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from ignis.backends.dflash2 import selector
    from ignis.backends.dflash2.packed_head import PackedHead

    dense = _integer_head(900, 256, 4)
    head = PackedHead(dense, exact=False)
    hidden = torch.randint(-2, 3, (1, 5, 256), generator=torch.Generator().manual_seed(5)).float()
    logits = head.logits(hidden)
    got = head.candidates(hidden, logits, 16)
    monkeypatch.setattr(selector, "FUSED", False)  # the torch path
    want = head.candidates(hidden, logits, 16)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


@pytest.mark.parametrize("k,top_k,width,flat", [(7, 16, 64, False), (5, 6, 64, False), (1, 8, 64, False),
                                                 (3, 16, 10, False), (7, 16, 64, True)])
def test_the_walk_making_its_edges_picks_what_the_loop_picks(on_cpu: None, k: int, top_k: int, width: int,
                                                              flat: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Integer codebooks and hidden projections make every score exact, with many ties: the kernel's picks must be
    the loop's, slot after slot, ties to the earlier candidate."""
    from ignis.backends.base import Choice
    from ignis.backends.dflash2 import selector
    from test_dflash2_parts import _selector_setup

    vocab = 64
    cfg, sel = _selector_setup(vocab, top_k=top_k, seed=k)
    g = torch.Generator().manual_seed(top_k)
    with torch.no_grad():
        sel.predecessor_codebook.copy_(torch.randint(-2, 3, sel.predecessor_codebook.shape, generator=g))
        sel.successor_codebook.copy_(torch.randint(-2, 3, sel.successor_codebook.shape, generator=g))
        sel.hidden_projection.weight.copy_(torch.randint(-1, 2, sel.hidden_projection.weight.shape, generator=g))
    n = 4
    hidden = torch.randint(-1, 2, (n, k, cfg.hidden_size), generator=g).float()
    logits = torch.round(torch.randn(n, k, width, generator=g) * 2) / 2
    if flat:  # equal logits, so the edges alone decide, and they tie often
        logits.zero_()
    ids = None if width == vocab else torch.randperm(vocab, generator=g)[:width]  # a shortlist's columns
    anchors = torch.randint(0, vocab, (n,), generator=g)
    choice = Choice(torch.zeros(n), None)
    with torch.no_grad():
        got, q = selector.select(cfg, sel, hidden, logits, ids, anchors, choice, vocab)
        monkeypatch.setattr(selector, "FUSED", False)  # the torch path
        want, _ = selector.select(cfg, sel, hidden, logits, ids, anchors, choice, vocab)
    assert q is None and torch.equal(got, want)


def test_the_walk_refuses_mismatched_shapes() -> None:
    from ignis.kernels import selector_triton

    unary, cand = torch.zeros(2, 3, 4), torch.zeros(2, 3, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="walk takes"):
        selector_triton.walk(unary, cand, torch.zeros(2, 3, 8), torch.zeros(10, 6), torch.zeros(10, 6),
                             torch.zeros(2, dtype=torch.long))
