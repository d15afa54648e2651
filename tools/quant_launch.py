"""Three measurements of the 4-bit product's launches as the engine makes them, what tools.bench_quant --shape-ab,
--sweep-fixed and --sweep-blocks run:

- `shape_ab`: one 27B product as int4_mma runs it, against the same call without its shape's own entries
  (int4_mma.RING_LAUNCHES and SPLITS, int4_tile.SHAPE_TILES) or against a candidate's (`Candidate`: a ring launch
  and, if it names one, a split), at 1 to 64 rows, alternated twice. A split changes the order of the sums, so the
  two arms' bits may differ; each arm's are its own at every row count (the GPU tests).
- `sweep_fixed`: the time a launch pays whatever its bytes. o_proj's launch over weights of its 5,120 outputs and
  3,072 to 24,576 columns, launched programmatic-dependent and not, and windowed (its codes from L2, so what it pays
  without DRAM's wait), beside a device copy and a bf16 cuBLAS GEMV of the same bytes; a line through each form's
  (floor, time) points, whose intercept is that fixed time and whose slope is how near the copy bandwidth the bytes
  stream.
- `sweep_blocks`: what a 5,120-output product's launch waits on. mlp down's and o_proj's launches (as int4_mma takes
  them at 1-8 rows) over weights of their own columns and 1, 2 and 3 blocks of threads an SM of outputs beside their
  own 5,120 (2.42 an SM on 132 SMs), cold and windowed, at 1 and 8 rows. Where two and three blocks an SM take the
  same time, the launch lasts one warp's chain of steps (what bounds it is each warp's latency, and only shorter runs
  shorten it); where the time grows with the blocks, the SMs or DRAM share it out (more bytes in flight would not help
  a launch that DRAM already keeps busy).

Timed as tools.quant_products times the products: CUDA graphs cycling over weight copies that L2 cannot hold.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from ignis.kernels import int4_mma as mma_kernel
from ignis.kernels import int4_tile, launch
from ignis.kernels.int4_mma import int4_mma

from tools.quant_products import (GROUP, WINDOW, _timed, floor_ms, mma_copies, product_shape, shipped,
                                   weight_copies)

AB_ROWS = (1, 8, 16, 17, 24, 32, 48, 64)
FIXED_COLUMNS = (3072, 6144, 12288, 24576)  # o_proj's 6,144 halved and doubled twice
O_PROJ = (5120, 6144)


@dataclass(frozen=True)
class Candidate:
    """A product's launch to try in place of its shipped one: its RING_LAUNCHES entry (U, AHEAD, XRING) and, if
    given, its SPLITS entry (KS, KW), which then orders its sums at every row count."""

    ring: tuple[int, int, bool]
    split: tuple[int, int] | None = None

    @classmethod
    def parse(cls, spec: str) -> Candidate:
        """--candidate's "U:AHEAD:XRING[:KS:KW]"."""
        numbers = [int(n) for n in spec.split(":")] if spec.replace(":", "").isdigit() else []
        if len(numbers) not in (3, 5):
            raise ValueError(f"--candidate takes U:AHEAD:XRING[:KS:KW], got {spec!r}")
        return cls((numbers[0], numbers[1], bool(numbers[2])), (numbers[3], numbers[4]) if len(numbers) == 5 else None)

    def launches(self, shape: tuple[int, int]) -> tuple[dict[tuple[int, int], tuple[int, int, bool]],
                                                        dict[tuple[int, int], tuple[int, int]]]:
        """int4_mma.RING_LAUNCHES and SPLITS as they stand, with this candidate's entries for a weight of `shape` (a
        split it does not name: the shipped one)."""
        rings, splits = mma_kernel.RING_LAUNCHES, mma_kernel.SPLITS
        return {**rings, shape: self.ring}, splits if self.split is None else {**splits, shape: self.split}


# the tables int4_mma's launch for a weight's shape reads: its ring launch, its split, its tiled kernel's tiles
TABLES = ((mma_kernel, "RING_LAUNCHES"), (mma_kernel, "SPLITS"), (int4_tile, "SHAPE_TILES"))


@contextmanager
def _tables(values: tuple[dict[Any, Any], ...]) -> Iterator[None]:
    """TABLES set to `values` (in TABLES' order), the shipped ones put back after."""
    kept = tuple(getattr(module, name) for module, name in TABLES)
    for (module, name), value in zip(TABLES, values):
        setattr(module, name, value)
    try:
        yield
    finally:
        for (module, name), value in zip(TABLES, kept):
            setattr(module, name, value)


def trying(shape: tuple[int, int], candidate: Candidate) -> AbstractContextManager[None]:
    """int4_mma's calls for a weight of `shape` with `candidate`'s ring launch and split in place of its own
    (`Candidate.launches`); RING_LAUNCHES and SPLITS put back after."""
    return _tables((*candidate.launches(shape), int4_tile.SHAPE_TILES))


def without(shape: tuple[int, int]) -> AbstractContextManager[None]:
    """int4_mma's calls for a weight of `shape` [out, in] as if RING_LAUNCHES, SPLITS and SHAPE_TILES did not name
    it; the three put back after."""
    return _tables(tuple({k: v for k, v in getattr(module, name).items() if k != shape} for module, name in TABLES))


def shape_ab(bw: float, reps: int, name: str, candidate: Candidate | None = None) -> list[dict[str, Any]]:
    """The product `name` without its shape's entries ("without") and as shipped, or with a candidate's launch
    ("candidate", `trying`) and as shipped, twice over, at each of AB_ROWS: us and x floor each."""
    nout, ncols = product_shape(name)
    dev = torch.device("cuda")
    nm, cm = mma_copies(nout, ncols, dev)
    rows_out = []
    for r in AB_ROWS:
        x = torch.randn(r, ncols, device=dev).bfloat16()
        floor = floor_ms(nm, r, nout, ncols, bw)
        said = []
        for form in ("without" if candidate is None else "candidate", "shipped") * 2:
            row: dict[str, Any] = {"shape": name, "rows": r, "form": form}
            arm = (without((nout, ncols)) if candidate is None else trying((nout, ncols), candidate))
            with arm if form != "shipped" else nullcontext():
                said.append(f"{form} {_timed(row, [partial(int4_mma, x, w) for w in cm], reps, floor).strip()}")
            rows_out.append(row)
        print(f"shape ab {name} rows {r:2d}: " + ", ".join(said), flush=True)
    return rows_out


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (x, y) points."""
    n = len(points)
    mx, my = sum(p[0] for p in points) / n, sum(p[1] for p in points) / n
    slope = sum((a - mx) * (b - my) for a, b in points) / sum((a - mx) ** 2 for a, _ in points)
    return my - slope * mx, slope


def sweep_fixed(bw: float, reps: int) -> dict[str, Any]:
    """o_proj's launch (its split and ring, as int4_mma takes it at 1-8 rows) at 1 and 8 rows over FIXED_COLUMNS,
    launch.PDL on and off and windowed with PDL (its codes from L2: quant_products.sweep_hot), and a copy and a bf16
    GEMV of each weight's bytes: {"rows": each timing, "fits": a line through each form's (floor us, us)}."""
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    s = shipped(*O_PROJ, GROUP, sms, 1)
    rows_out: list[dict[str, Any]] = []
    kept = launch.PDL
    try:
        for ncols in FIXED_COLUMNS:
            nm, cm = mma_copies(O_PROJ[0], ncols, dev)
            for r in (1, 8):
                x = torch.randn(r, ncols, device=dev).bfloat16()
                floor = floor_ms(nm, r, O_PROJ[0], ncols, bw)
                for pdl, window in ((True, 0), (False, 0), (True, WINDOW)):
                    launch.PDL = pdl
                    form = f"o_proj launch, pdl {int(pdl)}" + (", windowed" if window else "")
                    row: dict[str, Any] = {"columns": ncols, "rows": r, "form": form, "floor_ms": floor}
                    _timed(row, [partial(int4_mma, x, w, s, window=window) for w in cm], reps, floor)
                    rows_out.append(row)
            del cm
            floor = nm / bw * 1e3
            # a copy of nm bytes: nm // 2 read, as many written
            src = weight_copies(nm // 2, lambda: torch.randn(nm // 8, device=dev))  # noqa: B023
            dst = [torch.empty_like(a) for a in src]
            row = {"columns": ncols, "form": "copy", "floor_ms": floor}
            _timed(row, [partial(d.copy_, a) for a, d in zip(src, dst)], reps, floor)
            rows_out.append(row)
            del src, dst
            k = nm // 2 // O_PROJ[0]  # a bf16 weight of nm bytes
            ws = weight_copies(nm, lambda: torch.randn(O_PROJ[0], k, device=dev).bfloat16())  # noqa: B023
            v = torch.randn(1, k, device=dev).bfloat16()
            row = {"columns": ncols, "form": "bf16 gemv", "floor_ms": floor}
            _timed(row, [partial(F.linear, v, w) for w in ws], reps, floor)
            rows_out.append(row)
            del ws
            torch.cuda.empty_cache()
    finally:
        launch.PDL = kept
    fits = []
    for form, nrows in dict.fromkeys((p["form"], p.get("rows")) for p in rows_out):
        timed = [p for p in rows_out if p["form"] == form and p.get("rows") == nrows and "ms" in p]
        if len(timed) < 2:
            continue
        fixed, slope = _line([(1e3 * p["floor_ms"], 1e3 * p["ms"]) for p in timed])
        fits.append({"form": form, "rows": nrows, "fixed_us": fixed, "slope": slope})
        at = ", ".join(f"{p['columns']} x{p['x_floor']:.2f}" for p in timed)
        print(f"fixed {form}{'' if nrows is None else f', {nrows} rows'}: {fixed:.2f} us + {slope:.3f} x floor ({at})",
              flush=True)
    return {"rows": rows_out, "fits": fits}


BLOCK_PRODUCTS = ("mlp down", "o_proj")  # the 27B's products of 5,120 outputs: 320 blocks of threads
BLOCKS_AN_SM = (1, 2, 3)


def block_widths(nout: int, sms: int) -> list[int]:
    """The outputs `sweep_blocks` times a launch of `nout` outputs over: its own, and 16 x `sms` x each of
    BLOCKS_AN_SM (one feature block a block of threads: 1, 2 and 3 blocks an SM), ascending."""
    return sorted({16 * sms * k for k in BLOCKS_AN_SM} | {nout})


def sweep_blocks(bw: float, reps: int) -> list[dict[str, Any]]:
    """Each of BLOCK_PRODUCTS' launches (its own split, ring and step, as `shipped` gives them for its 5,120 outputs)
    over weights of its columns and 16 x SMs x BLOCKS_AN_SM outputs beside its own, 1 and 8 rows, cold and windowed:
    us, x floor, and blocks an SM. The launch is the product's at every width (one block of threads a feature block,
    so the width sets the blocks an SM); the floors are each weight's own bytes."""
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows_out: list[dict[str, Any]] = []
    for name in BLOCK_PRODUCTS:
        nout0, ncols = product_shape(name)
        calls = {r: (shipped(nout0, ncols, GROUP, sms, r), torch.randn(r, ncols, device=dev).bfloat16())
                 for r in (1, 8)}  # the launch and x are the product's at every width
        for nout in block_widths(nout0, sms):
            nm, cm = mma_copies(nout, ncols, dev)
            for r, (s, x) in calls.items():
                floor = floor_ms(nm, r, nout, ncols, bw)
                blocks = nout // 16 * s.ks / (s.rb * s.f) / sms
                said = []
                for form, window in (("cold", 0), ("windowed", WINDOW)):
                    row: dict[str, Any] = {"product": name, "out": nout, "in": ncols, "rows": r, "form": form,
                                           "blocks_an_sm": blocks, "floor_ms": floor}
                    said.append(f"{form} " + _timed(row, [partial(int4_mma, x, w, s, window=window) for w in cm],
                                                    reps, floor))
                    rows_out.append(row)
                print(f"blocks {name:9s} {nout:6d} x {ncols} ({blocks:4.2f} an SM) rows {r}  {'  '.join(said)}",
                      flush=True)
            del cm
            torch.cuda.empty_cache()
    return rows_out
