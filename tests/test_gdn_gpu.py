"""The Gated DeltaNet's kernels on a real GPU at the 27B shapes: the recurrence in each kernel and shape (column by
column in numba and CUDA C++, a verify in chunk form), with the gated norm, the commit's replay, the conv joined to the
recurrence or the chunk form against the two launches, under graph replay, and the conv and recurrence chain launched
programmatic-dependent. Needs CUDA; CI has none."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_calls import counted as _counted

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)


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
