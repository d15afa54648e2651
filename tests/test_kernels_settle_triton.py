"""A round's acceptance settled in one launch (ignis.kernels.settle_triton) against the torch ops it replaces
(ignis.engine.device_sampling.settle_reference), and `settle`'s choice of it.

Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET) on CPU tensors, over
rounds of 0 to 8 drafts in which lanes keep none, some or all of their drafts, are capped by `allowed`, and sample or
not; integers only, so every output equals the reference's. It also compiles for sm_90 here, in a child interpreter
without TRITON_INTERPRET. On a GPU: tests/test_kernels_gpu.py (the kernel on CUDA tensors, replayed from a graph)
and tests/test_engine_gpu.py (the device round, whose graph rounds are compared with eager ones and with `off`).
"""

from __future__ import annotations

import pytest
import torch
from ignis.engine import device_sampling
from ignis.engine.device_sampling import settle_reference
from ignis.kernels import settle_triton

from tests.settle_rounds import round_of
from tests.sm90 import run_child

if torch.cuda.is_available():
    pytest.skip("the interpreter takes CPU tensors: the GPU round runs the kernel", allow_module_level=True)


@pytest.mark.parametrize("k", [0, 1, 3, 7, 8])
@pytest.mark.parametrize("b", [1, 5])
@pytest.mark.parametrize("sampled", [False, True])
def test_the_kernel_settles_a_round_as_the_reference_does(k: int, b: int, sampled: bool) -> None:
    drafts, argmax, allowed, *rest = round_of(b, k, seed=100 * k + 10 * b + sampled, sampled=sampled)
    extra = tuple(rest) if sampled else None
    got_back, want_back = torch.full((b, k + 2), -1), torch.full((b, k + 2), -1)
    got = settle_triton.settle(drafts, argmax, allowed, got_back, extra)
    want = settle_reference(drafts, argmax, allowed, want_back, extra)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert torch.equal(got_back, want_back)
    if k and not sampled:  # the rounds held lanes keeping none and lanes keeping some
        assert {0} < set(want[0].tolist()) or b == 1


def test_every_draft_kept_and_none_kept() -> None:
    argmax = torch.tensor([[4, 5, 6, 7], [4, 5, 6, 7], [4, 5, 6, 7]])
    drafts = torch.tensor([[4, 5, 6], [9, 5, 6], [4, 5, 6]])
    allowed = torch.tensor([3, 3, 1])
    back = torch.empty(3, 5, dtype=torch.int64)
    accepted, token, following = settle_triton.settle(drafts, argmax, allowed, back)
    assert accepted.tolist() == [3, 0, 1] and token.tolist() == [7, 4, 5]
    assert following.tolist() == [[4, 5, 6, 7], [4, 5, 6, 4], [4, 5, 6, 5]]
    assert back.tolist() == [[3, 4, 5, 6, 7], [0, 9, 5, 6, 4], [1, 4, 5, 6, 5]]


def test_strided_drafts_are_read_as_they_lie() -> None:
    drafts, argmax, allowed = round_of(4, 5, seed=7, sampled=False)
    wide = torch.zeros(4, 9, dtype=torch.int64)
    wide[:, 2:7] = drafts
    got_back, want_back = torch.empty(4, 7, dtype=torch.int64), torch.empty(4, 7, dtype=torch.int64)
    got = settle_triton.settle(wide[:, 2:7], argmax, allowed, got_back)
    want = settle_reference(drafts, argmax, allowed, want_back)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)) and torch.equal(got_back, want_back)


def test_shapes_are_checked() -> None:
    drafts, argmax, allowed = round_of(2, 3, seed=1, sampled=False)
    with pytest.raises(ValueError, match="read_back"):
        settle_triton.settle(drafts, argmax, allowed, torch.empty(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="argmax"):
        settle_triton.settle(drafts, argmax[:, :3], allowed, torch.empty(2, 5, dtype=torch.int64))


def test_cpu_tensors_keep_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("the kernel ran on CPU tensors")

    monkeypatch.setattr(settle_triton, "settle", refuse)
    drafts, argmax, allowed = round_of(3, 4, seed=2, sampled=False)
    back = torch.empty(3, 6, dtype=torch.int64)
    accepted, token, following = device_sampling.settle(drafts, argmax, allowed, back)
    assert torch.equal(back[:, 0], accepted) and torch.equal(back[:, -1], token)


COMPILE = r"""
from ignis.kernels.settle_triton import _settle
from tests.sm90 import build, spills

types = {n: "*i64" for n in ("drafts", "argmax", "allowed", "sampled_accepted", "sampled_token", "greedy",
                             "accepted_out", "token_out", "following", "read_back")} | {"draft_stride": "i64"}
for k in (0, 3, 7):
    for sampled in (False, True):
        block = max(2, 1 << k.bit_length())
        kernel = build(_settle, types, {"SAMPLED": sampled, "BLOCK": block}, (), 1, 1)
        assert ".target sm_90a" in kernel.asm["ptx"] and spills(kernel) == 0, (k, sampled)
        print("ok", k, sampled)
"""


def test_kernel_compiles_for_sm90() -> None:
    assert run_child(COMPILE).count("ok") == 6
