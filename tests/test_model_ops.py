"""The exact-mode primitives: a row's (an element's) bits never depend on how many rows share the call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ignis.model import ops


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("k", "n"), [(64, 128), (64, 512), (128, 64), (32, 4)])
def test_exact_linear_rows_do_not_depend_on_row_count(k: int, n: int, threads: int) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(k + n)
        weight = torch.randn(n, k, generator=gen) * 0.02
        x = torch.randn(64, k, generator=gen)
        alone = torch.cat([ops.linear(x[i : i + 1], weight, exact=True) for i in range(64)])
        for m in [*range(1, 41), 64]:
            assert torch.equal(ops.linear(x[:m], weight, exact=True), alone[:m]), f"{m} rows"
        # Leading dims are rows too.
        assert torch.equal(ops.linear(x[:12].view(3, 4, k), weight, exact=True), alone[:12].view(3, 4, n))
        torch.testing.assert_close(alone, F.linear(x, weight))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("exact_fn", "torch_fn"),
    [(ops.sigmoid, torch.sigmoid), (ops.silu, F.silu), (ops.softplus, F.softplus)],
)
def test_exact_activations_do_not_depend_on_position(exact_fn, torch_fn) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 8
    x[:4] = torch.tensor([30.0, -30.0, 20.5, -100.0])  # softplus's linear branch and saturated sigmoids
    whole = exact_fn(x, True)
    for n in range(1, 200):
        assert torch.equal(exact_fn(x[:n].clone(), True), whole[:n]), f"{n} elements"
    assert torch.equal(exact_fn(x[1::3], True), whole[1::3])
    torch.testing.assert_close(whole, torch_fn(x), rtol=1e-6, atol=1e-6)
    assert torch.isfinite(whole).all()


def test_rope_rotates_only_the_rotary_dims() -> None:
    rope = ops.Rope(rotary_dim=8, theta=10000.0)
    cos, sin = rope.tables(torch.tensor([0, 5]), torch.float32)
    x = torch.randn(2, 3, 32)
    y = ops.apply_rope(x, cos, sin)
    assert torch.equal(y[0], x[0])  # position 0: identity
    assert torch.equal(y[1, :, 8:], x[1, :, 8:])
    # A rotation keeps each (i, i + 4) pair's norm.
    pairs = lambda t: t[..., :4] ** 2 + t[..., 4:8] ** 2  # noqa: E731
    torch.testing.assert_close(pairs(y[1]), pairs(x[1]))


def test_precomputed_rope_tables_are_the_computed_ones_in_one_gather() -> None:
    rope = ops.Rope(rotary_dim=8, theta=10000.0)
    positions = torch.tensor([0, 5, 63, 5, 17])
    want = rope.tables(positions, torch.bfloat16)
    rope.precompute(64, torch.device("cpu"), torch.bfloat16)
    got = rope.tables(positions, torch.bfloat16)
    assert all(torch.equal(g, w) and g.is_contiguous() for g, w in zip(got, want, strict=True))
    cos, sin = rope.precomputed(torch.bfloat16, torch.device("cpu"))  # type: ignore[misc]
    assert cos.shape == sin.shape == (64, 8) and cos.is_contiguous() and torch.equal(sin[5], want[1][1])
    assert rope.precomputed(torch.float32, torch.device("cpu")) is None  # another dtype: computed, not looked up
    assert torch.equal(rope.tables(positions, torch.float32)[0], ops.Rope(8, 10000.0).tables(positions,
                                                                                             torch.float32)[0])


def test_products_for_leaves_the_cpu_and_few_rows_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    # The CPU build of torch has no cuBLASLt to prefer: any attempt to set it would raise here.
    calls: list[object] = []
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", lambda *a: calls.append(a))
    with ops.products_for(64, torch.device("cpu")):
        pass
    with ops.products_for(ops.LT_MIN_ROWS - 1, torch.device("cuda")):
        pass
    assert calls == []
    with ops.products_for(ops.LT_MIN_ROWS, torch.device("cuda")):
        pass
    assert calls == [(), ("cublaslt",), (None,)]  # read, set, put back what was read


def test_the_streamed_products_are_the_measured_shapes() -> None:
    # Qwen3.5-27B: mlp down (5,120 x 17,408) and the output head (248,320 x 5,120) at decode and 1 x 8 verify rows
    for rows in (1, 8, ops.STREAM_ROWS):
        assert ops.stream_shape(rows, 5120, 17408) and ops.stream_shape(rows, 248320, 5120)
        for nout, ncols in ((34816, 5120), (5120, 6144), (16480, 5120), (14336, 5120)):  # gate_up, o_proj, in_proj, qkv
            assert not ops.stream_shape(rows, nout, ncols), (nout, ncols)
    assert not ops.stream_shape(ops.STREAM_ROWS + 1, 5120, 17408)  # a verify of 8 lanes keeps cuBLAS(Lt)
    assert not ops.stream_shape(1, 100, 17400)  # input not whole steps of 128 columns
    x = torch.randn(2, 17408, dtype=torch.bfloat16)
    assert not ops.streamed(x, torch.randn(5120, 17408, dtype=torch.bfloat16))  # the CPU never streams
