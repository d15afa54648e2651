"""The arms of tools.bench_quant's decode-step A/Bs: what each switch sets on the engine's modules for one arm and puts
back after, and the "name:n:...,..." specs that name the products and launches an arm takes (--ring-ab, --splits,
--candidate's arm, --gdn-pdl-ab, and the single switches through `ab`). `step` is
tools.bench_quant.decode_step on one model: every arm times the same weights."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from ignis.kernels import int4_mma as mma_kernel
from ignis.kernels import launch

from tools.quant_launch import Candidate
from tools.quant_products import product_shape


def ab(step: Callable[..., dict[str, Any]], key: str, module: Any, switch: str | tuple[str, ...],
       values: tuple[Any, ...], what: str, names: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The int4-head decode step once with each of `values` set on module.`switch` (the same model; with a tuple of
    switches, each value a tuple of theirs), the switches put back after: {f"{key}_{name}": the step's figures}, a
    value's name its `names` entry or the value itself (a name met again gets "_again", then "_again2", ...)."""
    switches = (switch,) if isinstance(switch, str) else switch
    kept = tuple(getattr(module, name) for name in switches)
    out: dict[str, Any] = {}
    labels = names or tuple(str(v) for v in values)
    try:
        for v, label in zip(values, labels):
            for name, value, old in zip(switches, (v,) if isinstance(switch, str) else v, kept):
                setattr(module, name, type(old)(value))
            met = labels[:len(out)].count(label)
            out[f"{key}_{label}" + ("" if not met else "_again" if met == 1 else f"_again{met}")] = step(
                f"int4 head, {what} {label}")
    finally:
        for name, old in zip(switches, kept):
            setattr(module, name, old)
    print(f"{what}: " + ", ".join(f"{label}: {r['graph_ms']:.3f} ms (replay {r['replay_ms']:.3f})"
                                   for label, r in zip(labels, out.values())), flush=True)
    return out


Launches = tuple[dict[tuple[int, int], tuple[int, int, bool]], dict[tuple[int, int], tuple[int, int]]]


def _items(spec: str, flag: str, form: str, counts: tuple[int, ...]) -> Iterator[tuple[tuple[int, int], list[int]]]:
    """A "name:n:n...,..." option's items as (the named one of SHAPES' [out, in], its numbers), each item `counts`
    numbers long, or ValueError naming the option."""
    for item in filter(None, spec.split(",")):
        name, *numbers = item.split(":")
        if len(numbers) not in counts:
            raise ValueError(f"{flag} takes {form} items, got {item!r}")
        yield product_shape(name, flag), [int(n) for n in numbers]


def ring_launches(spec: str) -> Launches:
    """--ring-ab's "name:U:AHEAD:XRING[:KS:KW],..." (a name: the start of one of SHAPES', as "o_proj" or "mlp down")
    as int4_mma.RING_LAUNCHES and int4_mma.SPLITS (the items that name a split)."""
    rings, split_of = {}, {}
    for shape, (u, ahead, xring, *split) in _items(spec, "--ring-ab", "name:U:AHEAD:XRING[:KS:KW]", (3, 5)):
        rings[shape] = (u, ahead, bool(xring))
        if split:
            split_of[shape] = (split[0], split[1])
    return rings, split_of


def ring_ab(step: Callable[..., dict[str, Any]], spec: str) -> dict[str, Any]:
    """The int4-head decode step with `spec`'s products (ring_launches) on the plain loop and choose's split ("off"),
    then on the ring launches and splits `spec` names ("on"), off, on, off, on, on one model; every other product as
    int4_mma.RING_LAUNCHES and SPLITS hold it."""
    rings, split_of = ring_launches(spec)
    kept_rings, kept_splits = mma_kernel.RING_LAUNCHES, mma_kernel.SPLITS
    off = ({k: v for k, v in kept_rings.items() if k not in rings},
           {k: v for k, v in kept_splits.items() if k not in rings})
    on = ({**off[0], **rings}, {**off[1], **split_of})
    return ab(step, "int4_head_ring", mma_kernel, ("RING_LAUNCHES", "SPLITS"), (off, on) * 2, f"ring {spec}",
              ("off", "on") * 2)


def candidate_ab(step: Callable[..., dict[str, Any]], name: str, candidate: Candidate) -> dict[str, Any]:
    """The int4-head decode step with the product `name` as shipped and with `candidate`'s launch
    (`Candidate.launches`), twice, on one model: {"int4_head_candidate_<arm>[_again]": the step's figures}."""
    shipped = (mma_kernel.RING_LAUNCHES, mma_kernel.SPLITS)
    return ab(step, "int4_head_candidate", mma_kernel, ("RING_LAUNCHES", "SPLITS"),
              (shipped, candidate.launches(product_shape(name))) * 2, f"candidate {name} {candidate}",
              ("shipped", "candidate") * 2)


def splits(spec: str) -> dict[tuple[int, int], tuple[int, int]]:
    """--splits' "name:KS:KW,..." as int4_mma.SPLITS."""
    return {shape: (ks, kw) for shape, (ks, kw) in _items(spec, "--splits", "name:KS:KW", (2,))}


# --gdn-pdl-ab's arms: (launch.GDN_PDL, gdn.CUDA_NORMED), None as shipped (the round decides); the first again last
GDN_PDL_ARMS: tuple[tuple[bool | None, bool | None], ...] = (
    (False, False), (None, False), (None, None), (False, False))


def gdn_pdl_ab(step: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    """The int4-head decode step with the Gated DeltaNet's CUDA C++ conv and recurrence launched programmatic-dependent
    and not (launch.GDN_PDL), and with the recurrence applying the gated norm itself (gdn.CUDA_NORMED), the same
    model; the switches put back after: {"gdn_pdl_<i>": the step's figures with its arm}."""
    from ignis.kernels import gdn

    kept, out = (launch.GDN_PDL, gdn.CUDA_NORMED), {}
    try:
        for i, (early, normed) in enumerate(GDN_PDL_ARMS):
            launch.GDN_PDL, gdn.CUDA_NORMED = early, normed
            out[f"gdn_pdl_{i}"] = {**step(f"int4 head, gdn pdl {early} normed {normed}"),
                                   "gdn_pdl": early, "normed": normed}
    finally:
        launch.GDN_PDL, gdn.CUDA_NORMED = kept
    print("gdn pdl, normed: " + ", ".join(f"{r['gdn_pdl']} {r['normed']}: {r['graph_ms']:.3f} ms (replay "
                                          f"{r['replay_ms']:.3f})" for r in out.values()), flush=True)
    return out
