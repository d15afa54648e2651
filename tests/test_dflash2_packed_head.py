"""The 4-bit proposal head (spec.draft_head = "int4"): its candidates are the full head's where the 4-bit logits keep
them in their wider set, a row's candidates do not depend on the rows beside it, and a 4-bit target's head is used as
it is."""

from __future__ import annotations

import pytest
import torch

from ignis.backends.dflash2.packed_head import RESCORE, PackedHead, head_group, held_bytes
from ignis.backends.dflash2.selector import topk
from ignis.quant.linear import PackedWeight

VOCAB, HIDDEN, K = 1000, 256, 16


def _head(seed: int = 0) -> torch.Tensor:
    return torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(seed)) / HIDDEN**0.5


def _hidden(n: int, s: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, s, HIDDEN, generator=torch.Generator().manual_seed(seed))


def test_candidates_are_the_full_heads_top_k_where_the_4bit_logits_keep_them() -> None:
    dense = _head()
    head = PackedHead(dense, exact=True)
    hidden = _hidden(3, 7)
    four = head.logits(hidden)
    values, ids = head.candidates(hidden, four, K)
    full = hidden @ dense.T  # [3, 7, V]
    want_values, want_ids = topk(full.reshape(-1, VOCAB), K)
    kept = topk(four.reshape(-1, VOCAB), RESCORE * K)[1]  # the wider set the 4-bit logits keep
    inside = torch.tensor([set(w.tolist()) <= set(k.tolist()) for w, k in zip(want_ids, kept, strict=True)])
    # a random head's logits are far flatter than a trained one's, so a few rows lose a true candidate
    assert inside.sum() >= 0.8 * len(inside)
    assert torch.equal(ids.reshape(-1, K)[inside], want_ids[inside])
    torch.testing.assert_close(values.reshape(-1, K)[inside], want_values[inside], rtol=1e-6, atol=1e-6)
    # the 4-bit logits alone would have chosen other candidates in some rows: the rescoring is what restores them
    assert not torch.equal(topk(four.reshape(-1, VOCAB), K)[1], want_ids)


def test_a_rows_candidates_do_not_depend_on_the_rows_beside_it() -> None:
    head = PackedHead(_head(), exact=True)
    hidden = _hidden(4, 7)
    values, ids = head.candidates(hidden, head.logits(hidden), K)
    for lane in range(4):
        alone = hidden[lane:lane + 1]
        v, i = head.candidates(alone, head.logits(alone), K)
        assert torch.equal(v[0], values[lane]) and torch.equal(i[0], ids[lane])


def test_equal_logits_keep_the_smaller_id_first() -> None:
    dense = _head()
    dense[700] = dense[300]  # two tokens with the same row: the same logit everywhere
    head = PackedHead(dense, exact=True)
    hidden = _hidden(1, 1)
    hidden[0, 0] = dense[300] * 50  # makes 300 / 700 the best pair by far
    values, ids = head.candidates(hidden, head.logits(hidden), K)
    assert ids[0, 0, :2].tolist() == [300, 700] and values[0, 0, 0] == values[0, 0, 1]


def test_a_4bit_targets_own_head_is_used_as_it_is() -> None:
    from ignis.quant.format import quantize

    qweight, scales, qzeros = quantize(_head(), 128)
    packed = PackedWeight(qweight, scales.float(), qzeros)
    head = PackedHead(packed, exact=True)
    assert head.weight is packed and head.nbytes() == 0 and head.dense is None
    hidden = _hidden(2, 3)
    logits = head.logits(hidden)
    torch.testing.assert_close(logits, hidden @ packed.dequantize().float().T, rtol=1e-5, atol=1e-5)
    values, ids = head.candidates(hidden, logits, K)
    want_values, want_ids = topk(logits.reshape(-1, VOCAB), K)
    assert torch.equal(ids.reshape(-1, K), want_ids) and torch.equal(values.reshape(-1, K), want_values)


def test_the_head_is_refused_where_no_group_divides_the_hidden_size() -> None:
    with pytest.raises(ValueError, match="not a multiple of 64"):
        PackedHead(torch.randn(10, 96), exact=True)
    assert head_group(5120) == 128 and head_group(320) == 64
    assert held_bytes(248320, 5120, True, 2) == 248320 * 2560 + 248320 * 40 * 4


def test_past_the_packed_rows_the_16bit_head_gives_the_logits_outside_exact_mode() -> None:
    dense = _head()
    head = PackedHead(dense, exact=False)
    few, many = _hidden(2, 7), _hidden(3, 7)  # 14 rows: the 4-bit head; 21: the target's own
    assert not head.dense_rows(few) and head.dense_rows(many)
    torch.testing.assert_close(head.logits(many), many @ dense.T, rtol=1e-5, atol=1e-5)
    values, ids = head.candidates(many, head.logits(many), K)
    want_values, want_ids = topk((many @ dense.T).reshape(-1, VOCAB), K)
    assert torch.equal(ids.reshape(-1, K), want_ids)
    four = head.module.weight.dequantize()
    torch.testing.assert_close(head.logits(few), few @ four.T, rtol=1e-5, atol=1e-5)
    assert not PackedHead(dense, exact=True).dense_rows(many)  # exact mode: one path whatever the rows


def test_the_head_packed_a_slice_of_rows_at_a_time_is_the_head_packed_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    from ignis.backends.dflash2 import packed_head
    from ignis.quant.format import quantize

    dense = _head()
    monkeypatch.setattr(packed_head, "QUANTIZE_ROWS", 96)  # 11 slices, the last one short
    head = PackedHead(dense, exact=True)
    qweight, scales, qzeros = quantize(dense, 128)
    assert head.module is not None
    assert torch.equal(head.module.qweight, qweight) and torch.equal(head.module.qzeros, qzeros)
    assert torch.equal(head.module.scales, scales.float())


def test_auto_takes_the_4bit_head_for_a_large_16bit_head_on_a_gpu_only() -> None:
    from torch import nn

    from ignis.backends.dflash2.packed_head import resolve
    from ignis.quant.linear import QuantLinear

    class Target(nn.Module):  # what resolve reads of a model: its head, its projections, its exact flag
        def __init__(self, hidden: int, dtype: torch.dtype, exact: bool = False, quantized: bool = False) -> None:
            super().__init__()
            self.exact = exact
            self.lm_head = nn.Linear(hidden, 248320, bias=False, device="meta", dtype=dtype)
            self.proj = QuantLinear(128, 128, 128) if quantized else nn.Linear(4, 4)

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    big = Target(5120, torch.bfloat16)  # the 27B's head: 2.4 GiB in bf16
    assert resolve("auto", big, cuda) == "int4"
    assert resolve("auto", big, cpu) == "full"
    assert resolve("auto", Target(5120, torch.bfloat16, exact=True), cuda) == "full"
    assert resolve("auto", Target(1024, torch.bfloat16), cuda) == "full"  # 0.47 GiB: little to save
    assert resolve("auto", Target(5120, torch.float32), cuda) == "full"
    assert resolve("auto", Target(5120, torch.bfloat16, quantized=True), cuda) == "full"  # a 4-bit target
    for choice in ("full", "shortlist", "int4"):
        assert resolve(choice, big, cpu) == choice
