"""The fused layer kernels (ignis.kernels.fused) against their torch references, in bf16 and fp32.

The kernel sources run in numba's CUDA simulator in a child interpreter (NUMBA_ENABLE_CUDASIM must be set before
numba.cuda is imported, and the rest of the suite keeps the real numba.cuda). bf16 tensors go in as int16 bits, as on
the GPU; the simulator has no libdevice, so the child gives it the two bit casts the kernels use, and warp
shuffles through the warp shim of tests/test_kernels_sim.py. bf16 results must
equal the reference's bits except where a reduction's order moves an fp32 sum by an ulp before a rounding; they are
compared within one bf16 step, fp32 within 1e-5. The GPU run of the same comparisons is in tests/test_kernels_gpu.py.
"""

from __future__ import annotations

import pytest
import simulator
import torch
import torch.nn.functional as F
from ignis.kernels import fused
from ignis.kernels.attention import attend_reference, splits, visibility


def paged(caches: list[torch.Tensor], page: int, g: torch.Generator, held: dict[int, int] | None = None,
          ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per-lane caches [L, S, nkv, hd] (K and V) as pages of `page` positions in one shuffled order: (pages
    [1 + L * n, page, nkv, hd] each, table [L, n] int64). The null page 0 holds large garbage, so a read of it shows;
    held[l] = n' leaves lane l's entries past its first n' pages on the null page."""
    lanes, slots = caches[0].shape[:2]
    n = -(-slots // page)
    table = (torch.randperm(lanes * n, generator=g) + 1).view(lanes, n)
    stores = []
    for cont in caches:
        padded = F.pad(cont, (0, 0, 0, 0, 0, n * page - slots))
        store = (torch.randn(1 + lanes * n, page, *cont.shape[2:], generator=g) * 100).to(cont.dtype)
        store[table.reshape(-1)] = padded.reshape(lanes * n, page, *cont.shape[2:])
        stores.append(store)
    for lane, keep in (held or {}).items():
        table[lane, keep:] = 0
    return stores, table


def inputs(dtype: torch.dtype, seed: int) -> dict[str, object]:
    """Tiny shapes with the real structure: 3 lanes of 5 (not in order), 2 columns, Kc = 4, 2 KV heads of 3 query
    heads, head width 16 with a rotary part of 8, GDN heads of 8 (odd numbers where a kernel must not assume). The K/V
    caches are pages in shuffled order (pages of 4 positions for the write, of 6 for attention, so its 32-key tiles
    straddle pages), lane 0 holding only the pages its positions need."""
    g = torch.Generator().manual_seed(seed)
    b, c, lanes, nh, nkv, hd, rd, hv, dv, dim = 3, 2, 5, 6, 2, 16, 8, 3, 8, 40
    t = b * c

    def r(*shape: int, s: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * s).to(dtype)

    angles = torch.rand(t, rd // 2, generator=g) * 6
    (kc, vc), table = paged([r(lanes, 12, nkv, hd), r(lanes, 12, nkv, hd)], 4, g, {0: 1})
    akc_lanes, avc_lanes = r(lanes, 70, nkv, hd), r(lanes, 70, nkv, hd)
    (akc, avc), atable = paged([akc_lanes, avc_lanes], 6, g, {0: 1})
    return {
        "x": r(t, 300), "d": r(t, 300), "scale": torch.rand(300, generator=g) + 0.5,
        "window": r(lanes, 3, dim), "lanes": torch.tensor([3, 0, 4]), "raw": r(b, c, dim),
        "raw7": r(b, 7, dim), "ba7": r(b, 7, 2 * hv, s=2.0),  # a prefill's columns, over several blocks
        "weight": torch.randn(dim, 4, generator=g), "ba": r(b, c, 2 * hv, s=2.0),
        "record": r(lanes, c, dim), "out": torch.randn(t, hv, dv, generator=g), "z": r(t, hv * dv, s=2.0),
        "gweight": r(dv), "gu": r(t, 2 * 37, s=3.0),
        "qkv": r(t, (2 * nh + 2 * nkv) * hd, s=2.0), "qscale": torch.rand(hd, generator=g) + 0.5,
        "kscale": torch.rand(hd, generator=g) + 0.5,
        "cos": torch.cat([angles.cos(), angles.cos()], -1).to(dtype),
        "sin": torch.cat([angles.sin(), angles.sin()], -1).to(dtype),
        "kc": kc, "vc": vc, "table": table,
        "positions": torch.tensor([[4, 5], [0, 1], [9, 10]]), "o": r(b, nkv, nh // nkv * c, hd),
        "nh": nh, "nkv": nkv, "hk": 1, "dk": 8,  # conv channels: q (8) | k (8) | v (24)
        # attention over 70 key slots (three tiles of 32), "o" as the queries
        "akc": akc, "avc": avc, "atable": atable, "apos": torch.tensor([[40, 41], [0, 1], [66, 67]]),
        "akc_lanes": akc_lanes, "avc_lanes": avc_lanes,
        "cx": r(2, 5, 12), "cbase": r(4, 12), "cdyn": r(2, 5, 2, 4, 4, s=0.5)[:, :, 1],  # 2 blocks of 5 rows, 4 taps
    }


def references(x: dict, eps: float = 1e-6, group: int = 3) -> dict[str, torch.Tensor]:
    """Every reference's outputs (and the state it writes) on copies of x."""
    out: dict[str, torch.Tensor] = {}
    out["resid"], out["normed"] = fused.add_rms_norm_reference(x["x"], x["d"], x["scale"], eps)
    _, out["normed0"] = fused.add_rms_norm_reference(x["x"], None, x["scale"], eps)
    window = x["window"].clone()
    out["mixed"], out["ba_f"] = fused.conv_reference(window, x["lanes"], x["raw"], x["weight"], x["ba"], None,
                                                            x["hk"], x["dk"])
    out["window"] = window
    record = x["record"].clone()
    out["mixed_r"], _ = fused.conv_reference(x["window"].clone(), x["lanes"], x["raw"], x["weight"], x["ba"], record,
                                             x["hk"], x["dk"])
    out["record"] = record
    window = x["window"].clone()
    out["mixed7"], out["ba7_f"] = fused.conv_reference(window, x["lanes"], x["raw7"], x["weight"], x["ba7"], None,
                                                       x["hk"], x["dk"])
    out["window7"] = window
    out["y"] = fused.gated_norm_reference(x["out"], x["z"], x["gweight"], eps)
    out["swiglu"] = fused.swiglu_reference(x["gu"])
    kc, vc = x["kc"].clone(), x["vc"].clone()
    out["qh"] = fused.qk_rope_write_reference(x["qkv"], x["qscale"], x["kscale"], eps, x["cos"], x["sin"], kc, vc,
                                              x["table"], x["lanes"], x["positions"], x["nh"], x["nkv"])
    out["kc"], out["vc"] = kc, vc
    lanes_kc = x["akc_lanes"]  # [lanes, span, nkv, hd]: the same keys as a per-lane cache
    mask = visibility(x["apos"], lanes_kc.shape[1], x["o"].shape[2])
    out["attn"] = attend_reference(x["o"], x["akc"], x["avc"], x["atable"], x["lanes"], mask,
                                   x["o"].shape[-1] ** -0.5, x["qkv"], x["nh"])
    identity = torch.arange(lanes_kc.shape[0], device=lanes_kc.device)[:, None]  # one page of `span` slots a lane
    out["attn_lanes"] = attend_reference(x["o"], x["akc_lanes"], x["avc_lanes"], identity, x["lanes"], mask,
                                         x["o"].shape[-1] ** -0.5, x["qkv"], x["nh"])
    out["gconv"] = fused.grouped_conv_reference(x["cx"], x["cbase"], x["cdyn"], group)
    out["gconv3"] = fused.grouped_conv_reference(x["cx"][:, :3], x["cbase"], x["cdyn"][:, :3], group)  # rows < taps
    return out


def close(got: torch.Tensor, want: torch.Tensor, what: str, bits: float = 0.97) -> None:
    """Equal within one bf16 step (fp32: 1e-5), and at least `bits` of bf16 results bit-equal (attention's reference
    rounds its own intermediates, so it is held to the step alone)."""
    if want.dtype == torch.bfloat16:
        # one bf16 step: 2^-7 relative, and an absolute floor for values a rounding moved across a small magnitude
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-2, msg=what)
        frac = float((got.view(torch.int16) == want.view(torch.int16)).float().mean())
        assert frac >= bits, f"{what}: only {frac:.3f} of the bf16 results are bit-equal to the reference"
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=what)


CHILD = r"""
import sys
import numpy as np, torch
from numba.cuda import libdevice
from tests.test_kernels_sim import _install_warp_shim
_install_warp_shim()  # block sums are warp shuffles
libdevice.int_as_float = lambda i: np.array(int(i) & 0xFFFFFFFF, np.uint32).view(np.float32)[()]
libdevice.float_as_int = lambda f: int(np.array(f, np.float32).view(np.int32))
from ignis.kernels.fused_kernel import EW_THREADS, make_kernels
from tests.test_kernels_fused import close, inputs, references

for dtype in [getattr(torch, name) for name in sys.argv[1:]]:
    x = inputs(dtype, seed=3)
    ref = references(x)
    half = dtype == torch.bfloat16
    K = make_kernels(half, 32, 5, 64)  # per-head blocks of one warp; rows of 300: five elements a thread
    n = lambda t: (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().copy()
    back = lambda a: torch.from_numpy(a).view(dtype) if half and a.dtype == np.int16 else torch.from_numpy(a)
    lanes, pos = x["lanes"].numpy(), x["positions"].numpy()
    t = x["x"].shape[0]
    resid, normed = np.zeros_like(n(x["x"])), np.zeros_like(n(x["x"]))
    K["add_rms_norm"][(t,), 64](n(x["x"]), n(x["d"]), x["scale"].numpy(), resid, normed, 1e-6, True)
    close(back(resid), ref["resid"], "resid"); close(back(normed), ref["normed"], "normed")
    K["add_rms_norm"][(t,), 64](n(x["x"]), n(x["x"]), x["scale"].numpy(), resid, normed, 1e-6, False)
    close(back(normed), ref["normed0"], "normed without an add")
    b, c, dim = x["raw"].shape
    for rec in (False, True):
        window, record = n(x["window"]), n(x["record"])
        mixed = np.zeros((b, c, dim), np.float32)
        ba_f = np.zeros(x["ba"].shape, np.float32)
        K["conv"][(dim // 8, b, 1), 32](window, lanes, n(x["raw"]), x["weight"].numpy(), mixed, record, n(x["ba"]),
                                        ba_f, rec, 8, 2, 8**-0.5, 8)
        close(torch.from_numpy(mixed), ref["mixed_r" if rec else "mixed"], "conv")
        close(torch.from_numpy(ba_f), ref["ba_f"], "ba")
        if rec:
            assert torch.equal(back(record).view(torch.int16 if half else torch.int32),
                               ref["record"].view(torch.int16 if half else torch.int32))
            assert (window == n(x["window"])).all(), "a verify must leave the window alone"
        else:
            assert (back(window).float() == ref["window"].float()).all(), "window after a decode"
    # a verify's columns one a block: every block reads the window, none writes it
    window, record = n(x["window"]), n(x["record"])
    mixed = np.zeros((b, c, dim), np.float32)
    K["conv"][(dim // 8, b, c), 32](window, lanes, n(x["raw"]), x["weight"].numpy(), mixed, record, n(x["ba"]),
                                    np.zeros(x["ba"].shape, np.float32), True, 8, 2, 8**-0.5, 1)
    close(torch.from_numpy(mixed), ref["mixed_r"], "conv, a column a block")
    assert (window == n(x["window"])).all(), "a verify must leave the window alone"
    # seven columns in blocks of three (the first block reads the window and writes it after its reads)
    window = n(x["window"])
    mixed = np.zeros((b, 7, dim), np.float32)
    ba_f = np.zeros(x["ba7"].shape, np.float32)
    unused = n(x["record"])  # the simulator copies each argument back: the window must not be passed twice
    K["conv"][(dim // 8, b, 3), 32](window, lanes, n(x["raw7"]), x["weight"].numpy(), mixed, unused, n(x["ba7"]), ba_f,
                                    False, 8, 2, 8**-0.5, 3)
    close(torch.from_numpy(mixed), ref["mixed7"], "conv over column blocks")
    close(torch.from_numpy(ba_f), ref["ba7_f"], "ba over column blocks")
    assert (back(window).float() == ref["window7"].float()).all(), "window after a prefill piece"
    hv, dv = x["out"].shape[1:]
    y = np.zeros((t, hv * dv), n(x["z"]).dtype)
    K["gated_norm"][(hv, t), 32](x["out"].numpy(), n(x["z"]), n(x["gweight"]), y, 1e-6)
    close(back(y), ref["y"], "gated norm")
    inner = x["gu"].shape[1] // 2
    y = np.zeros((t, inner), n(x["gu"]).dtype)
    K["swiglu"][((inner + EW_THREADS - 1) // EW_THREADS, t), EW_THREADS](n(x["gu"]), y)
    close(back(y), ref["swiglu"], "swiglu")
    kc, vc = n(x["kc"]), n(x["vc"])
    qh = np.zeros(ref["qh"].shape, kc.dtype)
    nh, nkv = x["nh"], x["nkv"]
    K["qk_rope_write"][(nh + 2 * nkv, t), 32](n(x["qkv"]), x["qscale"].numpy(), x["kscale"].numpy(), n(x["cos"]),
                                              n(x["sin"]), kc, vc, x["table"].numpy(), lanes, pos, qh, 1e-6, nh, nkv)
    close(back(qh), ref["qh"], "queries"); close(back(kc), ref["kc"], "K cache"); close(back(vc), ref["vc"], "V cache")
    from ignis.kernels.attention_kernel import make_kernels as attention_kernels
    bq, _, rows, hd = x["o"].shape
    A = attention_kernels(half, rows, hd, 32)
    for ns, per in ((3, 32), (2, 64), (1, 96)):  # one tile a split; two tiles a split (online softmax); one split
        opart = np.zeros((bq, nkv, ns, rows, hd), np.float32)
        mpart = np.zeros((bq, nkv, ns, rows), np.float32)
        lpart = np.zeros_like(mpart)
        A["partial"][(ns, nkv, bq), 32](n(x["o"]), n(x["akc"]), n(x["avc"]), x["atable"].numpy(), lanes,
                                        x["apos"].numpy(), opart, mpart, lpart, hd**-0.5, per)
        y = np.zeros(ref["attn"].shape, kc.dtype)
        A["combine"][(nh, t), 32](opart, mpart, lpart, n(x["qkv"]), y, nh)
        close(back(y), ref["attn"], f"attention in {ns} splits", bits=0.0)
        close(back(y), ref["attn_lanes"], f"attention in {ns} splits against a per-lane cache", bits=0.0)
    for rows, name in ((5, "gconv"), (3, "gconv3")):
        cx = n(x["cx"][:, :rows].contiguous())
        y = np.zeros_like(cx)
        dyn = np.ascontiguousarray(n(x["cdyn"])[:, :rows])  # the simulator moves contiguous arrays only
        K["grouped_conv"][(1, 2 * rows), EW_THREADS](cx, n(x["cbase"]), dyn, y, 3)
        close(back(y), ref[name], name)
    print(dtype, "ok")
"""


def test_kernel_sources_in_simulator_match_references() -> None:
    results = simulator.run_parts(CHILD, [["bfloat16"], ["float32"]], timeout=600)
    failed = simulator.failures(results)
    assert not failed, failed
    assert [r.stdout.split()[-2:] for r in results] == [["torch.bfloat16", "ok"], ["torch.float32", "ok"]]


def test_attention_splits_fill_the_gpu_with_whole_tiles() -> None:
    for span, lanes, kv in ((256, 1, 4), (1024, 1, 4), (1024, 8, 4), (262144, 8, 4), (32, 1, 1), (100, 3, 2)):
        ns, per = splits(span, lanes, kv)
        assert per % 32 == 0 and ns * per >= span > (ns - 1) * per  # whole tiles, every slot in one split
        assert ns == -(-span // 32) or ns * lanes * kv >= 132  # a split a tile, or at least a block an SM


def test_conv_tiles_spread_a_verifys_columns_and_keep_the_window_in_the_first_block() -> None:
    for lanes, cols in ((1, 1), (1, 8), (8, 8), (8, 1), (1, 4), (3, 5), (1, 64), (1, 512), (8, 512)):
        for verify in (False, True):
            tile = fused.conv_tile(lanes, cols, 80, 3, verify)
            # where the window moves, only a lane's first block reads it
            assert (1 if verify else 3) <= tile <= max(3, fused.CONV_TILE)
            longer = [t for t in (2, 4, 8) if t > tile]  # a longer tile is taken whenever it still fills the GPU
            assert all(80 * lanes * -(-cols // t) < fused.CONV_BLOCKS for t in longer), (lanes, cols, tile)
    assert fused.conv_tile(1, 8, 80, 3) == 3 and fused.conv_tile(8, 8, 80, 3) == 4  # as measured (fused.conv_tile)
    assert fused.conv_tile(1, 8, 80, 3, verify=True) == 1 and fused.conv_tile(8, 8, 80, 3, verify=True) == 4
    assert fused.conv_tile(1, 512, 80, 3) == fused.CONV_TILE
    assert fused.conv_tile(1, 8, 80, 5) == 5  # a wider window sets the least


def test_references_are_the_layers_torch_ops() -> None:
    """The references keep the CPU's arithmetic: spot checks against the ops they stand for."""
    x = inputs(torch.float32, seed=4)
    ref = references(x)
    torch.testing.assert_close(ref["resid"], x["x"] + x["d"])
    gate, up = x["gu"].chunk(2, dim=-1)
    torch.testing.assert_close(ref["swiglu"], torch.nn.functional.silu(gate) * up)
    # the K/V writes land at each column's position in its lane's page, nowhere else
    written = (ref["kc"] != x["kc"]).any(-1).any(-1)
    want = torch.zeros_like(written)
    page = x["kc"].shape[1]
    for i, lane in enumerate(x["lanes"].tolist()):
        for p in x["positions"][i].tolist():
            want[x["table"][lane, p // page], p % page] = True
    assert torch.equal(written, want)
    # attention through shuffled pages (lane 0 holding one page, the rest on the null page) is the per-lane cache's
    assert torch.equal(ref["attn"], ref["attn_lanes"])
    # a decode moves the window on by the round's columns
    lane = int(x["lanes"][0])
    torch.testing.assert_close(ref["window"][lane], torch.cat([x["window"][lane], x["raw"][0]])[-3:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dk", [128, 8])
def test_the_cuda_conv_compiles_for_sm90_without_spills(dtype: torch.dtype, dk: int) -> None:
    pytest.importorskip("cuda.bindings")
    from ignis.kernels.conv_cuda import defines
    from ignis.kernels.conv_cuda_kernel import SOURCE
    from ignis.kernels.nvrtc import compile_cubin

    cubin = compile_cubin(SOURCE, "gdn_conv", "sm_90", defines(dtype, dk, 4))
    assert cubin.spills == cubin.stack == 0 and 0 < cubin.registers <= 64, (cubin.registers, cubin.spills, cubin.stack)


def test_the_cuda_conv_compiles_for_an_early_launch_without_spills() -> None:
    # launched programmatic-dependent (launch.gdn_pdl), the conv loads its window and taps before it waits
    pytest.importorskip("cuda.bindings")
    from ignis.kernels.conv_cuda import defines
    from ignis.kernels.conv_cuda_kernel import SOURCE
    from ignis.kernels.nvrtc import compile_cubin

    plain = compile_cubin(SOURCE, "gdn_conv", "sm_90", defines(torch.bfloat16, 128, 4))
    early = compile_cubin(SOURCE, "gdn_conv", "sm_90", defines(torch.bfloat16, 128, 4, early=True))
    assert early.image != plain.image
    assert early.spills == early.stack == 0 and 0 < early.registers <= 64, (early.registers, early.spills)
