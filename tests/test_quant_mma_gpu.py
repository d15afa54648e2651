"""The 4-bit product with the weight as the tensor cores' 16-row operand (ignis.kernels.int4_mma) on a real GPU at
the Qwen3.5-27B shapes: against its reference, a row's result independent of the batch and of the launch, the split
over blocks of threads under CUDA-graph replay, packed_linear's routing, and the quantized built-in model loading
repacked. Needs CUDA; CI has none."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from ignis.kernels.int4_mma import Shape, int4_mma, launch, pack, ringed, row_tiles, split
from test_quant_gpu import INT4_SHAPES, _int4_weight, _rel, _replayed_then_side


def _mma(x: torch.Tensor, qw: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    return int4_mma(x, pack(qw, s, z, x.dtype))


@pytest.mark.parametrize("shape", [s for s in INT4_SHAPES if s[0] % 16 == 0])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 33, 64])
def test_int4_mma_equals_its_reference_at_the_27b_shapes(shape: tuple[int, int], rows: int) -> None:
    nout, ncols = shape
    qw, s, z = _int4_weight(nout, ncols, 128, seed=nout + ncols)
    x = torch.randn(rows, ncols, device="cuda", generator=torch.Generator(device="cuda").manual_seed(rows)).bfloat16()
    assert _rel(_mma(x, qw, s, z), x, qw, s, z) < 1e-2


@pytest.mark.parametrize("rows", [5, 33])  # 33: the tiled kernel (int4_tile), its fp16 and bf16-scale variants
@pytest.mark.parametrize("group", [64, 128])
def test_int4_mma_fp16_activations_bf16_scales_and_group_64(group: int, rows: int) -> None:
    qw, s, z = _int4_weight(5120, 6144, group, seed=3)
    x = torch.randn(rows, 6144, device="cuda").half()
    for w, xr, scales in ((pack(qw, s, z, torch.float16), x, s), (pack(qw, s.half(), z, torch.bfloat16), x.bfloat16(),
                                                                  s.half())):
        out = int4_mma(xr, w)
        assert _rel(out, xr, qw, scales, z) < 1e-2
        assert torch.equal(out, torch.cat([int4_mma(xr[i : i + 1], w) for i in range(rows)]))  # a row alone


@pytest.mark.parametrize("named", [True, False])
def test_a_rows_result_depends_on_neither_the_batch_nor_the_launch(named: bool,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The split int4_mma takes (split: SPLITS's for the weight, or choose's, which splits mlp down over blocks of
    threads and warps) fixes the order of the sums; the rows, and F, U, RB, RG and AHEAD, must not change a bit."""
    from ignis.kernels import int4_mma as module

    if not named:
        monkeypatch.setattr(module, "SPLITS", {})
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for nout, ncols in ((5120, 17408), (14336, 5120), (5120, 6144)):  # down, warps, 8 warps
        qw, s, z = _int4_weight(nout, ncols, 128, seed=7)
        w = pack(qw, s, z, torch.bfloat16)
        base = split(nout, ncols, 128, sms)
        x = torch.randn(64, ncols, device="cuda").bfloat16()
        alone = torch.cat([int4_mma(x[i : i + 1], w) for i in range(64)])
        for rows in (2, 8, 9, 17, 33, 64):
            assert torch.equal(int4_mma(x[:rows], w), alone[:rows]), (nout, rows)
        for u, ahead, rb, f in ((2, 2, 2, 1), (base.unit, 1, 1, 2), (2, 1, 1, 4)):
            other = Shape(u, ahead, base.kw, rb, f, base.unit, base.ks)
            assert torch.equal(int4_mma(x[:8], w, other), alone[:8]), (nout, other)
        for u, ahead, f, xring in ((2, 2, 1, 0), (2, 3, 1, 0), (base.unit, 1, 1, 0), (2, 2, 2, 0), (2, 1, 1, 1),
                                   (2, 2, 1, 1), (base.unit, 1, 1, 1)):  # the ring loop, x in it or not: the same sums
            other = Shape(u, ahead, base.kw, 1, f, base.unit, base.ks, ring=True, xring=bool(xring))
            for rows in (1, 5, 8):
                assert torch.equal(int4_mma(x[:rows], w, other), alone[:rows]), (nout, rows, other)
        for rg in (2, 4, 8):  # the rows over blocks of threads; at 33 rows some blocks have none
            for rows in (17, 33, 64):
                other = replace(launch(base, row_tiles(rows)), rg=rg)
                assert torch.equal(int4_mma(x[:rows], w, other), alone[:rows]), (nout, rows, other)


@pytest.mark.parametrize("ring", [(2, 2, False), (2, 1, True)])
def test_a_shape_on_the_ring_gives_the_plain_loops_bits_eagerly_replayed_and_aside(
        monkeypatch: pytest.MonkeyPatch, ring: tuple[int, int, bool]) -> None:
    """int4_mma.RING_LAUNCHES puts a weight's 1-8-row launches on the ring loop (RING, x in it or not): the same bits
    as the plain loop's, eagerly, replayed from a CUDA graph and on a side stream (and at 16 rows, which keep the
    plain loop)."""
    from ignis.kernels import int4_mma as module

    qw, s, z = _int4_weight(5120, 6144, 128, seed=11)
    w = pack(qw, s, z, torch.bfloat16)
    x = torch.randn(16, 6144, device="cuda").bfloat16()
    monkeypatch.setattr(module, "RING_LAUNCHES", {})
    plain = {rows: int4_mma(x[:rows], w) for rows in (1, 8, 16)}
    monkeypatch.setattr(module, "RING_LAUNCHES", {(5120, 6144): ring})
    for rows in (1, 8, 16):
        assert torch.equal(int4_mma(x[:rows], w), plain[rows]), rows

    def check(out: torch.Tensor, xs: torch.Tensor) -> None:
        monkeypatch.setattr(module, "RING_LAUNCHES", {})
        expected = int4_mma(xs, w)
        monkeypatch.setattr(module, "RING_LAUNCHES", {(5120, 6144): ring})
        assert torch.equal(out, expected)

    xs, _, side = _replayed_then_side(lambda xs, *_: int4_mma(xs, w), 8, qw, s, z, check)
    check(side, xs)


def test_a_split_named_for_a_shape_gives_every_row_count_a_rows_own_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """int4_mma.SPLITS (here mlp down on KS 1 x KW 8, on the ring at 1-8 rows): one order of the sums for 1 to 64
    rows, through int4_mma's loops and the tiled kernel alike, within the reference's tolerance."""
    from ignis.kernels import int4_mma as module

    monkeypatch.setattr(module, "SPLITS", {(5120, 17408): (1, 8)})
    monkeypatch.setattr(module, "RING_LAUNCHES", {**module.RING_LAUNCHES, (5120, 17408): (2, 2, False)})
    qw, s, z = _int4_weight(5120, 17408, 128, seed=17)
    w = pack(qw, s, z, torch.bfloat16)
    x = torch.randn(64, 17408, device="cuda").bfloat16()
    alone = torch.cat([int4_mma(x[i : i + 1], w) for i in range(64)])
    for rows in (5, 8, 9, 17, 33, 64):
        assert torch.equal(int4_mma(x[:rows], w), alone[:rows]), rows
    assert _rel(alone, x, qw, s, z) < 1e-2


def test_int4_mma_under_cuda_graph_replay_and_on_a_side_stream() -> None:
    from ignis.kernels.launch import _counters

    for (nout, ncols), rows in (((5120, 17408), 8), ((34816, 5120), 1), ((5120, 17408), 64)):
        qw, s, z = _int4_weight(nout, ncols, 128, seed=11)
        w = pack(qw, s, z, torch.bfloat16)

        def run(x: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
            return int4_mma(x, w)

        def replayed(out: torch.Tensor, x: torch.Tensor) -> None:
            assert _rel(out, x, qw, s, z) < 1e-2
            assert torch.equal(out, int4_mma(x, w))  # eager and replayed alike

        _, static_out, out = _replayed_then_side(run, rows, qw, s, z, replayed)
        assert torch.equal(out, static_out)
    torch.cuda.synchronize()
    assert all(not bool(c.any()) for c in _counters.values())  # every split call left its counters at zero


@pytest.mark.parametrize("rows", [1, 8, 64])
def test_programmatic_dependent_launch_keeps_the_4bit_chain_bit_for_bit(rows: int,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """With launch.PDL on, the 4-bit product (its codes loaded before griddepcontrol.wait) and the residual norm launch
    ahead of the kernel before them: a graph of the 27B's 4-bit gate_up, swiglu, down (split over blocks through the
    counters) and add + norm gives the bits it gives with PDL off, replayed on new inputs."""
    from ignis.kernels import launch as launches
    from ignis.kernels.norm_triton import add_rms_norm
    from ignis.kernels.swiglu_triton import swiglu
    from tests.pdl import same_bits_with_pdl

    g = torch.Generator(device="cuda").manual_seed(rows)
    w_gu = pack(*_int4_weight(34816, 5120, 128, seed=1), torch.bfloat16)
    w_down = pack(*_int4_weight(5120, 17408, 128, seed=2), torch.bfloat16)
    scale = 1 + 0.1 * torch.randn(5120, device="cuda", generator=g)
    x = torch.randn(rows, 5120, device="cuda", generator=g).bfloat16()
    inputs = [torch.randn(rows, 5120, device="cuda", generator=g).bfloat16() for _ in range(3)]

    def chain() -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(x, int4_mma(swiglu(int4_mma(x, w_gu)), w_down), scale, 1e-6)

    same_bits_with_pdl(chain, x, inputs, monkeypatch)
    same_bits_with_pdl(chain, x, inputs, monkeypatch, early=True)  # the next kernel launched before the wait
    assert bool((launches.split_counters(x.device) == 0).all())  # every split met and reset its counter


@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_padded_rows_reading_row_0s_x_give_the_same_bits(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """int4_mma.X_PAD_ROW0 (the kernel's XPAD: the lanes of the rows past a call's load row 0's x instead of zeros)
    changes no bit of any row at the 27B's products, on the ring and the plain loop, split over blocks of threads or
    not, with the SwiGLU store, eagerly and replayed; x's row 0 holding inf and NaN leaves the other rows' bits too."""
    from ignis.kernels import int4_mma as module

    for nout, ncols in ((5120, 6144), (5120, 17408), (14336, 5120), (34816, 5120)):
        w = pack(*_int4_weight(nout, ncols, 128, seed=nout), torch.bfloat16)
        x = torch.randn(rows, ncols, device="cuda", generator=torch.Generator(device="cuda").manual_seed(rows))
        x = x.bfloat16()
        monkeypatch.setattr(module, "SPLITS", {})  # choose's split: mlp down over blocks of threads
        zero = int4_mma(x, w), int4_mma(x, w, swiglu=nout == 34816)
        monkeypatch.setattr(module, "X_PAD_ROW0", True)
        assert all(torch.equal(a, b) for a, b in zip(zero, (int4_mma(x, w), int4_mma(x, w, swiglu=nout == 34816))))
        monkeypatch.undo()
        zero = int4_mma(x, w)
        monkeypatch.setattr(module, "X_PAD_ROW0", True)
        assert torch.equal(int4_mma(x, w), zero)  # SPLITS's split, the ring where RING_LAUNCHES names the shape
        static = x.clone()
        int4_mma(static, w)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = int4_mma(static, w)
        graph.replay()
        assert torch.equal(replayed, zero)
        if rows > 1:  # a row's bits whatever row 0 holds
            bad = x.clone()
            bad[0, :7] = torch.tensor([float("inf"), float("nan")] * 3 + [float("-inf")], dtype=x.dtype)
            assert torch.equal(int4_mma(bad, w)[1:], zero[1:])
        monkeypatch.undo()


@pytest.mark.parametrize("rows", [1, 8, 33])
def test_a_windowed_launch_reads_its_blocks_codes_modulo_the_window(rows: int) -> None:
    """`window` (benchmarks) gives what the same launch gives on a weight whose every 16-feature block holds the
    codes and scales of its block modulo the window, at the rows the shipped launch takes and past the tiled kernel's
    first row count (a windowed call always runs int4_mma's own launch)."""
    nout, ncols, window = 5120, 6144, 16
    w = pack(*_int4_weight(nout, ncols, 128, seed=5), torch.bfloat16)
    blocks = torch.arange(nout // 16, device="cuda") % window
    wrapped = replace(w, codes=w.codes[blocks].contiguous(), zs=w.zs[blocks].contiguous())
    x = torch.randn(rows, ncols, device="cuda").bfloat16()
    nt = row_tiles(rows)
    base = split(nout, ncols, 128, torch.cuda.get_device_properties(0).multi_processor_count)
    s = ringed(launch(base, nt), nt, nout, ncols, 128)
    assert torch.equal(int4_mma(x, w, window=window), int4_mma(x, wrapped, s))
    assert not torch.equal(int4_mma(x, w, window=window), int4_mma(x, w, s))


def test_every_launch_the_engine_makes_fits_the_device() -> None:
    """The launches `launch` picks for 1 to 64 rows at the 27B shapes, and int4_tile's from 17 rows (its shared
    memory ring), compile and run (registers and shared memory)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for nout, ncols in [s for s in INT4_SHAPES if s[0] % 16 == 0]:
        qw, s, z = _int4_weight(nout, ncols, 128, seed=1)
        w = pack(qw, s, z, torch.bfloat16)
        for rows in (1, 16, 17, 32, 64):
            x = torch.randn(rows, ncols, device="cuda").bfloat16()
            assert row_tiles(rows) * 8 >= rows
            int4_mma(x, w, launch(split(nout, ncols, 128, sms), row_tiles(rows)))
            int4_mma(x, w)  # the launch a round makes: int4_tile's where tile_for gives one
    torch.cuda.synchronize()


def test_packed_linear_runs_the_mma_kernel_on_repacked_weights() -> None:
    from ignis.quant.linear import QuantLinear, fuse_packed, packed_linear

    parts = []
    for nout in (1024, 512):
        q = QuantLinear(2048, nout, 128).cuda()
        q.qweight, q.scales, q.qzeros = _int4_weight(nout, 2048, 128, seed=nout)
        parts.append(q)
    formats = [q.weight for q in parts]
    assert all(q.repack(torch.bfloat16) for q in parts)
    assert not hasattr(parts[0], "qweight")  # the format's codes are freed
    joined = fuse_packed(tuple(parts))
    x = torch.randn(4, 8, 2048, device="cuda").bfloat16()
    both = packed_linear(x, joined)
    assert both.shape == (4, 8, 1536)
    for q, f, cols in zip(parts, formats, (slice(0, 1024), slice(1024, 1536)), strict=True):
        assert q.codes.untyped_storage().data_ptr() == joined.codes.untyped_storage().data_ptr()  # views
        assert torch.equal(packed_linear(x, q.weight), both[..., cols])  # a block's rows alone: the same bits
        assert _rel(both[..., cols].reshape(32, -1), x.reshape(32, -1), f.qweight, f.scales, f.qzeros) < 1e-2
    big = torch.randn(3, 100, 2048, device="cuda").bfloat16()  # past 64 rows: the dequantized reference
    torch.testing.assert_close(packed_linear(big, joined), torch.nn.functional.linear(big, joined.dequantize()))


def test_an_act_order_weight_gathers_x_then_runs_the_mma_kernel_also_in_a_graph() -> None:
    """A repacked act-order linear (ignis.quant.linear.Permuted): its product is the mma kernel's on x's columns in the
    held order, bit for bit, eagerly and replayed from a CUDA graph, and x @ W^T for W in the checkpoint's order."""
    from ignis.quant.linear import Permuted, QuantLinear, fuse_packed, packed_linear

    parts, stored = [], []
    order = torch.randperm(5120, generator=torch.Generator().manual_seed(0)).to(torch.int32).cuda()
    for nout in (1024, 512):
        q = QuantLinear(5120, nout, 128).cuda()
        stored.append(_int4_weight(nout, 5120, 128, seed=nout))
        q.qweight, q.scales, q.qzeros = stored[-1]
        q.order = order
        parts.append(q)
    assert all(q.repack(torch.bfloat16) for q in parts)
    joined = fuse_packed(tuple(parts))
    assert isinstance(joined, Permuted)
    dense = joined.dequantize()
    for rows in (1, 8, 33):
        x = torch.randn(rows, 5120, device="cuda").bfloat16()
        out = packed_linear(x, joined)
        assert torch.equal(out, int4_mma(x.index_select(-1, order), joined.weight))
        ref = x.float() @ dense.float().t()
        assert float((out.float() - ref).norm() / ref.norm()) < 1e-2

    def check(out: torch.Tensor, x: torch.Tensor) -> None:
        assert torch.equal(out, int4_mma(x.index_select(-1, order), joined.weight))

    x, _, side = _replayed_then_side(lambda x, *_: packed_linear(x, joined), 8, *stored[0], check)
    check(side, x)


def test_the_quantized_builtin_loads_repacked_and_keeps_its_greedy_tokens(tmp_path: Path) -> None:
    """A converted built-in model on the GPU holds its projections in the mma kernel's order and its logits track the
    format's own kernel (Triton) within bf16's reach."""
    from ignis.artifact import BUILTIN
    from ignis.model.batch import Batch, Segment
    from ignis.model.cache import LaneCache
    from ignis.model.loader import load_model
    from ignis.quant.convert import convert
    from ignis.quant.linear import QuantLinear, set_kernel

    path = tmp_path / "int4"
    convert(BUILTIN, path, group=128)
    ids = torch.randint(3, 1000, (40,), generator=torch.Generator().manual_seed(0)).cuda()

    def decode_logits(kernel: str) -> tuple[torch.Tensor, int]:
        set_kernel(kernel)  # type: ignore[arg-type]
        try:
            model = load_model(path, device="cuda", dtype=torch.bfloat16, exact=False)
            repacked = sum(m.mma is not None for m in model.modules() if isinstance(m, QuantLinear))
            cache = LaneCache(model.config, lanes=1, context=128, max_cols=1, device="cuda", dtype=torch.bfloat16)
            out = []
            for i in range(ids.shape[0]):  # one row a forward: the kernel's path, not prefill's
                pos, row = torch.tensor([i], device="cuda"), torch.tensor([0], device="cuda")
                out.append(model(Batch(ids[i : i + 1], pos, (Segment(0, 0, i, 1, prefill=i == 0),), row),
                                 cache).logits.float())
            return torch.cat(out), repacked
        finally:
            set_kernel("auto")

    mma, repacked = decode_logits("auto")
    tri, none = decode_logits("triton")
    assert repacked > 0 and none == 0
    assert float((mma - tri).norm() / tri.norm()) < 2e-2
    assert float((mma.argmax(-1) == tri.argmax(-1)).float().mean()) > 0.9


@pytest.mark.parametrize("shape", [(34816, 5120), (2048, 384), (1024, 17408)])
def test_the_swiglu_store_gives_the_product_then_swiglu(shape: tuple[int, int],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """int4_mma(..., swiglu=True) over a gate | up weight against int4_mma then the SwiGLU kernel, the chain it
    replaces, at 1 to 64 rows (the last two shapes split 64 rows over blocks of threads, the third its input over
    blocks too): the same bits but where the two exponentials round differently (one 16-bit step, rarely). Through
    packed_swiglu, which past SWIGLU_ROWS leaves the product to the two launches."""
    from ignis.kernels import fused
    from ignis.quant import linear as quant_linear

    nout, ncols = shape
    qw, s, z = _int4_weight(nout, ncols, 128, seed=5)
    w = pack(qw, s, z, torch.bfloat16)
    monkeypatch.setattr(quant_linear, "SWIGLU_ROWS", 64)
    for rows in (1, 8, 17, 33, 64):
        x = torch.randn(rows, ncols, device="cuda", generator=torch.Generator(device="cuda").manual_seed(rows))
        x = x.bfloat16()
        chain = fused.swiglu(int4_mma(x, w))
        got = quant_linear.packed_swiglu(x, w)
        assert got is not None and got.shape == chain.shape == (rows, nout // 2)
        assert torch.equal(got, int4_mma(x, w, swiglu=True))
        differ = got != chain
        assert float(differ.float().mean()) <= 1e-3, (shape, rows)
        assert torch.allclose(got.float(), chain.float(), rtol=2**-7, atol=1e-6), (shape, rows)
    monkeypatch.setattr(quant_linear, "SWIGLU_ROWS", 8)
    assert quant_linear.packed_swiglu(x, w) is None


@pytest.mark.parametrize("tile", [None, (8, 2, 4, 1, 1), (4, 1, 4, 1, 1), (4, 2, 6, 1, 1), (4, 2, 3, 1, 1),
                                  (4, 2, 4, 2, 2), (4, 1, 4, 2, 2), (4, 2, 4, 1, 4)])
def test_the_tiled_kernel_gives_the_rows_int4_mma_gives_alone(tile: tuple[int, int, int, int, int] | None,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """From int4_tile.TILE_ROWS rows a call may run int4_tile (tile_for's choice, or every launch shape forced), whose
    sums must be int4_mma's bit for bit (a row's logits may not depend on how many lanes share a round): at the 27B's
    five products, split over blocks of threads and warps or not at all, 17-64 rows, the SwiGLU store, and its split
    counters left at zero."""
    from ignis.kernels import int4_tile
    from ignis.kernels.launch import _counters

    if tile is not None:
        monkeypatch.setattr(int4_tile, "TILE", int4_tile.Tile(*tile))
    start = int4_tile.TILE_ROWS
    assert start is not None
    for nout, ncols in ((34816, 5120), (5120, 17408), (16384, 5120), (14336, 5120), (5120, 6144), (2048, 384)):
        qw, s, z = _int4_weight(nout, ncols, 128, seed=13)
        w = pack(qw, s, z, torch.bfloat16)
        x = torch.randn(64, ncols, device="cuda", generator=torch.Generator(device="cuda").manual_seed(nout)).bfloat16()
        alone = torch.cat([int4_mma(x[i : i + 1], w) for i in range(64)])
        for rows in sorted({start, 24, 32, 33, 40, 64}):
            assert torch.equal(int4_mma(x[:rows], w), alone[:rows]), (nout, ncols, rows, tile)
        if (nout > ncols or nout == 2048) and (tile is None or tile[1] % 2 == 0):  # a gate | up weight: SwiGLU
            glued = torch.cat([int4_mma(x[i : i + 1], w, swiglu=True) for i in range(64)])
            assert torch.equal(int4_mma(x, w, swiglu=True), glued), (nout, ncols, tile)
        assert _rel(int4_mma(x, w), x, qw, s, z) < 1e-2
    torch.cuda.synchronize()
    assert all(not bool(c.any()) for c in _counters.values())
