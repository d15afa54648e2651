"""The sampled draft's shaping and draw in one Triton launch (ignis.kernels.draw_triton) compiled on a real GPU,
against Choice.draw's torch path on the CPU (its reference), and under CUDA-graph replay. Needs CUDA; CI has none."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from ignis.backends.base import Choice
from ignis.kernels.draw_triton import shaped_draw


def _case(n: int, k: int, width: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    scores = torch.round(torch.randn(n, k, width, generator=g) * 4) / 4  # ties among the candidates
    temperature = torch.where(torch.rand(n, generator=g) < 0.2, 0.0, 0.3 + 1.5 * torch.rand(n, generator=g))
    top_k = torch.where(torch.rand(n, generator=g) < 0.3, 0, torch.randint(1, 21, (n,), generator=g))
    top_p = torch.where(torch.rand(n, generator=g) < 0.3, 1.0, 0.5 + 0.5 * torch.rand(n, generator=g))
    min_p = torch.where(torch.rand(n, generator=g) < 0.5, 0.0, 0.2 * torch.rand(n, generator=g))
    u = torch.rand(n, k, generator=g, dtype=torch.float64)
    return scores, temperature, top_k, top_p, min_p, u


@pytest.mark.parametrize("width", [16, 32, 64, 7])
def test_the_shaped_draw_on_the_gpu_equals_the_torch_path(width: int) -> None:
    n, k = 256, 7
    scores, temperature, top_k, top_p, min_p, u = _case(n, k, width, seed=width)
    greedy = scores.argmax(dim=-1)
    want_q, want = Choice(temperature, u, top_k, top_p, min_p).draw(scores, greedy, None)  # CPU: the torch path
    on = [t.cuda() for t in (temperature, u, top_k, top_p, min_p)]
    got_q, got = Choice(*on).draw(scores.cuda(), greedy.cuda(), None)  # CUDA: one launch
    torch.testing.assert_close(got_q.cpu(), want_q, rtol=1e-5, atol=1e-7)
    assert torch.equal(got.cpu(), want)


def test_the_shaped_draw_replays_in_a_cuda_graph() -> None:
    scores, temperature, top_k, top_p, min_p, u = (t.cuda() for t in _case(64, 1, 16, seed=1))
    rows = [scores[:, 0], temperature, top_k, top_p, min_p, u[:, 0], scores[:, 0].argmax(dim=-1)]
    shaped_draw(*rows)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, chosen = shaped_draw(*rows)
    for seed in range(3):
        rows[5].copy_(torch.rand(64, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).cuda())
        graph.replay()
        want_q, want = shaped_draw(*rows)
        assert torch.equal(q, want_q) and torch.equal(chosen, want)
