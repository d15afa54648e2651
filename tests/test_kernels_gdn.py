"""The Gated DeltaNet kernels (ignis.kernels.gdn) against their torch references, and the references against the
model's own recurrence.

The kernel source runs in numba's CUDA simulator in a child interpreter (NUMBA_ENABLE_CUDASIM must be set before
numba.cuda is imported, and the rest of the suite keeps the real numba.cuda), on shapes with two blocks per head,
value heads sharing key heads, and lanes that are not in order; the GPU run of the same comparison is in
tests/test_gdn_gpu.py.
"""

from __future__ import annotations

import pytest
import simulator
import torch

from ignis.kernels.gdn import columns_reference, gates, record_width, replay_reference
from ignis.model import delta_rule
from ignis.model.ops import l2norm


def _inputs(b: int, c: int, hk: int, hv: int, dk: int, dv: int, lanes: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = {
        "state": torch.randn(lanes, hv, dk, dv, generator=g) * 0.1,
        "lanes": torch.randperm(lanes, generator=g)[:b],
        "q": torch.randn(b, c, hk, dk, generator=g),
        "k": torch.randn(b, c, hk, dk, generator=g),
        "v": torch.randn(b, c, hv, dv, generator=g),
        "ba": torch.randn(b, c, 2 * hv, generator=g) * 2,
        "dt_bias": torch.randn(hv, generator=g),
        "rate": -torch.rand(hv, generator=g) * 2,
    }
    x["mixed"] = torch.cat([x["q"].flatten(2), x["k"].flatten(2), x["v"].flatten(2)], dim=-1)
    return x


def test_references_follow_the_model_recurrence_and_replay_any_prefix() -> None:
    x = _inputs(3, 4, 2, 4, 8, 8, lanes=5, seed=0)
    state = x["state"].clone()
    record = torch.zeros(5, 4, 4, record_width(8, 8))
    out = columns_reference(state, x["lanes"], x["mixed"], x["ba"], x["dt_bias"], x["rate"], record, key_heads=2,
                            write_state=False)
    g, beta = gates(x["ba"], x["dt_bias"], x["rate"])
    assert torch.equal(state, x["state"])  # a verify leaves the state alone
    st = x["state"][x["lanes"]]
    after = []
    for j in range(4):
        qj = l2norm(x["q"][:, j]).repeat_interleave(2, dim=1) * 8**-0.5
        kj = l2norm(x["k"][:, j]).repeat_interleave(2, dim=1)
        st, o = delta_rule.recurrent_step(st, qj, kj, x["v"][:, j], g[:, j], beta[:, j])
        torch.testing.assert_close(out[:, j], o)
        after.append(st)
    last = torch.tensor([0, 3, 2])
    replay_reference(state, x["lanes"], record, last)
    for i, lane in enumerate(x["lanes"].tolist()):
        torch.testing.assert_close(state[lane], after[int(last[i])][i])


CHILD = r"""
import sys
import numpy as np, torch
from numba import cuda
from ignis.kernels.gdn import columns_reference, replay_reference, record_width
from ignis.kernels.gdn_kernel import block_shape, make_kernels
from tests.test_kernels_gdn import _inputs
from tests.test_kernels_sim import _install_warp_shim
_install_warp_shim()  # the recurrence sums a state column's four partials by warp shuffles

def check(b, c, hk, hv, dk, dv, lanes, cmax, seed, modes=((True, False), (False, True))):
    x = _inputs(b, c, hk, hv, dk, dv, lanes, seed=seed)
    # built for blocks of 8 state columns and run over dv = 16 (two blocks per head), staging cmax of the c columns
    # at a time (the last tile short)
    K = make_kernels(dk, 8, cmax)
    K_rep = K.replay
    tv, threads = block_shape(dk, 8)
    grid = ((dv + tv - 1) // tv, hv, b)
    np_ = {k: v.numpy().copy() for k, v in x.items()}
    # q and k as the fused conv leaves them (normalised, q scaled), as the kernel reads them
    from ignis.model.ops import l2norm
    normed_mixed = torch.cat([(l2norm(x["q"]) * dk**-0.5).flatten(2), l2norm(x["k"]).flatten(2), x["v"].flatten(2)],
                             -1)
    for write_state, with_record in modes:
        mixed = normed_mixed
        state = np_["state"].copy()
        out = np.zeros((b, c, hv, dv), np.float32)
        record = np.zeros((lanes, c, hv, record_width(dk, dv)), np.float32)
        args = (state, np_["lanes"], mixed.numpy(), np_["ba"], np_["dt_bias"], np_["rate"], out, record, hv // hk,
                hk * dk)
        K.columns[grid, threads](*args, write_state, with_record)
        ref_state = x["state"].clone()
        ref_record = torch.zeros(lanes, c, hv, record_width(dk, dv))
        ref = columns_reference(ref_state, x["lanes"], mixed, x["ba"], x["dt_bias"], x["rate"],
                                ref_record if with_record else None, key_heads=hk, write_state=write_state,
                                normalised=True)
        torch.testing.assert_close(torch.from_numpy(out), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.from_numpy(state), ref_state, rtol=1e-5, atol=1e-5)
        if with_record:
            used = x["lanes"]
            torch.testing.assert_close(torch.from_numpy(record)[used], ref_record[used], rtol=1e-5, atol=1e-5)
            last = np.array([c - 1, c // 2], np.int64)
            # two layers in one launch: the second holds the lanes' states and records in reverse order
            states, records = np.stack([state, state[::-1]]), np.stack([record, record[::-1]])
            K_rep[(grid[0], grid[1], 2 * b), threads](states, np_["lanes"], records, last, dv)
            ref_flip = ref_state.flip(0)
            replay_reference(ref_state, x["lanes"], ref_record, torch.from_numpy(last))
            replay_reference(ref_flip, x["lanes"], ref_record.flip(0), torch.from_numpy(last))
            torch.testing.assert_close(torch.from_numpy(states[0]), ref_state, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(torch.from_numpy(states[1]), ref_flip, rtol=1e-5, atol=1e-5)
    return x


# The parts run side by side (tests/simulator.py). "columns": key heads of 16 channels (runs of four, the GPU's
# 16-byte loads) in tiles of 16 of 21 columns (two load batches, a short tile, v split four ways). "window": key heads
# of 8 channels (a thread's rows in runs of two) in tiles of 2 of 5 columns, then the conv window.
if sys.argv[1] == "columns":
    check(2, 21, 1, 2, 16, 16, 3, cmax=16, seed=3)
    print("ok")
    sys.exit(0)
lanes = 4
x = check(2, 5, 1, 2, 8, 16, lanes, cmax=2, seed=1)

# The conv window after a commit, for every kept column count, lanes out of order; int16 as bf16 bits arrive.
from ignis.kernels.gdn import window_reference
from ignis.kernels.gdn_kernel import WINDOW_THREADS, make_window_kernel
K_win = make_window_kernel()
g = torch.Generator().manual_seed(2)
conv0 = torch.randint(-30000, 30000, (lanes, 3, 150), generator=g, dtype=torch.int16)
inputs = torch.randint(-30000, 30000, (lanes, 4, 150), generator=g, dtype=torch.int16)
for kept in range(4):
    last = np.array([kept, 3 - kept], np.int64)
    convs = np.stack([conv0.numpy(), conv0.flip(0).numpy()])  # two layers in one launch
    ins = np.stack([inputs.numpy(), inputs.flip(0).numpy()])
    K_win[((150 + WINDOW_THREADS - 1) // WINDOW_THREADS, 4), WINDOW_THREADS](convs, ins, x["lanes"].numpy(), last)
    for layer, (c0, inp) in enumerate(((conv0, inputs), (conv0.flip(0), inputs.flip(0)))):
        ref = c0.clone()
        window_reference(ref, inp, x["lanes"], torch.from_numpy(last), torch.arange(1, 4))
        assert torch.equal(torch.from_numpy(convs[layer]), ref), (kept, layer)
print("ok")
"""


def test_kernels_equal_the_references_in_the_simulator() -> None:
    failed = simulator.failures(simulator.run_parts(CHILD, [["columns"], ["window"]], timeout=600))
    assert not failed, failed


@pytest.mark.parametrize("normed", [None, torch.bfloat16, torch.float32], ids=["alone", "normed bf16", "normed fp32"])
@pytest.mark.parametrize("dk,dv", [(128, 128), (16, 16), (64, 128)])
def test_the_cuda_recurrence_compiles_for_sm90_in_its_launch_bound(dk: int, dv: int,
                                                                   normed: torch.dtype | None) -> None:
    # BLOCKS blocks of 128 threads (or one of 512, a whole head) an SM: sm_90's 64 K registers an SM over their threads.
    pytest.importorskip("cuda.bindings")
    from ignis.kernels.gdn_cuda import BLOCKS, defines
    from ignis.kernels.gdn_cuda_kernel import SOURCE
    from ignis.kernels.nvrtc import compile_cubin

    args = (dk, dv) if normed is None else (dk, dv, True, normed)
    cubin = compile_cubin(SOURCE, "gdn_columns", "sm_90", defines(*args))
    if normed is not None:
        assert cubin.spills == cubin.stack == 0 and 0 < cubin.registers <= 128, (cubin.registers, cubin.spills)
    else:
        # bounded for BLOCKS blocks an SM, the recurrence alone spills a few staging values (40 bytes at dk 128): the
        # order that spills none read the state after the staging and measured slower (gdn_cuda_kernel)
        assert 0 < cubin.registers <= 65536 // (128 * BLOCKS) and cubin.spills <= 64, (cubin.registers, cubin.spills)


@pytest.mark.parametrize("normed", [None, torch.bfloat16], ids=["alone", "normed"])
def test_the_cuda_recurrence_compiles_for_an_early_launch_as_it_does_for_a_plain_one(
        normed: torch.dtype | None) -> None:
    # launched programmatic-dependent (launch.gdn_pdl), the recurrence waits after its state loads: another binary,
    # within the same register bounds as the plain launch's
    pytest.importorskip("cuda.bindings")
    from ignis.kernels.gdn_cuda import defines
    from ignis.kernels.gdn_cuda_kernel import SOURCE
    from ignis.kernels.nvrtc import compile_cubin

    normed_args = (False, torch.float32) if normed is None else (True, normed)
    plain = compile_cubin(SOURCE, "gdn_columns", "sm_90", defines(128, 128, *normed_args))
    early = compile_cubin(SOURCE, "gdn_columns", "sm_90", defines(128, 128, *normed_args, early=True))
    assert early.image != plain.image
    assert (early.registers, early.spills, early.stack) == (plain.registers, plain.spills, plain.stack)


@pytest.mark.parametrize("normed", [None, torch.bfloat16], ids=["alone", "normed"])
@pytest.mark.parametrize("cols", [1, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_recurrence_with_the_conv_joined_compiles_for_sm90_in_its_launch_bound(
        dtype: torch.dtype, cols: int, normed: torch.dtype | None) -> None:
    # gdn_cuda.step: the same launch bounds as the recurrence alone; bounded for BLOCKS blocks an SM, the conv's staging
    # spills a few values more (a decode's one-column binary fewer than a verify's); the whole head spills none
    pytest.importorskip("cuda.bindings")
    from ignis.kernels.gdn_cuda import BLOCKS, defines
    from ignis.kernels.gdn_cuda_kernel import SOURCE
    from ignis.kernels.nvrtc import compile_cubin

    args = (128, 128) if normed is None else (128, 128, True, normed)
    joined = compile_cubin(SOURCE, "gdn_columns", "sm_90", defines(*args, conv=(dtype, 4, cols)))
    alone = compile_cubin(SOURCE, "gdn_columns", "sm_90", defines(*args))
    assert joined.image != alone.image
    if normed is not None:
        assert joined.spills == joined.stack == 0 and 0 < joined.registers <= 128, (joined.registers, joined.spills)
    else:
        assert 0 < joined.registers <= 65536 // (128 * BLOCKS) and joined.spills <= 192, (joined.registers,
                                                                                           joined.spills)


@pytest.mark.parametrize("shape", [(3, 4, 2, 4, 16, 16), (2, 8, 2, 6, 32, 16), (1, 8, 16, 48, 128, 128)])
def test_the_chunk_form_of_a_verify_equals_the_column_by_column_reference(shape: tuple[int, ...]) -> None:
    # ignis.kernels.gdn_chunk's algebra (the kernel's, in torch): the outputs and records of a verify, with decays as
    # fast as exp(-40) a column in one lane, where quotients of the decays' running products would be 0 / 0
    from ignis.kernels.gdn import normalise_qk
    from ignis.kernels.gdn_chunk import chunk_reference

    b, c, hk, hv, dk, dv = shape
    x = _inputs(b, c, hk, hv, dk, dv, b + 2, seed=sum(shape))
    mixed = normalise_qk(x["mixed"], hk, dk)
    x["ba"][0, :, hv:] = 40.0  # softplus(40 + dt_bias) * rate: g near -40 * |rate|
    x["rate"][0] = -1.0
    rec, ref_rec = (torch.zeros(b + 2, c, hv, record_width(dk, dv)) for _ in range(2))
    out = chunk_reference(x["state"], x["lanes"], mixed, x["ba"], x["dt_bias"], x["rate"], rec, key_heads=hk)
    ref = columns_reference(x["state"].clone(), x["lanes"], mixed, x["ba"], x["dt_bias"], x["rate"], ref_rec,
                            key_heads=hk, write_state=False, normalised=True)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rec, ref_rec, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", ["chunk1", "chunk2", "chunk2x8"])
@pytest.mark.parametrize("dk,dv", [(128, 128), (16, 16), (64, 128)])
def test_the_chunk_form_compiles_for_sm90_in_its_launch_bound(dk: int, dv: int, shape: str) -> None:
    # gdn_chunk's kernel in each of tools.variants's shapes, TVC x SLICES threads bounded for MINB blocks an SM: no
    # spills and no stack (a register array indexed by a run-time count lands in local memory)
    pytest.importorskip("cuda.bindings")
    from ignis.kernels import gdn_chunk
    from ignis.kernels.gdn_chunk_kernel import SOURCE
    from ignis.kernels.nvrtc import compile_cubin
    from tools.variants import CHUNK_SHAPES

    assert {gdn_chunk.SHAPE, gdn_chunk.FEW} <= set(CHUNK_SHAPES.values())  # what ships is among the shapes compiled
    _, slices, blocks = CHUNK_SHAPES[shape]
    if not gdn_chunk._takes(dk, dv, CHUNK_SHAPES[shape]):
        pytest.skip("gdn_chunk.fits sends these heads to the column-by-column kernel")
    cubin = compile_cubin(SOURCE, "gdn_chunk", "sm_90", gdn_chunk.defines(dk, dv, CHUNK_SHAPES[shape]))
    threads = min(gdn_chunk.TVC, dv) * slices
    assert cubin.spills == cubin.stack == 0, (cubin.registers, cubin.spills, cubin.stack)
    assert 0 < cubin.registers <= min(255, 65536 // (threads * blocks)), cubin.registers


def test_a_verify_on_the_cpu_takes_the_reference() -> None:
    # the chunk form's route is the GPU's: a CPU verify runs the torch reference whatever CHUNK_VERIFY says
    from ignis.kernels import gdn

    x = _inputs(2, 4, 2, 4, 16, 16, 4, seed=3)
    assert not gdn._chunked(x["state"], 4, torch.zeros(4, 4, 4, record_width(16, 16)), False)


@pytest.mark.parametrize("dk,dv,cols", [(128, 128, 8), (16, 16, 4), (64, 32, 5)])
def test_the_cuda_replay_compiles_for_sm90_without_spills(dk: int, dv: int, cols: int) -> None:
    pytest.importorskip("cuda.bindings")
    from ignis.kernels.nvrtc import compile_cubin
    from ignis.kernels.replay_cuda import defines
    from ignis.kernels.replay_cuda_kernel import SOURCE

    cubin = compile_cubin(SOURCE, "gdn_replay", "sm_90", defines(dk, dv, cols))
    assert cubin.spills == cubin.stack == 0 and 0 < cubin.registers <= 128, (cubin.registers, cubin.spills)


def test_a_kernel_variant_is_compiled_and_loaded_once_a_device(monkeypatch: pytest.MonkeyPatch) -> None:
    # nvrtc.load, which the recurrence, chunk-form, replay and conv launches share: one Function a (source, name,
    # defines, device), built from the cubin compiled for the device's architecture
    from ignis.kernels import nvrtc
    from ignis.kernels.replay_cuda import defines
    from ignis.kernels.replay_cuda_kernel import SOURCE

    pytest.importorskip("cuda.bindings")
    made: list[tuple[str, torch.device]] = []

    class Loaded:
        def __init__(self, cubin: nvrtc.Cubin, name: str, device: torch.device) -> None:
            assert cubin.registers > 0
            made.append((name, device))

    monkeypatch.setattr(nvrtc, "Function", Loaded)
    monkeypatch.setattr(nvrtc, "arch_of", lambda device: "sm_90")
    monkeypatch.setattr(nvrtc, "_loaded", {})
    first, second = torch.device("cuda", 0), torch.device("cuda", 1)
    a = nvrtc.load(SOURCE, "gdn_replay", defines(16, 16, 4), first)
    assert nvrtc.load(SOURCE, "gdn_replay", defines(16, 16, 4), first) is a
    assert nvrtc.load(SOURCE, "gdn_replay", defines(16, 16, 4), second) is not a
    assert nvrtc.load(SOURCE, "gdn_replay", defines(16, 16, 8), first) is not a
    assert made == [("gdn_replay", first), ("gdn_replay", second), ("gdn_replay", first)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", ["chunk1", "chunk2", "chunk2x8"])
def test_the_chunk_form_with_the_conv_joined_compiles_for_sm90_in_its_launch_bound(shape: str,
                                                                                   dtype: torch.dtype) -> None:
    # gdn_chunk.step: the chunk form's binary with CONV, within the same launch bounds and without spills
    pytest.importorskip("cuda.bindings")
    from ignis.kernels import gdn_chunk
    from ignis.kernels.gdn_chunk_kernel import SOURCE
    from ignis.kernels.nvrtc import compile_cubin
    from tools.variants import CHUNK_SHAPES

    columns, slices, blocks = CHUNK_SHAPES[shape]
    key = gdn_chunk.defines(128, 128, CHUNK_SHAPES[shape]) + (("CONV", 1), ("CBF16", int(dtype == torch.bfloat16)),
                                                              ("KC", 4))
    cubin = compile_cubin(SOURCE, "gdn_chunk", "sm_90", key)
    assert cubin.spills == cubin.stack == 0, (cubin.registers, cubin.spills, cubin.stack)
    assert 0 < cubin.registers <= min(255, 65536 // (gdn_chunk.TVC * slices * blocks)), cubin.registers
