"""The mma 4-bit product's CPU side (ignis.kernels.int4_mma): the repacked layout against the tensor cores' fragment
rule, packing and unpacking, the launch choices, every launch the engine makes compiled for sm_90 by NVRTC without a
spill, and the repacked QuantLinear through packed_linear's reference path. The kernel itself runs on a GPU only:
tests/test_quant_mma_gpu.py checks it against its reference at the 27B shapes.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ignis.kernels import launch as kernel_launch
from ignis.kernels.int4_mma import ACTIVATIONS, SHARED, MmaCodes, Shape, choose, fits, launch, pack, row_tiles, unpack
from ignis.kernels.int4_mma_kernel import SOURCE
from ignis.kernels.nvrtc import CompileError, compile_cubin

from ignis.quant.format import dequantize, quantize
from ignis.quant.linear import QuantLinear, fuse_packed, packed_linear, repacked

SMS = 132  # an H200's


def _weight(nout: int, ncols: int, group: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return quantize(torch.randn(nout, ncols, generator=torch.Generator().manual_seed(seed)) * 0.05, group)


def _codes(qweight: torch.Tensor) -> torch.Tensor:
    return torch.stack((qweight & 0xF, qweight >> 4), dim=-1).reshape(qweight.shape[0], -1).long()


def test_every_code_sits_where_the_kernels_mma_reads_it() -> None:
    """From the PTX ISA's m16n8k16 fragments and the kernel's registers: lane (g, t)'s word w, nibble (p, half) is
    the A element of mma j = 2 (w // 2) + p // 2, feature g (+8 for odd w), slot 2t + half (+8 for odd p), which the
    B fragment pairs with input column 16t + 4j + 2 (p % 2) + half of the chunk."""
    nout, ncols = 48, 256
    qw, s, z = _weight(nout, ncols, 128)
    codes = _codes(qw)
    words = pack(qw, s, z, torch.bfloat16).codes.view(torch.int32).reshape(nout // 16, ncols // 64, 32, 4).long()
    lane = torch.arange(32)
    g, t = lane // 4, lane % 4
    for w in range(4):
        for nibble in range(8):
            p, half = nibble % 4, nibble // 4
            j = 2 * (w // 2) + p // 2
            feature = g + 8 * (w % 2)  # [32]
            column = 16 * t + 4 * j + 2 * (p % 2) + half  # [32]
            got = (words[..., w] >> (4 * p + 16 * half)) & 0xF  # [blocks, chunks, 32]
            rb, c = torch.meshgrid(torch.arange(nout // 16), torch.arange(ncols // 64), indexing="ij")
            want = codes[rb[..., None] * 16 + feature, c[..., None] * 64 + column]
            assert torch.equal(got, want), (w, nibble)


def test_the_scales_word_holds_the_scale_and_minus_magic_plus_zero() -> None:
    qw, s, z = _weight(32, 128, 64)
    for dtype in ACTIVATIONS:
        w = pack(qw, s, z, dtype)
        zs = w.zs.reshape(2, 2, 8, 2, 2)  # [blocks, groups, g, (feature g, g + 8), (scale, -(magic + z))]
        for h in range(2):
            feature = torch.arange(2)[:, None] * 16 + h * 8 + torch.arange(8)  # [blocks, g]
            scale = zs[:, :, :, h, 0].contiguous().view(torch.float16).permute(0, 2, 1)  # [blocks, g, groups]
            negz = zs[:, :, :, h, 1].contiguous().view(dtype).float().permute(0, 2, 1)
            assert torch.equal(scale, s[feature])
            magic = 128.0 if dtype == torch.bfloat16 else 1024.0
            assert torch.equal(negz, -(z[feature].float() + magic))


@pytest.mark.parametrize("group", [64, 128])
@pytest.mark.parametrize("dtype", ACTIVATIONS)
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
def test_unpack_returns_the_formats_tensors(group: int, dtype: torch.dtype, scale_dtype: torch.dtype) -> None:
    qw, s, z = _weight(64, 512, group)
    w = pack(qw, s.to(scale_dtype), z, dtype)
    assert w.shape == (64, 512) and w.codes.nbytes == qw.nbytes and w.zs.nbytes == 4 * s.numel()
    back = unpack(w)
    assert torch.equal(back[0], qw) and torch.equal(back[1], s.to(scale_dtype)) and torch.equal(back[2], z)
    assert torch.equal(w.dequantize(), dequantize(qw, s.to(scale_dtype), z, dtype))
    assert torch.equal(w.rows(16, 48).dequantize(), w.dequantize()[16:48])
    assert torch.equal(w[16:].dequantize(), w.dequantize()[16:]) and w[:32].shape == (32, 512)  # a slice, as dense


def test_shapes_the_layout_does_not_take_are_refused() -> None:
    assert fits(5120, 17408, 128) and not fits(19, 128, 64) and not fits(64, 256, 32)
    qw, s, z = _weight(24, 128, 64)
    with pytest.raises(ValueError, match="out % 16"):
        pack(qw, s, z, torch.bfloat16)
    qw, s, z = _weight(32, 128, 64)
    with pytest.raises(ValueError, match="bf16 or fp16 activations"):
        pack(qw, s, z, torch.float32)
    with pytest.raises(ValueError, match="blocks of 16"):
        pack(qw, s, z, torch.bfloat16).rows(0, 8)


# (out, in) of the 27B's products and the built-in model's
SHAPES = [(34816, 5120), (5120, 17408), (16384, 5120), (14336, 5120), (5120, 6144), (2048, 384), (384, 1024),
          (1280, 384), (512, 384)]


@pytest.mark.parametrize(("nout", "ncols"), SHAPES)
def test_the_split_comes_from_the_shape_and_every_launch_keeps_it(nout: int, ncols: int) -> None:
    base = choose(nout, ncols, 128, SMS)
    units = ncols // (64 * base.unit)
    assert base.ks * base.kw <= max(1, units // 3) or base.ks * base.kw == 1  # no part shorter than 3 units
    assert base.kw <= 8 and (64 * base.unit) % 128 == 0
    for nt in (1, 2, 4, 8):
        s = launch(base, nt)
        assert (s.ks, s.kw, s.unit) == (base.ks, base.kw, base.unit)  # the order of the sums
        assert base.unit % s.u == 0 and (64 * s.u) % 128 == 0
        assert (s.kw - 1) * s.rb * s.f * nt * 512 <= SHARED


def test_row_tiles() -> None:
    assert [row_tiles(r) for r in (1, 8, 9, 16, 17, 32, 33, 64)] == [1, 1, 2, 2, 4, 4, 8, 8]


def _defines(s: Shape, nt: int, f16: int = 0, sbf16: int = 1) -> tuple[tuple[str, int], ...]:
    return (("NT", nt // s.rg), ("F", s.f), ("U", s.u), ("AHEAD", s.ahead), ("KS", s.ks), ("KW", s.kw), ("RB", s.rb),
            ("RG", s.rg), ("GPC", 2), ("F16", f16), ("SBF16", sbf16))


def test_every_launch_at_the_27b_and_builtin_shapes_compiles_for_sm90_without_spills() -> None:
    seen: set[tuple[tuple[str, int], ...]] = set()
    for nout, ncols in SHAPES:
        for nt in (1, 2, 4, 8):
            seen.add(_defines(launch(choose(nout, ncols, 128, SMS), nt), nt))
    seen |= {_defines(Shape(4, 1, 3, 1, 1, 4, 1), 1, f16, sbf16) for f16 in (0, 1) for sbf16 in (0, 1)}
    for defines in sorted(seen):
        cubin = compile_cubin(SOURCE, "int4_mma", "sm_90", defines)
        # NT 8 with two feature blocks a warp spills (int4_mma.ROW_LAUNCH: measured faster all the same); a little
        spilt = dict(defines)["NT"] == 8 and dict(defines)["F"] == 2
        assert cubin.spills <= (512 if spilt else 0) and 0 < cubin.registers <= 255, (dict(defines), cubin.spills)


def test_a_windowed_build_differs_from_the_products_only_where_it_finds_the_codes() -> None:
    """WINDOW (benchmarks: the codes of a block modulo the window, from L2) compiles at the shipped launches with the
    product's registers; undefined, the source builds the product itself."""
    for nout, ncols in SHAPES:
        defines = _defines(launch(choose(nout, ncols, 128, SMS), 1), 1)
        product = compile_cubin(SOURCE, "int4_mma", "sm_90", defines)
        windowed = compile_cubin(SOURCE, "int4_mma", "sm_90", (*defines, ("WINDOW", 16)))
        assert windowed.image != product.image and windowed.spills == 0
        assert abs(windowed.registers - product.registers) <= 8, (nout, ncols)
        assert compile_cubin(SOURCE, "int4_mma", "sm_90", (*defines, ("WINDOW", 0))).image == product.image


def test_64_rows_split_over_blocks_of_threads_compile_without_spills() -> None:
    """RG 2 or 4 blocks of threads a feature block's rows: each holds NT / RG row tiles' sums, which at 64 rows leaves
    the registers that one block holding all eight spills (the test above allows it that)."""
    for nout, ncols in ((34816, 5120), (5120, 17408), (10240, 5120)):
        base = launch(choose(nout, ncols, 128, SMS), 8)
        assert base.f == 2
        for rg in (2, 4):
            for f in (1, 2):
                cubin = compile_cubin(SOURCE, "int4_mma", "sm_90", _defines(replace(base, rg=rg, f=f), 8))
                assert cubin.spills == 0 and cubin.registers < 255, (nout, rg, f, cubin.registers)


def test_the_swiglu_store_compiles_without_spills_where_its_launch_fits() -> None:
    """SWIGLU=1 (a gate | up weight's product with silu(gate) * up in its store): one gate block and its up partner a
    warp, for every row count and the 27B's and the built-in model's gate | up shapes; spills only where F 2 at NT 8
    spills without it."""
    from ignis.kernels.int4_mma import swiglu_launch

    for nout, ncols in ((34816, 5120), (2048, 384), (1024, 17408)):
        base = choose(nout, ncols, 128, SMS)
        for nt in (1, 2, 4, 8):
            s = swiglu_launch(launch(base, nt), nt)
            if s is None:  # the KW warps' sums of both blocks past shared memory: the caller keeps two launches
                assert (base.kw - 1) * 2 * nt // launch(base, nt).rg * 512 > SHARED
                continue
            cubin = compile_cubin(SOURCE, "int4_mma", "sm_90", (*_defines(s, nt), ("SWIGLU", 1)))
            spilt = nt // s.rg == 8
            assert cubin.spills <= (512 if spilt else 0) and 0 < cubin.registers <= 255, (nout, nt, cubin.spills)


def test_launched_ahead_the_kernel_loads_its_codes_before_the_wait_and_x_after() -> None:
    """PDL=1 (ignis.kernels.launch.PDL): in program order the AHEAD steps of codes load (none where AHEAD is 0),
    then griddepcontrol.wait, then x and the stores; the variant compiles without spills like the default one."""
    for s, nt in ((launch(choose(5120, 17408, 128, SMS), 1), 1), (launch(choose(34816, 5120, 128, SMS), 2), 2)):
        plain = compile_cubin(SOURCE, "int4_mma", "sm_90", _defines(s, nt))
        early = compile_cubin(SOURCE, "int4_mma", "sm_90", (*_defines(s, nt), ("PDL", 1)))
        assert early.spills == plain.spills == 0 and early.registers <= 255
        ptx = _ptx_of((*_defines(s, nt), ("PDL", 1)))
        wait = ptx.index("griddepcontrol.wait")
        assert ("ld.global.nc.L1::no_allocate.v4.u32" in ptx[:wait]) == (s.ahead > 0), s  # the codes ahead of it
        assert "ld.global.nc.v4.u32" not in ptx[:wait] and "st.global" not in ptx[:wait]  # x and the stores after it
        assert "griddepcontrol.launch_dependents" in ptx[wait:]
        assert "griddepcontrol" not in _ptx_of(_defines(s, nt))
        # TRIGGER=1 (launch.EARLY_TRIGGER): the next kernel may launch before the wait, the codes ahead already issued
        ptx = _ptx_of((*_defines(s, nt), ("PDL", 1), ("TRIGGER", 1)))
        trigger, wait = ptx.index("griddepcontrol.launch_dependents"), ptx.index("griddepcontrol.wait")
        assert trigger < wait and ("ld.global.nc.L1::no_allocate.v4.u32" in ptx[:trigger]) == (s.ahead > 0), s


def _ptx_of(defines: tuple[tuple[str, int], ...]) -> str:
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(SOURCE.encode(), b"int4_mma.cu", 0, [], [])
    assert int(err) == 0
    options = [b"--gpu-architecture=compute_90", b"--std=c++17"] + [f"-D{m}={v}".encode() for m, v in defines]
    assert int(nvrtc.nvrtcCompileProgram(prog, len(options), options)[0]) == 0
    _, size = nvrtc.nvrtcGetPTXSize(prog)
    buf = b" " * size
    nvrtc.nvrtcGetPTX(prog, buf)
    nvrtc.nvrtcDestroyProgram(prog)
    return buf.decode()


def test_a_source_nvrtc_refuses_names_its_error() -> None:
    with pytest.raises(CompileError, match="int4_mma"):
        compile_cubin(SOURCE, "int4_mma", "sm_90", (("NT", 1),))  # the other macros missing


def test_a_repacked_quantlinear_fuses_into_views_and_runs_the_reference_off_the_gpu() -> None:
    parts = []
    for nout in (64, 32):
        q = QuantLinear(256, nout, 128)
        q.qweight, q.scales, q.qzeros = _weight(nout, 256, 128, seed=nout)
        parts.append(q)
    dense = torch.cat([q.weight.dequantize().float() for q in parts])  # type: ignore[union-attr]
    assert all(q.repack(torch.bfloat16) for q in parts)
    assert all("qweight" not in dict(q.named_buffers()) and "codes" in dict(q.named_buffers()) for q in parts)
    joined = fuse_packed(tuple(parts))
    assert isinstance(joined, MmaCodes) and joined.shape == (96, 256)
    assert parts[1].codes.untyped_storage().data_ptr() == joined.codes.untyped_storage().data_ptr()
    x = torch.randn(3, 256).bfloat16()
    assert torch.equal(joined.dequantize().float(), dequantize(*unpack(joined), torch.float32).bfloat16().float())
    assert torch.equal(packed_linear(x, joined), torch.nn.functional.linear(x, joined.dequantize()))
    torch.testing.assert_close(joined.dequantize().float(), dense, rtol=2**-8, atol=0.0)  # one bf16 rounding apart
    odd = QuantLinear(256, 24, 128)
    assert not odd.repack(torch.bfloat16) and odd.mma is None  # 24 rows: not whole 16-row blocks, kept as it is
    assert repacked(torch.nn.Sequential(odd, parts[0])) and not repacked(torch.nn.Sequential(odd))


def test_pdl_is_the_rounds_choice_unless_switched(monkeypatch: pytest.MonkeyPatch) -> None:
    """kernel_launch.PDL None leaves programmatic dependent launch to the round (`dependent_launches`); True or False holds
    whatever the round asks; never off a Hopper-or-later GPU."""
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(kernel_launch, "PDL", None)
    assert not kernel_launch.pdl(gpu)
    with kernel_launch.dependent_launches(True):
        assert kernel_launch.pdl(gpu) and not kernel_launch.pdl(torch.device("cpu"))
        with kernel_launch.dependent_launches(False):
            assert not kernel_launch.pdl(gpu)
        assert kernel_launch.pdl(gpu)
    assert not kernel_launch.pdl(gpu)
    monkeypatch.setattr(kernel_launch, "PDL", False)
    with kernel_launch.dependent_launches(True):
        assert not kernel_launch.pdl(gpu)
    monkeypatch.setattr(kernel_launch, "PDL", True)
    assert kernel_launch.pdl(gpu)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert not kernel_launch.pdl(gpu)
