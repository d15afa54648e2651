"""The L2 prefetch of the next weight (ignis.kernels.l2_prefetch, ignis.model.prefetch) on the CPU: both forms of the
kernel compile for sm_90 without a spill, the launch checks its chunk, and a decode with the prefetch switched on is
the decode without it where the kernel cannot run. tests/test_engine_gpu.py runs it in graph and eager rounds."""

from __future__ import annotations

import pytest
import torch

from ignis.kernels import l2_prefetch
from ignis.kernels.nvrtc import compile_cubin
from ignis.model import prefetch
from ignis.model.cache import LaneCache
from ignis.model.decode import DecodeStep
from ignis.model.random import random_model
from tiny import TINY


@pytest.mark.parametrize("bulk", [True, False])
def test_both_forms_compile_for_sm90_without_spills(bulk: bool) -> None:
    cubin = compile_cubin(l2_prefetch.SOURCE, "l2_prefetch", "sm_90", l2_prefetch.defines(bulk))
    assert cubin.spills == 0 and cubin.stack == 0 and 0 < cubin.registers <= 32


def test_the_kernel_takes_only_cuda_weights_and_whole_lines() -> None:
    w = torch.zeros(64, 64)
    assert not l2_prefetch.fits(w)
    with pytest.raises(ValueError, match="CUDA"):
        l2_prefetch.prefetch(w, 1024)


def test_a_decode_with_the_prefetch_on_is_the_decode_without_it_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    model = random_model(TINY, seed=5, mtp=False, device="cpu", dtype=torch.float32)
    model.fuse()
    lanes = torch.tensor([0, 1])
    positions = torch.tensor([[0], [0]])
    tokens = torch.tensor([[3], [7]])

    def run() -> torch.Tensor:
        cache = LaneCache(model.config, lanes=2, context=16, max_cols=1, device="cpu", dtype=torch.float32)
        step = model.decode_step(lanes, positions, span=16, record=False)
        assert isinstance(step, DecodeStep)
        return model.decode(tokens, step, cache)[0]

    plain = run()
    monkeypatch.setattr(prefetch, "BYTES", {w: 2**20 for w in prefetch.WINDOWS})
    assert torch.equal(run(), plain)
