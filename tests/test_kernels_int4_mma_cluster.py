"""int4_mma over a thread-block cluster (the kernel's CL and CLASYNC, ignis.kernels.int4_mma.CLUSTERS): a block's KW
warps spread over CL blocks of threads that meet in the first's shared memory. Here, without a GPU: the variants
compile for sm_90 without spills at the launches the 27B's products take, the source without CL builds the shipped
cubins byte for byte, the SASS holds the cluster's barrier and remote stores where it should, and which launches take
a cluster and which are refused. Their bits are the GPU tests' (the same as the launch without a cluster,
tests/test_quant_mma_gpu.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ignis.kernels import int4_mma
from ignis.kernels.int4_mma import Shape, clustered, launch, ringed, split
from ignis.kernels.int4_mma_kernel import SOURCE
from ignis.kernels.nvrtc import CompileError, compile_cubin
from test_kernels_int4_mma_ring import _defines, _sass

SMS = 132  # an H200's
O_PROJ, DOWN, GATE_UP = (5120, 6144), (5120, 17408), (34816, 5120)  # the 27B's [out, in]


def _shipped(nout: int, ncols: int, nt: int) -> Shape:
    return ringed(launch(split(nout, ncols, 128, SMS), nt), nt, nout, ncols, 128)


def _cl(s: Shape, cl: int, asynchronous: bool) -> tuple[tuple[str, int], ...]:
    return (*_defines(s), ("CL", cl), ("CLASYNC", int(asynchronous)))


@pytest.mark.parametrize("shape", [O_PROJ, DOWN, GATE_UP])
def test_every_cluster_of_a_launchs_warps_compiles_without_spills(shape: tuple[int, int]) -> None:
    """Every CL dividing the shipped one-row-tile launch's KW (8 for o_proj and down, 3 for gate_up), with the cluster's
    barrier and with st.async, compiles with no spill and at most a few registers more than the launch's own."""
    s = _shipped(*shape, 1)
    product = compile_cubin(SOURCE, "int4_mma", "sm_90", _defines(s))
    clusters = [cl for cl in range(2, 9) if s.kw % cl == 0]
    assert clusters, s
    for cl in clusters:
        for asynchronous in (False, True):
            cubin = compile_cubin(SOURCE, "int4_mma", "sm_90", _cl(s, cl, asynchronous))
            assert cubin.spills == 0 and cubin.registers <= product.registers + 8, (shape, cl, cubin.registers)
    assert compile_cubin(SOURCE, "int4_mma", "sm_90", (*_defines(s), ("CL", 1))).image == product.image


def test_without_a_cluster_the_source_builds_the_shipped_launch() -> None:
    """CL 1 (and CLASYNC 0) is the kernel as it was: the same cubin, byte for byte, at the 64-row split over row
    blocks and a split over blocks of threads too (their counters are indexed by the cluster's block, `bx`)."""
    for s, nt in ((_shipped(*DOWN, 8), 8), (replace(_shipped(*DOWN, 1), ks=2, kw=5), 1)):
        defines = (*_defines(s), ("NT", nt // s.rg)) if nt > 1 else _defines(s)
        plain = compile_cubin(SOURCE, "int4_mma", "sm_90", defines)
        assert compile_cubin(SOURCE, "int4_mma", "sm_90", (*defines, ("CL", 1), ("CLASYNC", 0))).image == plain.image


def test_the_cluster_meets_through_its_barrier_or_the_first_blocks_mbarrier(tmp_path: Path) -> None:
    """CL 2: remote stores to the first block's shared memory and the cluster's barrier (arrive, wait); with CLASYNC
    st.async (STAS) counted by an mbarrier (SYNCS), the cluster's barrier only to know it is ready, and no fence of
    the whole GPU; without CL none of it."""
    s = _shipped(*O_PROJ, 1)
    barrier = _sass(_cl(s, 2, False), tmp_path)
    assert "UCGABAR_ARV" in barrier and "UCGABAR_WAIT" in barrier and "STAS" not in barrier
    sent = _sass(_cl(s, 2, True), tmp_path)
    assert sent.count("STAS") == 4 and "SYNCS.ARRIVE.TRANS64" in sent and "MEMBAR" not in sent  # F 1, NT 1: 4 sums
    assert "UCGABAR_ARV" in sent and "UCGABAR_WAIT" in sent
    plain = _sass(_defines(s), tmp_path)
    assert not any(op in plain for op in ("UCGABAR", "STAS", "SYNCS"))


def test_a_cluster_that_does_not_divide_the_warps_is_refused_by_the_source_and_the_launch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    s = _shipped(*O_PROJ, 1)
    with pytest.raises(CompileError, match="CL divides KW"):
        compile_cubin(SOURCE, "int4_mma", "sm_90", _cl(s, 3, False))
    with pytest.raises(CompileError, match="CLASYNC"):
        compile_cubin(SOURCE, "int4_mma", "sm_90", (*_defines(s), ("CLASYNC", 1)))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cpu = torch.device("cpu")
    for bad in (replace(s, cl=3), replace(s, cl=16, kw=16), replace(s, cl_async=True)):
        with pytest.raises(ValueError, match="CL blocks of a cluster"):
            int4_mma._check_cluster(bad, cpu)
    int4_mma._check_cluster(replace(s, cl=4, cl_async=True), cpu)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    with pytest.raises(ValueError, match="sm_89"):
        int4_mma._check_cluster(replace(s, cl=2), cpu)


def test_clusters_names_the_shapes_that_take_one_where_the_device_has_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """CLUSTERS's entry for a shape goes to its launches at every row count, where CL divides the launch's KW and the
    device is sm_90 or later; every other shape, and an older card, keeps its launch."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(int4_mma, "CLUSTERS", {O_PROJ: (2, True), GATE_UP: (2, False)})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    for nt in (1, 2, 4, 8):
        s = _shipped(*O_PROJ, nt)
        assert clustered(s, *O_PROJ, cpu) == replace(s, cl=2, cl_async=True)
        assert clustered(_shipped(*DOWN, nt), *DOWN, cpu) == _shipped(*DOWN, nt)  # not named
    gate_up = _shipped(*GATE_UP, 1)
    assert gate_up.kw == 3 and clustered(gate_up, *GATE_UP, cpu) == gate_up  # 2 does not divide its 3 warps
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert clustered(_shipped(*O_PROJ, 1), *O_PROJ, cpu) == _shipped(*O_PROJ, 1)
