"""The top-k kernel on a real GPU: bit-identical to the reference and equal in value to torch.topk over the
vocabulary grid, on hard data, on views, on a side stream and under CUDA-graph replay; the Gated DeltaNet, fused-layer
and paged-attention kernels against their references at the 27B shapes, and under graph replay. The quantized
products are in tests/test_quant_gpu.py. Needs CUDA; CI has none."""

from __future__ import annotations

import pytest
import torch

from ignis.kernels.topk import topk, topk_reference

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _check(x: torch.Tensor, k: int) -> None:
    vals, ids = topk(x, k)
    ref_vals, ref_ids = topk_reference(x, k)
    assert torch.equal(ids, ref_ids)
    assert torch.equal(_bits(vals), _bits(ref_vals))  # the input's own bits
    tk = torch.topk(x, k)
    torch.testing.assert_close(vals, tk.values, rtol=0, atol=0, equal_nan=True)  # -0.0 == +0.0 here


def _counters_zero() -> bool:
    from ignis.kernels.topk_launch import _devices

    return all(bool((d.counters == 0).all()) for d in _devices.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [8, 16, 64])
@pytest.mark.parametrize("ncols", [151936, 262144])
@pytest.mark.parametrize("rows", [1, 8, 64, 256])
def test_vocabulary_grid(rows: int, ncols: int, k: int, dtype: torch.dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(rows + ncols + k)
    _check(torch.randn(rows, ncols, device="cuda", generator=g).to(dtype), k)


@pytest.mark.parametrize("k", [1, 15, 32, 33, 64])
@pytest.mark.parametrize("rows", [1, 7, 256])
@pytest.mark.parametrize("ncols", [4099, 100003, 248046])
def test_heavy_ties(rows: int, ncols: int, k: int) -> None:
    # Integers in [0, 4): the k-th value is shared by tens of thousands of columns, across every block boundary.
    g = torch.Generator(device="cuda").manual_seed(rows * k + ncols)
    x = torch.randint(0, 4, (rows, ncols), device="cuda", generator=g).float()
    _check(x, k)
    _check(x.bfloat16(), k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_special_values_and_masked_rows(dtype: torch.dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(6, 248320, device="cuda", generator=g)
    x[0] = 0.7  # all equal
    x[1] = -torch.inf
    x[1, [17, 200000, 5]] = torch.tensor([1.0, 2.0, 1.0], device="cuda")  # fewer finite values than k
    x[2, ::3] = -0.0
    x[2, 1::3] = 0.0
    x[3, [9, 99999]] = torch.nan
    x[3, [10, 11]] = torch.inf
    x[4] *= 1e-39  # subnormals (bf16 has fp32's exponent range)
    x[5] = torch.arange(248320, device="cuda", dtype=torch.float32)  # ascending: every element beats the list
    for k in (1, 16, 33, 64):
        _check(x.to(dtype), k)


def test_views_odd_rows_and_leading_dims() -> None:
    g = torch.Generator(device="cuda").manual_seed(6)
    wide = torch.randn(8, 151937, device="cuda", generator=g)
    _check(wide[:, :151936], 16)  # row stride > row length
    _check(wide.bfloat16()[:, 1:], 16)  # bf16 rows that start on an odd element
    _check(wide.bfloat16()[:, :-2], 16)  # odd bf16 row length
    _check(wide.t().contiguous().t(), 8)  # column-major: copied to rows
    x = torch.randn(2, 3, 50000, device="cuda", generator=g)
    vals, ids = topk(x, 12)
    ref_vals, ref_ids = topk_reference(x, 12)
    assert ids.shape == (2, 3, 12) and torch.equal(ids, ref_ids) and torch.equal(vals, ref_vals)


def test_repeated_calls_are_identical_and_reset_the_counters() -> None:
    x = torch.randint(0, 3, (7, 248320), device="cuda").bfloat16()
    first = topk(x, 16)
    for _ in range(5):
        again = topk(x, 16)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    torch.cuda.synchronize()
    assert _counters_zero()


def test_side_stream() -> None:
    x = torch.randn(56, 248320, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        vals, ids = topk(x, 8)
    s.synchronize()
    ref_vals, ref_ids = topk_reference(x, 8)
    assert torch.equal(ids, ref_ids) and torch.equal(vals, ref_vals)


@pytest.mark.parametrize(("rows", "k", "dtype"), [(1, 8, torch.float32), (56, 16, torch.bfloat16), (8, 40, torch.float32)])
def test_cuda_graph_replay(rows: int, k: int, dtype: torch.dtype) -> None:
    static_x = torch.randn(rows, 248320, device="cuda").to(dtype)
    topk(static_x, k)  # compile and load outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_vals, static_ids = topk(static_x, k)
    for seed in range(4):
        new = torch.randint(-50, 50, static_x.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        static_x.copy_(new.to(dtype))
        graph.replay()
        ref_vals, ref_ids = topk_reference(static_x, k)
        assert torch.equal(static_ids, ref_ids) and torch.equal(_bits(static_vals), _bits(ref_vals))
    torch.cuda.synchronize()
    assert _counters_zero()


def _counted(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[int]:
    """Wrap module.name so that each call appends to the returned list (which kernel a switch chose)."""
    calls: list[int] = []
    fn = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or fn(*a, **k))
    return calls


def _chunk_takes(dk: int, dv: int) -> bool:
    """Whether ignis.kernels.gdn_chunk's block shapes take heads of dk x dv (else gdn_chunk.fits sends them on)."""
    from ignis.kernels import gdn_chunk

    return all(gdn_chunk._takes(dk, dv, shape) for shape in (gdn_chunk.SHAPE, gdn_chunk.FEW))


def _gdn_inputs(shape: tuple[int, ...], seed: int) -> dict[str, torch.Tensor]:
    """A recurrence's inputs on the GPU for (lanes B, columns C, key heads, value heads, dk, dv): states of B + 2 lanes,
    B of them taken out of order."""
    b, c, hk, hv, dk, dv = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {"state": torch.randn(b + 2, hv, dk, dv, device="cuda", generator=g) * 0.1,
            "ids": torch.randperm(b + 2, device="cuda", generator=g)[:b],
            "mixed": torch.randn(b, c, 2 * hk * dk + hv * dv, device="cuda", generator=g),
            "ba": torch.randn(b, c, 2 * hv, device="cuda", generator=g) * 2,
            "dt_bias": torch.randn(hv, device="cuda", generator=g),
            "rate": -torch.rand(hv, device="cuda", generator=g) * 2}


# cudaN: bounded for N blocks an SM; chunk: a verify in chunk form (gdn_chunk) as shipped; chunk1, chunk2, chunk2x8: in
# one of tools.variants's shapes at every lane count
@pytest.mark.parametrize("kernel", ["numba", "cuda", "cuda5", "cuda6", "chunk", "chunk1", "chunk2", "chunk2x8"])
@pytest.mark.parametrize("shape", [(1, 1, 16, 48, 128, 128), (8, 8, 16, 48, 128, 128), (3, 4, 2, 4, 16, 16),
                                   (2, 5, 2, 6, 64, 32)])
def test_gdn_kernels_equal_their_references(shape: tuple[int, ...], kernel: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from ignis.kernels import gdn, gdn_chunk, gdn_cuda
    from ignis.kernels.gdn import columns, columns_reference, record_width, replay, replay_reference

    monkeypatch.setattr(gdn, "CUDA_COLUMNS", kernel != "numba")
    chunk = kernel.startswith("chunk")
    monkeypatch.setattr(gdn, "CHUNK_VERIFY", chunk)
    if kernel in ("chunk1", "chunk2", "chunk2x8"):
        from tools.variants import CHUNK_SHAPES

        monkeypatch.setattr(gdn_chunk, "SHAPE", CHUNK_SHAPES[kernel])
        monkeypatch.setattr(gdn_chunk, "FEW", CHUNK_SHAPES[kernel])
    blocks = int(kernel[4:] or 4) if kernel.startswith("cuda") else 6 if chunk else 4
    monkeypatch.setattr(gdn_cuda, "BLOCKS", blocks)
    monkeypatch.setattr(gdn_cuda, "KEEP_K", blocks <= 4)
    launched = _counted(monkeypatch, gdn_cuda, "columns")
    chunked = _counted(monkeypatch, gdn_chunk, "columns")
    b, c, hk, hv, dk, dv = shape
    lanes = b + 2
    x = _gdn_inputs(shape, sum(shape))
    state, ids, mixed, ba, dt_bias, rate = (x[n] for n in ("state", "ids", "mixed", "ba", "dt_bias", "rate"))
    g = torch.Generator(device="cuda").manual_seed(sum(shape) + 100)  # the kept columns
    for write_state, record in ((True, False), (False, True)):
        st, ref_st = state.clone(), state.clone()
        rec = torch.full((lanes, c, hv, record_width(dk, dv)), float("nan"), device="cuda")
        ref_rec = torch.zeros_like(rec)
        out = columns(st, ids, mixed, ba, dt_bias, rate, rec if record else None, key_heads=hk,
                      write_state=write_state)
        ref = columns_reference(ref_st, ids, mixed, ba, dt_bias, rate, ref_rec if record else None, key_heads=hk,
                                write_state=write_state)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(st, ref_st, rtol=1e-4, atol=1e-4)
        if record:
            # k, g and beta are copies; a column's delta comes of sums in another order than the reference's
            torch.testing.assert_close(rec[ids], ref_rec[ids], rtol=1e-4, atol=1e-4)
            last = torch.randint(0, c, (b,), device="cuda", generator=g)
            replay(st, ids, rec, last)
            replay_reference(ref_st, ids, ref_rec, last)
            torch.testing.assert_close(st, ref_st, rtol=1e-4, atol=1e-4)
    # the switches chose the kernels under test: a verify of one column is a decode's kernel's
    verify_chunked = chunk and c > 1 and _chunk_takes(dk, dv)
    assert len(launched) == (0 if kernel == "numba" else 1 if verify_chunked else 2)
    assert len(chunked) == int(verify_chunked)


@pytest.mark.parametrize("chunk", [False, True], ids=["verify whole head", "verify in chunk form"])
@pytest.mark.parametrize("shape", [(1, 1, 16, 48, 128, 128), (8, 8, 16, 48, 128, 128), (3, 4, 2, 4, 16, 16)])
def test_the_cuda_recurrence_with_the_gated_norm_equals_its_references(shape: tuple[int, ...], chunk: bool,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from ignis.kernels import fused, gdn, gdn_cuda
    from ignis.kernels.gdn import columns_normed, columns_reference, record_width
    from tests.test_kernels_fused import close

    monkeypatch.setattr(gdn, "CUDA_COLUMNS", True)
    monkeypatch.setattr(gdn, "CUDA_NORMED", True)  # the whole head's kernel, which the rounds take with PDL
    monkeypatch.setattr(gdn, "CHUNK_VERIFY", chunk)  # where on, a verify of 2 columns or more runs apart from it
    launched = _counted(monkeypatch, gdn_cuda, "columns_normed")
    b, c, hk, hv, dk, dv = shape
    lanes = b + 2
    x = _gdn_inputs(shape, sum(shape) + 1)
    state, ids, mixed, ba, dt_bias, rate = (x[n] for n in ("state", "ids", "mixed", "ba", "dt_bias", "rate"))
    g = torch.Generator(device="cuda").manual_seed(sum(shape) + 101)  # the gate and the norm's weight
    # the gate as the layer has it: a column slice of a wider projection (rows strided), and the norm's weight
    z = (torch.randn(b * c, hv * dv + 32, device="cuda", generator=g) * 2).to(torch.bfloat16)[:, 16 : 16 + hv * dv]
    weight = (torch.rand(dv, device="cuda", generator=g) + 0.5).to(torch.bfloat16)
    for write_state, record in ((True, False), (False, True)):
        st, ref_st = state.clone(), state.clone()
        rec = torch.full((lanes, c, hv, record_width(dk, dv)), float("nan"), device="cuda")
        ref_rec = torch.zeros_like(rec)
        y = columns_normed(st, ids, mixed, ba, dt_bias, rate, rec if record else None, z, weight, 1e-6,
                           key_heads=hk, write_state=write_state)
        out = columns_reference(ref_st, ids, mixed, ba, dt_bias, rate, ref_rec if record else None, key_heads=hk,
                                write_state=write_state)
        close(y, fused.gated_norm_reference(out.view(b * c, hv, dv), z, weight, 1e-6), "gated norm")
        torch.testing.assert_close(st, ref_st, rtol=1e-4, atol=1e-4)
        if record:
            torch.testing.assert_close(rec[ids], ref_rec[ids], rtol=1e-4, atol=1e-4)
    assert len(launched) == (1 if chunk and c > 1 and _chunk_takes(dk, dv) else 2)


@pytest.mark.parametrize("shape", [(3, 8, 8, 48, 128, 128), (2, 3, 4, 4, 16, 16), (1, 2, 5, 6, 64, 32)])
def test_the_cuda_replay_equals_its_reference_and_leaves_other_lanes_alone(shape: tuple[int, ...]) -> None:
    """replay_cuda commits G layers' kept columns (shape: G, lanes B, columns C, Hv, dk, dv) as replay_reference does
    layer by layer, lanes out of order, one lane keeping nothing (last -1); in a CUDA graph too."""
    from ignis.kernels import replay_cuda
    from ignis.kernels.gdn import record_width, replay_reference

    layers, b, c, hv, dk, dv = shape
    g = torch.Generator(device="cuda").manual_seed(sum(shape))
    state = torch.randn(layers, b + 2, hv, dk, dv, device="cuda", generator=g) * 0.1
    record = torch.randn(layers, b + 2, c, hv, record_width(dk, dv), device="cuda", generator=g) * 0.1
    record[..., dk + dv] = -torch.rand(record.shape[:-1], device="cuda", generator=g) * 2  # g: decays
    ids = torch.randperm(b + 2, device="cuda", generator=g)[:b]
    last = torch.randint(0, c, (b,), device="cuda", generator=g)
    last[0] = -1
    ref = state.clone()
    for st, rec in zip(ref, record):
        replay_reference(st, ids, rec, last)
    got = state.clone()
    replay_cuda.replay(got, ids, record, last)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    untouched = torch.ones(b + 2, dtype=torch.bool, device="cuda")
    untouched[ids[1:]] = False
    assert torch.equal(got[:, untouched], state[:, untouched])
    # captured: the graph reads the lanes and kept columns it is replayed with
    graph_state = state.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replay_cuda.replay(graph_state, ids, record, last)
    graph_state.copy_(state)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_state, got)


def test_the_cuda_recurrence_replays_in_a_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    from ignis.kernels import gdn
    from ignis.kernels.gdn import columns, columns_reference

    monkeypatch.setattr(gdn, "CUDA_COLUMNS", True)
    g = torch.Generator(device="cuda").manual_seed(5)
    b, c, hk, hv, dk, dv = 8, 8, 16, 48, 128, 128
    state = torch.randn(b + 1, hv, dk, dv, device="cuda", generator=g) * 0.1
    ids = torch.arange(1, b + 1, device="cuda")
    mixed = torch.randn(b, c, 2 * hk * dk + hv * dv, device="cuda", generator=g)
    ba = torch.randn(b, c, 2 * hv, device="cuda", generator=g)
    dt_bias, rate = torch.randn(hv, device="cuda", generator=g), -torch.rand(hv, device="cuda", generator=g)
    columns(state, ids, mixed, ba, dt_bias, rate, None, key_heads=hk, write_state=False)  # compile and load first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = columns(state, ids, mixed, ba, dt_bias, rate, None, key_heads=hk, write_state=False)
    mixed.copy_(torch.randn(mixed.shape, device="cuda", generator=g))
    graph.replay()
    torch.cuda.synchronize()
    ref = columns_reference(state.clone(), ids, mixed, ba, dt_bias, rate, None, key_heads=hk, write_state=False)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def _step_inputs(shape: tuple[int, ...], seed: int) -> dict[str, torch.Tensor]:
    """`_gdn_inputs` with the conv's: a bf16 window of every lane, this round's raw inputs and gates as views of a wider
    projection (rows strided, as the layer's split leaves them), float32 taps, a bf16 record of the inputs, and the
    gate and norm weight of the output norm."""
    b, c, hk, hv, dk, dv = shape
    x = _gdn_inputs(shape, seed)
    g = torch.Generator(device="cuda").manual_seed(seed + 7)
    dim, bf = 2 * hk * dk + hv * dv, torch.bfloat16
    wide = (torch.randn(b * c, dim + 2 * hv + 40, device="cuda", generator=g) * 2).to(bf)
    x.update(window=torch.randn(b + 2, 3, dim, device="cuda", generator=g).to(bf),
             raw=wide[:, 16 : 16 + dim].reshape(b, c, dim), ba=wide[:, 16 + dim : 16 + dim + 2 * hv].reshape(b, c, 2 * hv),
             taps=torch.randn(dim, 4, device="cuda", generator=g) * 0.5,
             inputs=torch.full((b + 2, c, dim), float("nan"), device="cuda").to(bf),
             z=(torch.randn(b * c, hv * dv + 32, device="cuda", generator=g) * 2).to(bf)[:, 16 : 16 + hv * dv],
             gweight=(torch.rand(dv, device="cuda", generator=g) + 0.5).to(bf))
    return x


def _step_both(x: dict[str, torch.Tensor], hk: int, record: bool, normed: bool,
               joined: bool) -> dict[str, torch.Tensor]:
    """One decode (record False: the window moves, the state is written) or verify (the inputs and columns recorded)
    through ignis.kernels.gdn_cuda.step (joined; step_normed where normed) or through the CUDA C++ conv's launch and
    ignis.kernels.gdn.columns_normed's; what it wrote."""
    from ignis.kernels import fused, gdn, gdn_cuda

    window, state, inputs = x["window"].clone(), x["state"].clone(), x["inputs"].clone()
    c = x["raw"].shape[1]
    hv, dk, dv = state.shape[1:]
    rec = torch.full((state.shape[0], c, hv, gdn.record_width(dk, dv)), float("nan"), device="cuda")
    args = (x["dt_bias"], x["rate"], rec if record else None)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gdn, "CUDA_COLUMNS", True)
        mp.setattr(gdn, "CUDA_NORMED", normed)
        mp.setattr(gdn, "CHUNK_VERIFY", False)  # apart, a verify's columns one by one, as the joined launch runs them
        mp.setattr(fused, "CUDA_CONV", True)  # the CUDA C++ conv, whose arithmetic the joined one repeats
        if joined:
            conv = gdn_cuda.Conv(window, x["raw"], x["taps"], x["ba"], inputs if record else None)
            if normed:
                y = gdn_cuda.step_normed(state, x["ids"], conv, *args, x["z"], x["gweight"], 1e-6, key_heads=hk,
                                         write_state=not record)
            else:
                out = gdn_cuda.step(state, x["ids"], conv, *args, key_heads=hk, write_state=not record)
                y = fused.gated_norm(out.view(-1, hv, dv), x["z"], x["gweight"], 1e-6)
        else:
            mixed, ba = fused.conv(window, x["ids"], x["raw"], x["taps"], x["ba"], inputs if record else None,
                                   key_heads=hk, dk=dk)
            y = gdn.columns_normed(state, x["ids"], mixed, ba, *args, x["z"], x["gweight"], 1e-6, key_heads=hk,
                                   write_state=not record, normalised=True)
    out = {"y": y, "window": window, "state": state}
    if record:
        out.update(inputs=inputs[x["ids"]], rec=rec[x["ids"]])
    return out


@pytest.mark.parametrize("normed", [False, True], ids=["recurrence alone", "whole head, normed"])
@pytest.mark.parametrize("shape", [(1, 1, 16, 48, 128, 128), (8, 1, 16, 48, 128, 128), (1, 8, 16, 48, 128, 128),
                                   (8, 8, 16, 48, 128, 128), (3, 4, 2, 4, 16, 16)])
def test_the_conv_joined_to_the_recurrence_gives_the_bits_of_the_two_launches(shape: tuple[int, ...],
                                                                              normed: bool) -> None:
    """gdn_cuda.step computes the conv as the CUDA C++ conv kernel does and then the recurrence: every output, state,
    record, recorded input and moved window is the two launches' own bits, for a decode and a verify of 1 to 8
    columns; and the torch references agree."""
    from ignis.kernels import fused, gdn, gdn_cuda
    from tests.test_kernels_fused import close

    b, c, hk, hv, dk, dv = shape
    x = _step_inputs(shape, sum(shape) + 3)
    for record in (False, True):
        joined = _step_both(x, hk, record, normed, True)
        apart = _step_both(x, hk, record, normed, False)
        for name in apart:
            assert torch.equal(joined[name].view(torch.int32 if joined[name].dtype == torch.float32 else torch.int16),
                               apart[name].view(torch.int32 if apart[name].dtype == torch.float32 else torch.int16)
                               ), (name, record)
        window, state = x["window"].clone(), x["state"].clone()
        inputs = x["inputs"].clone()
        mixed, ba = fused.conv_reference(window, x["ids"], x["raw"], x["taps"], x["ba"], inputs if record else None,
                                         hk, dk)
        out = gdn.columns_reference(state, x["ids"], mixed, ba, x["dt_bias"], x["rate"], None, key_heads=hk,
                                    write_state=not record, normalised=True)
        # the reference's conv sums its taps in another order: its bf16 results may round the other way more often
        close(joined["y"], fused.gated_norm_reference(out.view(b * c, hv, dv), x["z"], x["gweight"], 1e-6), "y",
              bits=0.9)
        torch.testing.assert_close(joined["state"], state, rtol=1e-4, atol=1e-4)
        assert torch.equal(joined["window"], window)
        if record:
            assert torch.equal(joined["inputs"], inputs[x["ids"]])
    assert int(gdn_cuda._counters(torch.device("cuda"), 1).abs().sum()) == 0  # every decode set its counters back


@pytest.mark.parametrize("shape", [(1, 8, 16, 48, 128, 128), (2, 5, 2, 6, 64, 64), (1, 2, 4, 8, 32, 64),
                                   (3, 8, 2, 4, 64, 64)])
def test_the_conv_joined_to_the_chunk_form_gives_the_bits_of_the_two_launches(shape: tuple[int, ...],
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """gdn_chunk.step convolves a verify's columns as the CUDA C++ conv kernel does and then runs the chunk form: its
    outputs, records and recorded inputs are the two launches' bits (conv_cuda, then gdn_chunk.columns)."""
    from ignis.kernels import fused, gdn, gdn_chunk, gdn_cuda

    monkeypatch.setattr(fused, "CUDA_CONV", True)  # the conv whose arithmetic the joined one repeats
    b, c, hk, hv, dk, dv = shape
    x = _step_inputs(shape, sum(shape) + 5)
    state, ids = x["state"], x["ids"]
    before = state.clone()
    width = gdn.record_width(dk, dv)
    rec, ref_rec = (torch.full((b + 2, c, hv, width), float("nan"), device="cuda") for _ in range(2))
    inputs, ref_inputs = x["inputs"].clone(), x["inputs"].clone()
    conv = gdn_cuda.Conv(x["window"], x["raw"], x["taps"], x["ba"], inputs)
    assert gdn_chunk.fits_step(state, conv, rec)
    out = gdn_chunk.step(state, ids, conv, x["dt_bias"], x["rate"], rec, key_heads=hk)
    mixed, ba32 = fused.conv(x["window"], ids, x["raw"], x["taps"], x["ba"], ref_inputs, key_heads=hk, dk=dk)
    ref = torch.empty_like(out)
    gdn_chunk.columns(state, ids, mixed, ba32, x["dt_bias"], x["rate"], ref, ref_rec, key_heads=hk)
    assert torch.equal(out.view(torch.int32), ref.view(torch.int32))
    assert torch.equal(rec[ids].view(torch.int32), ref_rec[ids].view(torch.int32))
    assert torch.equal(inputs[ids].view(torch.int16), ref_inputs[ids].view(torch.int16))
    assert torch.equal(state, before)  # a verify leaves the state alone


@pytest.mark.parametrize("c", [1, 8])
def test_the_joined_step_takes_decodes_alone(c: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """gdn.STEP routes a decode's one column through gdn_cuda.step; a verify's columns keep the conv's own launch."""
    from ignis.kernels import gdn, gdn_cuda

    monkeypatch.setattr(gdn, "STEP", True)
    monkeypatch.setattr(gdn, "CUDA_NORMED", False)
    steps = _counted(monkeypatch, gdn_cuda, "step")
    shape = (2, c, 16, 48, 128, 128)
    x = _step_inputs(shape, 21)
    gdn.conv_columns_normed(x["window"], x["raw"], x["taps"], x["ba"], None, x["state"], x["ids"], x["dt_bias"],
                            x["rate"], None, x["z"], x["gweight"], 1e-6, key_heads=16, write_state=True)
    assert len(steps) == (1 if c == 1 else 0)


def test_the_joined_step_replays_in_a_graph_decode_after_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Captured once, the joined decode step replayed three times on new inputs moves the window and the state on as
    three eager unjoined decodes do, bit for bit (its counters come back to zero every launch)."""
    from ignis.kernels import fused, gdn

    monkeypatch.setattr(gdn, "CUDA_COLUMNS", True)
    monkeypatch.setattr(gdn, "CUDA_NORMED", False)
    monkeypatch.setattr(fused, "CUDA_CONV", True)
    shape = (8, 1, 16, 48, 128, 128)
    hk = shape[2]
    x = _step_inputs(shape, 11)
    window, state = x["window"].clone(), x["state"].clone()
    ref_window, ref_state = window.clone(), state.clone()
    g = torch.Generator(device="cuda").manual_seed(12)
    feeds = [(torch.randn(x["raw"].shape, device="cuda", generator=g) * 2).to(torch.bfloat16) for _ in range(3)]
    raw = x["raw"]

    def run(win: torch.Tensor, st: torch.Tensor) -> torch.Tensor:
        return gdn.conv_columns_normed(win, raw, x["taps"], x["ba"], None, st, x["ids"], x["dt_bias"], x["rate"], None,
                                       x["z"], x["gweight"], 1e-6, key_heads=hk, write_state=True)

    monkeypatch.setattr(gdn, "STEP", True)
    run(window.clone(), state.clone())  # compile, load and make the counters before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = run(window, state)
    ys = []
    for feed in feeds:
        raw.copy_(feed)
        graph.replay()
        ys.append(y.clone())
    monkeypatch.setattr(gdn, "STEP", False)
    for feed, got in zip(feeds, ys):
        raw.copy_(feed)
        want = run(ref_window, ref_state)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    torch.cuda.synchronize()
    assert torch.equal(window, ref_window) and torch.equal(state.view(torch.int32), ref_state.view(torch.int32))


def _fused_inputs(b: int, c: int) -> dict[str, object]:
    """The 27B shape's fused-kernel inputs in bf16 on the GPU (hidden 5120; GDN 48 value heads of 128, conv 10240;
    attention 24 query heads, 4 KV heads of 256, rotary 64; MLP 17408), lanes out of order."""
    g = torch.Generator(device="cuda").manual_seed(b * 10 + c)
    bf = torch.bfloat16
    t, lanes, nh, nkv, hd, rd, hv, dv, dim = b * c, 9, 24, 4, 256, 64, 48, 128, 10240

    def r(*shape: int, s: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=g) * s).to(bf)

    angles = torch.rand(t, rd // 2, device="cuda", generator=g) * 6
    from tests.test_kernels_fused import paged

    # K/V in shuffled pages (ignis.model.pool's layout): 16 positions a page for the write, the engine's 64 for
    # attention.
    cpu = torch.Generator().manual_seed(b * 10 + c)
    (kc, vc), table = paged([r(lanes, 64, nkv, hd).cpu(), r(lanes, 64, nkv, hd).cpu()], 16, cpu)
    akc_lanes, avc_lanes = r(lanes, 2000, nkv, hd), r(lanes, 2000, nkv, hd)
    (akc, avc), atable = paged([akc_lanes.cpu(), avc_lanes.cpu()], 64, cpu)
    return {
        "x": r(t, 5120), "d": r(t, 5120), "scale": torch.rand(5120, device="cuda", generator=g) + 0.5,
        "window": r(lanes, 3, dim), "lanes": torch.randperm(lanes, device="cuda", generator=g)[:b],
        "raw": r(t, 20000)[:, 3000 : 3000 + dim].reshape(b, c, dim),  # a view of a wider projection, as in the layer
        "raw7": r(b, 21, dim), "ba7": r(b, 21, 2 * hv, s=2.0),  # a prefill piece's columns: three blocks of 8
        "weight": torch.randn(dim, 4, device="cuda", generator=g), "ba": r(b, c, 2 * hv, s=2.0),
        "record": r(lanes, c, dim), "out": torch.randn(t, hv, dv, device="cuda", generator=g),
        "z": r(t, 2 * hv * dv, s=2.0)[:, hv * dv :], "gweight": r(dv), "gu": r(t, 2 * 17408, s=3.0),
        "qkv": r(t, (2 * nh + 2 * nkv) * hd, s=2.0), "qscale": torch.rand(hd, device="cuda", generator=g) + 0.5,
        "kscale": torch.rand(hd, device="cuda", generator=g) + 0.5,
        "cos": torch.cat([angles.cos(), angles.cos()], -1).to(bf),
        "sin": torch.cat([angles.sin(), angles.sin()], -1).to(bf),
        "kc": kc.cuda(), "vc": vc.cuda(), "table": table.cuda(),
        "positions": (torch.randint(0, 50, (b, 1), device="cuda", generator=g) + torch.arange(c, device="cuda")),
        "o": r(b, nkv, nh // nkv * c, hd), "nh": nh, "nkv": nkv, "hk": 16, "dk": 128,
        # attention over a 2000-slot span, lanes at positions 0 .. 1990 (the queries: "o")
        "akc": akc.cuda(), "avc": avc.cuda(), "atable": atable.cuda(), "akc_lanes": akc_lanes, "avc_lanes": avc_lanes,
        "apos": torch.randint(0, 1990, (b, 1), device="cuda", generator=g) + torch.arange(c, device="cuda"),
        # the dflash2 drafter's grouped conv at the 27B drafter's width: blocks of 8 rows, 4 taps, groups of 16
        "cx": r(b, 8, 5120), "cbase": r(4, 5120), "cdyn": r(b, 8, 2, 4, 320, s=0.5)[:, :, 1],
    }


def _fused_kernels(x: dict, eps: float = 1e-6) -> dict[str, torch.Tensor]:
    from ignis.kernels import fused

    out: dict[str, torch.Tensor] = {}
    out["resid"], out["normed"] = fused.add_rms_norm(x["x"], x["d"], x["scale"], eps)
    _, out["normed0"] = fused.add_rms_norm(x["x"], None, x["scale"], eps)
    window = x["window"].clone()
    out["mixed"], out["ba_f"] = fused.conv(window, x["lanes"], x["raw"], x["weight"], x["ba"], None,
                                                  key_heads=x["hk"], dk=x["dk"])
    out["window"] = window
    record = x["record"].clone()
    out["mixed_r"], _ = fused.conv(x["window"].clone(), x["lanes"], x["raw"], x["weight"], x["ba"], record,
                                   key_heads=x["hk"], dk=x["dk"])
    out["record"] = record
    window = x["window"].clone()
    out["mixed7"], out["ba7_f"] = fused.conv(window, x["lanes"], x["raw7"], x["weight"], x["ba7"], None,
                                             key_heads=x["hk"], dk=x["dk"])
    out["window7"] = window
    out["y"] = fused.gated_norm(x["out"], x["z"], x["gweight"], eps)
    out["swiglu"] = fused.swiglu(x["gu"])
    kc, vc = x["kc"].clone(), x["vc"].clone()
    out["qh"] = fused.qk_rope_write(x["qkv"], x["qscale"], x["kscale"], eps, x["cos"], x["sin"], kc, vc, x["table"],
                                    x["lanes"], x["positions"], x["nh"], x["nkv"])
    out["kc"], out["vc"] = kc, vc
    from ignis.kernels.attention import attend
    from tests.test_kernels_fused import visible

    seen = visible(x["apos"], x["nh"] // x["nkv"], 2000)
    out["attn"] = attend(x["o"], x["akc"], x["avc"], x["atable"], x["lanes"], x["apos"], seen,
                         x["o"].shape[-1] ** -0.5, x["qkv"], x["nh"])
    out["attn_lanes"] = out["attn"]  # the same output, against the reference over a per-lane cache
    out["gconv"] = fused.grouped_conv(x["cx"], x["cbase"], x["cdyn"], 16)
    out["gconv3"] = fused.grouped_conv(x["cx"][:, :3], x["cbase"], x["cdyn"][:, :3], 16)
    return out


def _conv_kernel(kernel: str, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Route fused.conv's decodes and verifies to `kernel` (numba or cuda); the list counts the CUDA launches."""
    from ignis.kernels import conv_cuda, fused

    monkeypatch.setattr(fused, "CUDA_CONV", kernel == "cuda")
    return _counted(monkeypatch, conv_cuda, "conv")


@pytest.mark.parametrize("conv", ["numba", "cuda"])
@pytest.mark.parametrize("b,c", [(1, 1), (1, 8), (8, 8), (3, 2)])
def test_fused_kernels_match_references_at_the_27b_shape(b: int, c: int, conv: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.test_kernels_fused import close, references

    launched = _conv_kernel(conv, monkeypatch)
    x = _fused_inputs(b, c)
    with torch.inference_mode():
        got = _fused_kernels(x)
    want = references(x, group=16)
    for name in want:
        close(got[name], want[name], name, bits=0.0 if name.startswith("attn") else 0.97)
    # the plain call and the recording one; the prefill piece of 21 columns is past the CUDA kernel's 8
    assert len(launched) == (2 if conv == "cuda" else 0)


@pytest.mark.parametrize("conv", ["numba", "cuda"])
def test_fused_kernels_replay_in_a_graph(conv: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.test_kernels_fused import close, references

    _conv_kernel(conv, monkeypatch)

    x = _fused_inputs(2, 4)
    with torch.inference_mode():
        _fused_kernels(x)  # compile and load before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = _fused_kernels(x)
        for t in got.values():
            t.zero_()
        graph.replay()
    torch.cuda.synchronize()
    want = references(x, group=16)
    for name in want:
        close(got[name], want[name], name, bits=0.0 if name.startswith("attn") else 0.97)


@pytest.mark.parametrize("triton", [True, False])
@pytest.mark.parametrize("t", [1, 8, 64])
def test_add_rms_norm_both_kernels_at_the_27b_width(t: int, triton: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton kernel (the round's) and the numba one (where Triton is missing) against the reference, bf16 rows
    of 5,120; a row's result does not depend on the call's other rows."""
    from ignis.kernels import fused
    from tests.test_kernels_fused import close

    monkeypatch.setattr(fused, "triton_installed", lambda: triton)
    g = torch.Generator(device="cuda").manual_seed(t)
    x = (torch.randn(t, 5120, device="cuda", generator=g) * 3).bfloat16()
    d = torch.randn(t, 5120, device="cuda", generator=g).bfloat16()
    scale = torch.rand(5120, device="cuda", generator=g) + 0.5
    with torch.inference_mode():
        resid, normed = fused.add_rms_norm(x, d, scale, 1e-6)
        _, normed0 = fused.add_rms_norm(x, None, scale, 1e-6)
        _, last = fused.add_rms_norm(x[-1:], d[-1:], scale, 1e-6)
    want_resid, want = fused.add_rms_norm_reference(x, d, scale, 1e-6)
    assert torch.equal(resid, want_resid)
    close(normed, want, "normed")
    close(normed0, fused.add_rms_norm_reference(x, None, scale, 1e-6)[1], "normed0")
    assert torch.equal(last[0], normed[-1])


# The Triton paged attention (ignis.kernels.attention_triton) at the 27B attention shape: 24 query heads on 4 KV heads
# of 256, bf16, pages of 64 in shuffled order behind a garbage-filled null page.
def _paged_attention_inputs(b: int, c: int, span: int) -> dict[str, object]:
    g = torch.Generator(device="cuda").manual_seed(b * 100 + c + span)
    nh, nkv, hd, page = 24, 4, 256, 64
    n = -(-span // page)
    table = torch.zeros(b + 1, n, dtype=torch.int64, device="cuda")  # lane b: unmapped, all on the null page
    table[:b] = (torch.randperm(b * n, device="cuda", generator=g) + 1).view(b, n)
    lanes = torch.randperm(b, device="cuda", generator=g)

    def r(*shape: int, s: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=g) * s).bfloat16()

    kc, vc = r(1 + b * n, page, nkv, hd), r(1 + b * n, page, nkv, hd)
    kc[0], vc[0] = kc[0] * 100, vc[0] * 100
    first = torch.randint(span // 2, span - c + 1, (b, 1), device="cuda", generator=g)  # ends anywhere in a page
    positions = first + torch.arange(c, device="cuda")
    from tests.test_kernels_fused import visible

    return {"q": r(b, nkv, nh // nkv * c, hd), "kc": kc, "vc": vc, "table": table, "lanes": lanes,
            "positions": positions, "mask": visible(positions, nh // nkv, span), "scale": hd**-0.5,
            "qkv": r(b * c, (2 * nh + 2 * nkv) * hd, s=2.0), "nh": nh}


def _paged_attention(x: dict, path: str) -> torch.Tensor:
    from ignis.kernels import attention

    attention.use(path)  # type: ignore[arg-type]
    try:
        return attention.attend(x["q"], x["kc"], x["vc"], x["table"], x["lanes"], x["positions"], x["mask"],
                                x["scale"], x["qkv"], x["nh"])
    finally:
        attention.use("auto")


@pytest.mark.parametrize("span", [1000, 40000])
@pytest.mark.parametrize("b,c", [(1, 1), (1, 8), (8, 1), (8, 8)])
def test_triton_attention_matches_the_reference_at_the_27b_shape(b: int, c: int, span: int) -> None:
    from ignis.kernels.attention import route

    x = _paged_attention_inputs(b, c, span)
    want = _paged_attention(x, "reference").float()
    with torch.inference_mode():
        got = _paged_attention(x, "triton")
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    err = float((got.float() - want).norm() / want.norm())
    assert err < 1e-2, err
    assert route(x["q"]) == "triton"  # auto: decode and verify both take the Triton kernel


def test_triton_attention_replays_in_a_graph() -> None:
    x = _paged_attention_inputs(8, 8, 1000)
    want = _paged_attention(x, "reference").float()
    with torch.inference_mode():
        _paged_attention(x, "triton")  # compile and load before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = _paged_attention(x, "triton")
        got.zero_()
        graph.replay()
    torch.cuda.synchronize()
    assert float((got.float() - want).norm() / want.norm()) < 1e-2


@pytest.mark.parametrize("rows", [1, 8, 16, 17])
@pytest.mark.parametrize("nout,ncols", [(5120, 17408), (248320, 5120)], ids=["mlp down", "output head"])
def test_streamed_dense_products_equal_cublas(rows: int, nout: int, ncols: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ops.STREAMING on, the 27B's mlp down and output head at up to STREAM_ROWS rows run the Triton
    weight-streaming kernel, within bf16's rounding of cuBLAS; more rows stay with cuBLAS."""
    import torch.nn.functional as F

    from ignis.kernels import gemv_triton
    from ignis.model import ops

    monkeypatch.setattr(ops, "STREAMING", True)
    calls: list[int] = []
    dense = gemv_triton.dense_gemv
    monkeypatch.setattr(gemv_triton, "dense_gemv", lambda x, w, config=None: calls.append(x.shape[0]) or dense(x, w))
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, ncols, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(nout, ncols, device="cuda", generator=g) * ncols**-0.5).to(torch.bfloat16)
    with torch.inference_mode():
        got = ops.linear(x, w, False)
        want = F.linear(x, w)
    assert calls == ([rows] if rows <= ops.STREAM_ROWS else [])
    err = float((got.float() - want.float()).norm() / want.float().norm())
    assert err < 1e-2, err


@pytest.mark.parametrize("rows", [1, 8])
def test_programmatic_dependent_launch_keeps_the_mlp_chain_bit_for_bit(rows: int,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """With launch.PDL on, swiglu, the streamed down projection and the residual norm launch ahead of the kernel before
    them and wait for it: a graph of the 27B MLP chain (gate_up by cuBLAS, swiglu, down, add + norm) gives the bits it
    gives with PDL off, eagerly and replayed on new inputs (a read before the wait would see the last replay's
    values)."""
    import torch.nn.functional as F

    from ignis.kernels.gemv_triton import dense_gemv
    from ignis.kernels.norm_triton import add_rms_norm
    from ignis.kernels.swiglu_triton import swiglu
    from tests.pdl import same_bits_with_pdl

    g = torch.Generator(device="cuda").manual_seed(rows)
    hidden, inner = 5120, 17408
    w_gu = (torch.randn(2 * inner, hidden, device="cuda", generator=g) * hidden**-0.5).to(torch.bfloat16)
    w_down = (torch.randn(hidden, inner, device="cuda", generator=g) * inner**-0.5).to(torch.bfloat16)
    scale = 1 + 0.1 * torch.randn(hidden, device="cuda", generator=g)
    x = torch.randn(rows, hidden, device="cuda", generator=g).to(torch.bfloat16)
    inputs = [torch.randn(rows, hidden, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3)]

    def chain() -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(x, dense_gemv(swiglu(F.linear(x, w_gu)), w_down), scale, 1e-6)

    with torch.inference_mode():
        same_bits_with_pdl(chain, x, inputs, monkeypatch)
        same_bits_with_pdl(chain, x, inputs, monkeypatch, early=True)


@pytest.mark.parametrize("c", [1, 8])
def test_programmatic_dependent_launch_keeps_the_gdn_chain_bit_for_bit(c: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """With launch.PDL on, the CUDA C++ conv and recurrence load the window, the taps and the state before they wait
    for the kernel ahead: a graph of the 27B Gated DeltaNet's chain (the qkv projection by cuBLAS, the gates by the
    Triton product, the conv, the recurrence recording its columns) gives the bits it gives with PDL off, eagerly and
    replayed on new inputs."""
    import torch.nn.functional as F

    from ignis.kernels import conv_cuda, fused, gdn, gdn_chunk, gdn_cuda
    from ignis.kernels.gemv_triton import dense_gemv
    from tests.pdl import same_bits_with_pdl

    monkeypatch.setattr(fused, "CUDA_CONV", True)  # the kernel PDL routes to, with PDL off as well
    monkeypatch.setattr(gdn, "CUDA_COLUMNS", True)
    convs, recurrences = _counted(monkeypatch, conv_cuda, "conv"), _counted(monkeypatch, gdn_cuda, "columns")
    chunks = _counted(monkeypatch, gdn_chunk, "columns")
    g = torch.Generator(device="cuda").manual_seed(c)
    hidden, hk, hv, dk, dv, lanes = 5120, 16, 48, 128, 128, 3
    dim = 2 * hk * dk + hv * dv
    bf = torch.bfloat16
    w_in = (torch.randn(dim, hidden, device="cuda", generator=g) * hidden**-0.5).to(bf)
    w_ba = (torch.randn(2 * hv, hidden, device="cuda", generator=g) * hidden**-0.5).to(bf)
    window = torch.randn(lanes, 3, dim, device="cuda", generator=g).to(bf)
    taps = torch.randn(dim, 4, device="cuda", generator=g) * 0.5
    state = torch.randn(lanes, hv, dk, dv, device="cuda", generator=g) * 0.1
    dt_bias, rate = torch.randn(hv, device="cuda", generator=g), -torch.rand(hv, device="cuda", generator=g)
    ids = torch.tensor([2], device="cuda")
    conv_rec = torch.zeros(lanes, 8, dim, device="cuda", dtype=bf)
    gdn_rec = torch.zeros(lanes, 8, hv, gdn.record_width(dk, dv), device="cuda")
    x = torch.randn(c, hidden, device="cuda", generator=g).to(bf)
    inputs = [torch.randn(c, hidden, device="cuda", generator=g).to(bf) for _ in range(3)]

    def chain() -> tuple[torch.Tensor, ...]:
        raw, ba = F.linear(x, w_in).view(1, c, dim), dense_gemv(x, w_ba).view(1, c, 2 * hv)
        mixed, ba32 = fused.conv(window, ids, raw, taps, ba, conv_rec, key_heads=hk, dk=dk)
        out = gdn.columns(state, ids, mixed, ba32, dt_bias, rate, gdn_rec, key_heads=hk, write_state=False,
                          normalised=True)
        return mixed, out, conv_rec[2, :c].clone(), gdn_rec[2, :c].clone()

    with torch.inference_mode():
        same_bits_with_pdl(chain, x, inputs, monkeypatch)
    assert convs and (chunks if c > 1 and gdn.CHUNK_VERIFY else recurrences)  # the CUDA C++ kernels ran
