"""The GPU tests' check of programmatic dependent launch (ignis.kernels.launch.PDL): `same_bits_with_pdl`."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch


def same_bits_with_pdl(chain: Callable[[], tuple[torch.Tensor, ...]], x: torch.Tensor, inputs: list[torch.Tensor],
                       monkeypatch: pytest.MonkeyPatch, early: bool = False) -> None:
    """chain() reads x: its outputs for each of `inputs` with PDL off are the expected bits; with PDL on, the first
    input eagerly, then a CUDA graph of chain() (warmed up on a side stream, as torch's capture asks) replayed on every
    input, must give them bit for bit (a read before griddepcontrol.wait would see the last replay's values). `early`:
    with PDL on, the products let the next kernel launch before their own wait (launch.EARLY_TRIGGER)."""
    from ignis.kernels import launch

    monkeypatch.setattr(launch, "EARLY_TRIGGER", early)
    want = []
    for new in inputs:
        x.copy_(new)
        want.append(tuple(t.clone() for t in chain()))
    monkeypatch.setattr(launch, "PDL", True)
    x.copy_(inputs[0])
    assert all(torch.equal(a, b) for a, b in zip(chain(), want[0], strict=True))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = chain()
    for new, expect in zip(inputs, want, strict=True):
        x.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(got, expect, strict=True))
