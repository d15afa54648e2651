"""The fused-layer kernels (the residual add with the norm, SwiGLU, q/k norms with RoPE and the K/V write, the short
conv), the paged attention, the streamed dense products and the round's settle on a real GPU against their references
at the 27B shapes, under graph replay, and the MLP chain launched programmatic-dependent. The top-k kernel is in tests/test_topk_gpu.py,
the Gated DeltaNet's in tests/test_gdn_gpu.py, the quantized products in tests/test_quant_gpu.py. Needs CUDA; CI has
none."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_calls import counted as _counted

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)


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

    out["attn"] = attend(x["o"], x["akc"], x["avc"], x["atable"], x["lanes"], x["apos"], 2000,
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


@pytest.mark.parametrize("t", [1, 8, 64])
def test_the_mtp_layers_norm_pair_at_the_27b_width(t: int) -> None:
    """fused.rms_norm_pair (the MTP layer's two input norms side by side, one Triton launch) against the reference, bf16
    rows of 5,120; a row's result does not depend on the call's other rows; the first half read from rows of a table
    (the embedding's lookup in the launch) equals the pair of the gathered rows."""
    from ignis.kernels import fused
    from tests.test_kernels_fused import close

    g = torch.Generator(device="cuda").manual_seed(t)
    a = (torch.randn(t, 5120, device="cuda", generator=g) * 3).bfloat16()
    b = torch.randn(t, 5120, device="cuda", generator=g).bfloat16()
    sa, sb = (torch.rand(5120, device="cuda", generator=g) + 0.5 for _ in range(2))
    with torch.inference_mode():
        got = fused.rms_norm_pair(a, b, sa, sb, 1e-6)
        last = fused.rms_norm_pair(a[-1:], b[-1:], sa, sb, 1e-6)
    close(got, fused.rms_norm_pair_reference(a, b, sa, sb, 1e-6), "pair")
    assert torch.equal(last[0], got[-1])
    table = (torch.randn(1000, 5120, device="cuda", generator=g) * 3).bfloat16()
    ids = torch.randint(0, 1000, (t,), device="cuda", generator=g)
    with torch.inference_mode():
        looked_up = fused.rms_norm_pair(table, b, sa, sb, 1e-6, ids=ids)
        gathered = fused.rms_norm_pair(table[ids], b, sa, sb, 1e-6)
    assert torch.equal(looked_up, gathered)


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("k", [0, 3, 7])
def test_the_round_settles_in_one_launch_as_the_torch_ops_do(k: int, sampled: bool) -> None:
    """ignis.kernels.settle_triton against device_sampling.settle_reference on CUDA tensors, 8 lanes keeping none to
    all of their drafts, eagerly and replayed from a CUDA graph (which `device_sampling.settle` is in every round)."""
    from ignis.engine import device_sampling
    from ignis.kernels import settle_triton
    from tests.settle_rounds import round_of

    cpu = round_of(8, k, seed=k * 2 + sampled, sampled=sampled)
    drafts, argmax, allowed, *rest = (t.cuda() for t in cpu)
    extra = tuple(rest) if sampled else None
    want_back = torch.empty(8, k + 2, dtype=torch.int64, device="cuda")
    want = device_sampling.settle_reference(drafts, argmax, allowed, want_back, extra)
    back = torch.full((8, k + 2), -1, dtype=torch.int64, device="cuda")
    with torch.inference_mode():
        settle_triton.settle(drafts, argmax, allowed, back, extra)  # compile before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = device_sampling.settle(drafts, argmax, allowed, back, extra)
        back.fill_(-1)
        graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)) and torch.equal(back, want_back)


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
    return {"q": r(b, nkv, nh // nkv * c, hd), "kc": kc, "vc": vc, "table": table, "lanes": lanes,
            "positions": positions, "span": span, "scale": hd**-0.5,
            "qkv": r(b * c, (2 * nh + 2 * nkv) * hd, s=2.0), "nh": nh}


def _paged_attention(x: dict, path: str) -> torch.Tensor:
    from ignis.kernels import attention

    attention.use(path)  # type: ignore[arg-type]
    try:
        return attention.attend(x["q"], x["kc"], x["vc"], x["table"], x["lanes"], x["positions"], x["span"],
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
