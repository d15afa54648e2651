"""int4_mma's ring loop (the kernel's RING, ignis.kernels.int4_mma.RING_LAUNCHES): which launches take it, that they
compile without spills, and, in the SASS ptxas makes of it, that every load of codes is issued at least half of the
steps it is loaded ahead before the first instruction that reads it (the plain loop's are not: ptxas moves them to the
loop's end, where the copies between slots read them about thirty instructions on). Compiles for sm_90 with NVRTC and
disassembles with nvdisasm (the test extra's nvidia-cuda-nvdisasm); no GPU. Its bits are the GPU tests' (a row's
result the same under every launch, tests/test_quant_mma_gpu.py)."""

from __future__ import annotations

import re
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ignis.kernels import int4_mma
from ignis.kernels.int4_mma import Shape, choose, launch, ringed, split
from ignis.kernels.int4_mma_kernel import SOURCE
from ignis.kernels.nvrtc import compile_cubin
from test_kernels_int4_mma import _defines as int4_mma_defines

SMS = 132  # an H200's
O_PROJ, DOWN, GATE_UP = (5120, 6144), (5120, 17408), (34816, 5120)  # the 27B's [out, in]
RING = (2, 2, False)  # (U, AHEAD, XRING): o_proj's ring launch on the H100


def _defines(s: Shape, pdl: int = 1) -> tuple[tuple[str, int], ...]:
    """One row tile's macros for the launch `s`, launched programmatic-dependent (with the early trigger) or not."""
    return (*int4_mma_defines(s, 1), ("PDL", pdl), ("TRIGGER", pdl), ("RING", int(s.ring)), ("XRING", int(s.xring)))


def _sass(defines: tuple[tuple[str, int], ...], tmp: Path, encoded: bool = False) -> str:
    from cuda.pathfinder import find_nvidia_binary_utility

    nvdisasm = find_nvidia_binary_utility("nvdisasm")
    assert nvdisasm, "nvdisasm not found: install the test extra (nvidia-cuda-nvdisasm)"
    cubin = tmp / "int4_mma.cubin"
    cubin.write_bytes(compile_cubin(SOURCE, "int4_mma", "sm_90", defines).image)
    flags = ["-c", "-hex"] if encoded else ["-c"]
    return subprocess.run([nvdisasm, *flags, str(cubin)], capture_output=True, text=True, check=True).stdout


def _span(sass: str) -> tuple[list[str], int, int]:
    """The kernel's instructions and the span [start, stop) of the loop that holds the mma (from the label a backward
    branch targets to that branch)."""
    labels: dict[str, int] = {}
    insns: list[str] = []
    for line in sass.splitlines():
        if label := re.match(r"\s*(\.L_x_\d+):", line):
            labels[label.group(1)] = len(insns)
        elif found := re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line):
            insns.append(found.group(1))
    for i, insn in enumerate(insns):
        target = re.search(r"BRA `\((\.L_x_\d+)\)", insn)
        start = labels.get(target.group(1), i + 1) if target else i + 1
        if start <= i and any("HMMA" in x for x in insns[start:i]):
            return insns, start, i + 1
    raise AssertionError("the kernel has no loop of mma")


def _loop(sass: str) -> list[str]:
    """The instructions of the loop that holds the mma."""
    insns, start, stop = _span(sass)
    return insns[start:stop]


def _scoreboards(sass: str) -> list[tuple[int, int]]:
    """Each instruction's scoreboards from its control bits (nvdisasm -hex; bits 41-61 of the second word on sm_70
    on): (the one it sets when its result lands, 7 for none; the mask of those it waits on first)."""
    words = [int(w, 16) >> 41 for w in re.findall(r"/\* (0x[0-9a-f]{16}) \*/", sass)]
    return [((c >> 5) & 7, (c >> 11) & 0x3F) for c in words[1::2]]


REGISTER = re.compile(r"(?<![A-Z])R(\d+)")


def _operands(insn: str) -> list[str]:
    words = insn.split(None, 2 if insn.startswith("@") else 1)  # [predicate,] opcode, operands
    return [o.strip() for o in words[-1].split(",")] if len(words) > (2 if insn.startswith("@") else 1) else []


def _leads(loop: list[str], opcode: str = "LDG.E.NA.128") -> list[int]:
    """For each load of four registers `opcode` in the loop (LDG.E.NA.128: codes; LDG.E.128: x), how many
    instructions on, going round the loop, the first one that reads one of its registers is."""
    leads = []
    for i, insn in enumerate(loop):
        if not re.search(rf"\b{re.escape(opcode)}\b", insn):
            continue
        first = int(REGISTER.search(_operands(insn)[0]).group(1))  # type: ignore[union-attr]
        written = set(range(first, first + 4))
        for k in range(1, len(loop)):
            ops = _operands(loop[(i + k) % len(loop)])
            sources = ops[1:] if ops and REGISTER.fullmatch(ops[0].split(".")[0]) else ops  # after a register written
            if any(int(r) in written for o in sources for r in REGISTER.findall(o)):
                leads.append(k)
                break
    return leads


def test_the_ring_goes_to_the_shapes_named_at_one_row_tile_without_the_swiglu_store(
        monkeypatch: pytest.MonkeyPatch) -> None:
    base = launch(choose(*O_PROJ, 128, SMS), 1)
    monkeypatch.setattr(int4_mma, "RING_LAUNCHES", {})
    assert ringed(base, 1, *O_PROJ, 128) == base  # RING_LAUNCHES empty: nothing changes
    monkeypatch.setattr(int4_mma, "RING_LAUNCHES", {O_PROJ: RING, DOWN: (2, 1, True)})
    assert ringed(base, 1, *O_PROJ, 128) == replace(base, u=2, ahead=2, ring=True)
    assert (base.ks, base.kw, base.unit) == (ringed(base, 1, *O_PROJ, 128).ks, 8, 4)  # the order of the sums kept
    down = launch(choose(*DOWN, 128, SMS), 1)
    assert ringed(down, 1, *DOWN, 128) == replace(down, u=2, ahead=1, ring=True, xring=True)  # its own launch
    gate_up = launch(choose(*GATE_UP, 128, SMS), 1)
    assert ringed(gate_up, 1, *GATE_UP, 128) == gate_up  # a shape not named
    two = launch(base, 2)
    assert ringed(two, 2, *O_PROJ, 128) == two  # two row tiles
    assert ringed(base, 1, *O_PROJ, 128, swiglu=True) == base
    assert ringed(base, 1, *O_PROJ, 256) == base  # U 2 would not hold a group of 256 columns


def test_ring_launches_compile_for_sm90_without_spills() -> None:
    """RING and its neighbours, and with x in the ring (XRING) (ptxas spills a few bytes at U 4 AHEAD 3 for down, at
    U 2 AHEAD 1 for gate_up: launches that only the sweep tries)."""
    for shape in (O_PROJ, DOWN, GATE_UP):
        base = launch(choose(*shape, 128, SMS), 1)
        for u, ahead in (RING[:2], (2, 3), (4, 1), (4, 2)):
            for f in (1, 2):
                s = replace(base, u=u, ahead=ahead, f=f, ring=True)
                cubin = compile_cubin(SOURCE, "int4_mma", "sm_90", _defines(s))
                assert cubin.spills == 0 and 0 < cubin.registers <= 255, (shape, s, cubin.registers)
        for u, ahead in ((2, 1), (2, 2), (4, 1)):  # x in the ring as well (what the sweep times)
            s = replace(base, u=u, ahead=ahead, ring=True, xring=True)
            cubin = compile_cubin(SOURCE, "int4_mma", "sm_90", _defines(s))
            assert cubin.spills == 0 and 0 < cubin.registers <= 255, (shape, s, cubin.registers)
    for (nout, ncols), (u, ahead, xring) in int4_mma.RING_LAUNCHES.items():  # what ships, on its split
        s = ringed(launch(split(nout, ncols, 128, SMS), 1), 1, nout, ncols, 128)
        assert (s.ring, s.u, s.ahead, s.xring) == (True, u, ahead, xring)
        cubin = compile_cubin(SOURCE, "int4_mma", "sm_90", _defines(s))
        # at most 80 registers: one wave on 132 SMs (o_proj and down 3 blocks of 8 warps an SM, in_proj 8 blocks of 3)
        assert cubin.spills == 0 and cubin.registers <= 80, (nout, ncols, s, cubin.registers)


def test_the_ring_issues_each_steps_codes_well_before_their_first_use(tmp_path: Path) -> None:
    """At least half of the AHEAD steps' instructions between a load of codes and its first reader; the shipped
    plain loop (RING 0, U 4, AHEAD 1) has under a quarter of one step's."""
    base = launch(choose(*O_PROJ, 128, SMS), 1)
    for u, ahead, pdl in ((2, 2, 1), (2, 1, 1), (4, 1, 1), (2, 3, 1), (2, 2, 0)):
        loop = _loop(_sass(_defines(replace(base, u=u, ahead=ahead, ring=True), pdl=pdl), tmp_path))
        leads = _leads(loop)
        assert len(leads) == u * (ahead + 1), (u, ahead, leads)  # every slot's loads, once a step
        assert min(leads) >= ahead * len(loop) / (ahead + 1) / 2, (u, ahead, len(loop), leads)
    plain = _loop(_sass(_defines(base), tmp_path))
    assert max(_leads(plain)) < len(plain) / 4  # what the ring is for (ptxas 13's placement)


def test_no_wait_for_the_codes_comes_within_half_a_step_of_a_load_of_them(tmp_path: Path) -> None:
    """ptxas gives every load of codes one scoreboard, and an instruction that waits on it waits for all of them: a
    step that waited for its own codes after issuing the loads of the step AHEAD on would hold for their whole
    latency. On the ring each step's loads issue after that wait (`landed`), so every wait on the codes' scoreboard
    comes at least half a step's instructions after the last load of codes, going round the loop; ptxas 13 put one 6
    instructions after them before (a step of o_proj's ring launch took about 140)."""
    for (u, ahead, pdl), shape in [((2, 2, 1), O_PROJ), ((2, 2, 0), O_PROJ), ((2, 1, 1), O_PROJ), ((4, 1, 1), O_PROJ),
                                   ((2, 3, 1), O_PROJ), ((2, 2, 1), DOWN)]:
        s = replace(launch(split(*shape, 128, SMS), 1), u=u, ahead=ahead, ring=True)
        sass = _sass(_defines(s, pdl=pdl), tmp_path, encoded=True)
        insns, start, stop = _span(sass)
        boards = _scoreboards(sass)
        assert len(boards) == len(insns)
        loads = [i for i in range(start, stop) if re.search(r"\bLDG\.E\.NA\.128\b", insns[i])]
        (board,) = {boards[i][0] for i in loads}  # one scoreboard for every load of codes
        step = (stop - start) / (ahead + 1)
        for i in range(start, stop):
            if boards[i][1] >> board & 1:
                since = min((i - k) % (stop - start) or stop - start for k in loads)
                assert since >= step / 2, (u, ahead, pdl, insns[i], since, step)


def test_x_in_the_ring_is_issued_well_before_its_first_use(tmp_path: Path) -> None:
    """With XRING the x loads (LDG.E.128, predicated on the row) lead their first reader as the codes do; without it,
    by under a third of a step's instructions: x loaded right before the sums that read it."""
    base = launch(choose(*O_PROJ, 128, SMS), 1)
    for u, ahead in ((2, 1), (2, 2), (4, 1)):
        loop = _loop(_sass(_defines(replace(base, u=u, ahead=ahead, ring=True, xring=True)), tmp_path))
        leads = _leads(loop, "LDG.E.128")
        assert len(leads) == 2 * u * (ahead + 1), (u, ahead, leads)  # two 16-byte pieces a chunk, every slot's
        assert min(leads) >= ahead * len(loop) / (ahead + 1) / 2, (u, ahead, len(loop), leads)
    loop = _loop(_sass(_defines(replace(base, u=2, ahead=2, ring=True)), tmp_path))
    assert max(_leads(loop, "LDG.E.128")) < len(loop) / (2 + 1) / 3  # three steps in the loop


def test_a_split_named_for_a_shape_replaces_chooses_at_every_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """int4_mma.SPLITS: a weight's own (KS, KW), the unit and the rest of choose's launch kept; other shapes
    unchanged."""
    monkeypatch.setattr(int4_mma, "SPLITS", {})
    assert split(*DOWN, 128, SMS) == choose(*DOWN, 128, SMS)  # SPLITS empty
    monkeypatch.setattr(int4_mma, "SPLITS", {DOWN: (1, 8)})
    assert split(*DOWN, 128, SMS) == replace(choose(*DOWN, 128, SMS), ks=1, kw=8)
    assert split(*O_PROJ, 128, SMS) == choose(*O_PROJ, 128, SMS)
    for nt in (1, 2, 4, 8):
        s = launch(split(*DOWN, 128, SMS), nt)
        assert (s.ks, s.kw, s.unit) == (1, 8, 4)


def test_padded_rows_reading_row_0s_x_zero_no_register_and_predicate_no_load(tmp_path: Path) -> None:
    """XPAD (int4_mma.X_PAD_ROW0): the shipped 1-8-row launches compile without spills within 80 registers (3 blocks
    of 8 warps an SM) and their loop of mma zeroes no register and predicates no load of x, where the default build
    does both; the bits are the GPU tests' (tests/test_quant_mma_gpu.py)."""
    x_load = re.compile(r"\bLDG\.E\.128\.CONSTANT\b")
    for nout, ncols in (O_PROJ, DOWN, GATE_UP):
        s = ringed(launch(split(nout, ncols, 128, SMS), 1), 1, nout, ncols, 128)
        zero = _loop(_sass(_defines(s), tmp_path))
        assert any(i.startswith("CS2R") for i in zero) and any(i.startswith("@") and x_load.search(i) for i in zero)
        pad = (*_defines(s), ("XPAD", 1))
        cubin = compile_cubin(SOURCE, "int4_mma", "sm_90", pad)
        assert cubin.spills == 0 and cubin.registers <= 80, (nout, ncols, cubin.registers)
        row0 = _loop(_sass(pad, tmp_path))
        assert not any(i.startswith("CS2R") for i in row0), (nout, ncols)
        assert [i for i in row0 if x_load.search(i)] and not [i for i in row0 if x_load.search(i) and "@" in i]
        assert len(row0) < len(zero)


def test_x_pad_row0_reaches_the_launch_only_when_switched_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """int4_mma._function passes XPAD 1 to the compiler with X_PAD_ROW0 on, and no XPAD at all with it off (the
    default: the cubins the other tests read)."""
    from ignis.kernels import nvrtc

    seen: list[tuple[tuple[str, int], ...]] = []
    monkeypatch.setattr(nvrtc, "load", lambda source, name, defines, device: seen.append(defines))
    s = launch(split(*O_PROJ, 128, SMS), 1)
    assert int4_mma.X_PAD_ROW0 is False
    int4_mma._function(torch.device("cpu"), 1, s, 2, torch.bfloat16, torch.bfloat16)
    monkeypatch.setattr(int4_mma, "X_PAD_ROW0", True)
    int4_mma._function(torch.device("cpu"), 1, s, 2, torch.bfloat16, torch.bfloat16)
    assert [dict(d).get("XPAD") for d in seen] == [None, 1]
