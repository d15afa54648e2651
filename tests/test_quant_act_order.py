"""Act-order 4-bit checkpoints (GPTQ with desc_act, compressed-tensors with actorder "group"): each input column is in
the group its stored g_idx names. They load with the columns held in group order, and every packed linear stands for
the checkpoint's own arithmetic, column c as (q[c] - z[g_idx[c]]) * s[g_idx[c]]: the loaded weights equal it, the
model equals one whose linears hold it densely, and the product through the held order equals it term for term."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from test_quant_published import _compressed_config, _gptq, _logits, packed_linears
from tiny import tiny_checkpoint

from ignis.cli import main
from ignis.errors import ArtifactError
from ignis.model.loader import load_model
from ignis.model.ops import linear
from ignis.quant.linear import Permuted, QuantLinear, fuse_packed, packed_linear

GROUP = 64


@pytest.fixture(scope="module")
def int4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("act_order")
    # every packed linear at least two groups wide, so that each has columns to scatter between groups
    src = tiny_checkpoint(root / "src", seed=11, mtp=True, hidden_size=128, intermediate_size=256,
                          linear_value_head_dim=32)
    assert main(["quantize", str(src), str(root / "int4"), "--group", str(GROUP)]) == 0
    return root / "int4"


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118


def _order_for(stem: str, cols: int, orders: dict[tuple[str, int], torch.Tensor]) -> torch.Tensor:
    """One random column order per module and input width: the projections that read the same input (q, k and v;
    gate and up) share it, as GPTQ's act-order gives them (the same activations order their columns)."""
    key = (stem.rsplit(".", 1)[0], cols)
    if key not in orders:
        orders[key] = torch.randperm(cols, generator=torch.Generator().manual_seed(len(orders) + 1))
    return orders[key]


def _act_order(src: Path, dst: Path, layout: str) -> dict[str, torch.Tensor]:
    """`src` (ignis-int4) rewritten as an act-order checkpoint at `dst`: each packed linear's columns scattered so that
    column order[j] holds the ignis column j, in group j // GROUP (g_idx[order[j]] = j // GROUP). Returns, by module
    path, the weight [out, in] that checkpoint stands for, dequantized by its g_idx."""
    shutil.copytree(src, dst)
    config = json.loads((src / "config.json").read_text())
    if layout == "gptq":
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True,
                                         "sym": False, "checkpoint_format": "gptq"}
    else:
        del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    if layout == "ct":
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

        # compressed-tensors 0.20 no longer writes actorder "group" (its checkpoints from earlier releases hold it, and
        # vLLM reads them): its writer's config with that one field as the earlier releases set it
        _compressed_config(dst, GROUP, symmetric=False)
        written = json.loads((dst / "config.json").read_text())
        written["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = "group"
        (dst / "config.json").write_text(json.dumps(written))
    out, linears = packed_linears(src / "model.safetensors")
    expected: dict[str, torch.Tensor] = {}
    orders: dict[tuple[str, int], torch.Tensor] = {}
    for stem, (codes, scales, zeros) in linears.items():
        order = _order_for(stem, codes.shape[1], orders)
        scattered = torch.empty_like(codes)
        scattered[:, order] = codes
        g_idx = torch.empty(codes.shape[1], dtype=torch.int32)
        g_idx[order] = (torch.arange(codes.shape[1]) // GROUP).to(torch.int32)
        g = g_idx.long()
        expected[stem.removeprefix("model.")] = (scattered.float() - zeros.float()[:, g]) * scales.float()[:, g]
        if layout == "gptq":
            packed = _gptq(scattered, scales, zeros, GROUP, v2=False) | {"g_idx": g_idx}
        else:  # compressed-tensors' own packing of the signed codes and zero points (along the output), g_idx beside
            packed = {"weight_packed": pack_to_int32((scattered.to(torch.int16) - 8).to(torch.int8), 4),
                      "weight_scale": scales,
                      "weight_zero_point": pack_to_int32((zeros.to(torch.int16) - 8).to(torch.int8), 4, packed_dim=0),
                      "weight_shape": torch.tensor(list(codes.shape)), "weight_g_idx": g_idx}
        out |= {f"{stem}.{k}": v for k, v in packed.items()}
    (dst / "model.safetensors").unlink()
    (dst / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(out, str(dst / "model.safetensors"))
    return expected


def _dense(src: Path, dst: Path, weights: dict[str, torch.Tensor]) -> None:
    """`src` with every packed linear stored densely as `weights` holds it, and no quantization_config."""
    shutil.copytree(src, dst)
    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    out, _ = packed_linears(src / "model.safetensors")
    for path, w in weights.items():
        out[f"{path if path.startswith('mtp.') else 'model.' + path}.weight"] = w
    (dst / "model.safetensors").unlink()
    (dst / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(out, str(dst / "model.safetensors"))


@pytest.mark.parametrize("layout", ["gptq", "ct"])
def test_an_act_order_checkpoint_is_the_model_its_g_idx_describes(int4: Path, tmp_path: Path, layout: str) -> None:
    expected = _act_order(int4, tmp_path / layout, layout)
    model = load_model(tmp_path / layout, device="cpu", dtype=torch.float32, exact=True)
    packed = {path: m for path, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert packed and {p.removeprefix("model.") for p in packed} == set(expected)
    for path, m in packed.items():
        assert m.order is not None and isinstance(m.weight, Permuted), path
        assert torch.equal(m.weight.dequantize(), expected[path.removeprefix("model.")]), path
    _dense(int4, tmp_path / "dense", expected)
    dense = load_model(tmp_path / "dense", device="cpu", dtype=torch.float32, exact=True)
    assert torch.equal(_logits(model), _logits(dense))


def test_the_product_takes_x_in_the_held_order(int4: Path, tmp_path: Path) -> None:
    """Outside exact mode a Permuted weight's product gathers x's columns into the held order and multiplies the held
    codes: the checkpoint's x @ W^T with its terms summed in the held order, and nothing else."""
    expected = _act_order(int4, tmp_path / "gptq", "gptq")
    model = load_model(tmp_path / "gptq", device="cpu", dtype=torch.float32, exact=True)
    x = torch.randn(3, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for path, m in model.named_modules():
        if not isinstance(m, QuantLinear) or m.in_features != x.shape[-1]:
            continue
        w = m.weight
        assert isinstance(w, Permuted)
        held = w.weight.dequantize()
        assert torch.equal(held, expected[path.removeprefix("model.")][:, w.order.long()]), path
        got = linear(x, w, False)
        assert torch.equal(got, packed_linear(x, w))
        assert torch.equal(got, F.linear(x[..., w.order.long()], held)), path
        assert not torch.equal(w.order.long(), torch.arange(x.shape[-1]))


def test_linears_fuse_only_where_their_columns_are_held_in_one_order(int4: Path, tmp_path: Path) -> None:
    _act_order(int4, tmp_path / "gptq", "gptq")
    model = load_model(tmp_path / "gptq", device="cpu", dtype=torch.float32, exact=True)
    attn = next(m for m in model.modules() if isinstance(getattr(m, "q_proj", None), QuantLinear))
    q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
    fused = fuse_packed((q, k, v))
    assert isinstance(fused, Permuted) and fused.shape[0] == q.out_features + k.out_features + v.out_features
    assert torch.equal(fused.dequantize(), torch.cat([m.weight.dequantize() for m in (q, k, v)]))
    other = QuantLinear(q.in_features, 16, GROUP)
    other.order = torch.flip(q.order, (0,))
    assert fuse_packed((q, other)) is None
    plain = QuantLinear(q.in_features, 16, GROUP)
    assert fuse_packed((q, plain)) is None
    # the served form fuses them
    served = load_model(tmp_path / "gptq", device="cpu", dtype=torch.float32, exact=False)
    assert any(isinstance(getattr(m, "qkv_proj", None), Permuted) for m in served.modules())


def test_the_plan_counts_the_held_orders(int4: Path, tmp_path: Path) -> None:
    from ignis.config import load_config
    from ignis.plan import memory_plan

    _act_order(int4, tmp_path / "gptq", "gptq")
    model = load_model(tmp_path / "gptq", device="cpu", dtype=torch.float32, exact=True)
    held = sum(t.nbytes for t in model.state_dict().values())
    held += sum(m.order.nbytes for m in model.modules() if isinstance(m, QuantLinear) and m.order is not None)
    plan = memory_plan(load_config(profile="cpu"), tmp_path / "gptq")
    assert {i.name: i.nbytes for i in plan.items}["weights"] == held
    assert "act-order" in plan.weights


def test_a_g_idx_that_does_not_fill_its_groups_is_refused(int4: Path, tmp_path: Path) -> None:
    _act_order(int4, tmp_path / "gptq", "gptq")
    tensors = _tensors(tmp_path / "gptq" / "model.safetensors")
    name = next(n for n in tensors if n.endswith(".g_idx"))
    bad = tensors[name].clone()
    bad[bad == 1] = 0  # group 0 twice its size, group 1 empty
    save_file(tensors | {name: bad}, str(tmp_path / "gptq" / "model.safetensors"))
    with pytest.raises(ArtifactError, match=r"g_idx gives group \d+ \d+ columns"):
        load_model(tmp_path / "gptq", device="cpu", dtype=torch.float32, exact=True)


@pytest.mark.parametrize("repacked", [False, True], ids=["format", "mma order"])
def test_reorder_holds_the_same_weight_with_its_columns_moved_within_groups(repacked: bool) -> None:
    """QuantLinear.reorder (what tools.bench_quant --act-order-ab times): the weight it stands for is unchanged, the
    held codes are the old ones' columns in the new order, and an order that moves a column to another group is
    refused."""
    from ignis.quant.format import quantize

    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(1))
    q = QuantLinear(256, 32, GROUP)
    q.qweight, q.scales, q.qzeros = quantize(w, GROUP)
    if repacked:
        assert q.repack(torch.bfloat16)
    before = q.weight.dequantize()
    within = torch.argsort(torch.rand(256 // GROUP, GROUP, generator=torch.Generator().manual_seed(2)), dim=1)
    order = (within + torch.arange(0, 256, GROUP)[:, None]).reshape(-1).to(torch.int32)
    q.reorder(order)
    assert isinstance(q.weight, Permuted) and torch.equal(q.weight.dequantize(), before)
    assert torch.equal(q.weight.weight.dequantize(), before[:, order.long()])
    with pytest.raises(ValueError, match="once"):
        q.reorder(order)
    other = QuantLinear(256, 32, GROUP)
    with pytest.raises(ValueError, match="in its group"):
        other.reorder(torch.arange(255, -1, -1, dtype=torch.int32))
