"""The products of a Qwen3.5-27B decode step timed one at a time on one GPU, and the int4 kernels' launch sweeps:
what tools.bench_quant's products, tunings, sweep_triton, sweep_mma, policies and layouts steps run (its docstring
says what each measures), and the timing helpers tools.bench_gemv shares.

Every figure is a CUDA graph of calls cycling over enough weight copies that none is still in L2 (`graph_ms`), over
the form's own bytes at the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, replace
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from ignis.kernels.int4_gemv import Tuning, int4_gemv, kernel, row_tile
from ignis.kernels.int4_mma import SHARED as MMA_SHARED
from ignis.kernels.int4_mma import MmaCodes, Shape, int4_mma, pack, row_tiles
from ignis.kernels.int4_mma import split as mma_split
from ignis.kernels.int4_mma import launch as mma_launch
from ignis.kernels.int4_mma import ringed, step_fits
from ignis.kernels.int4_triton import Config, check, choose, int4_triton
from ignis.kernels.gemv_triton import fp8_gemv
from ignis.kernels.launch import SPLIT_COUNTERS
from ignis.quant.format import dequantize, quantize
from ignis.quant.fp8 import Fp8Weight, fp8_linear, quantize_fp8
from tools.round_work import QWEN35_27B

C = QWEN35_27B
GDN_Z = C["linear_num_value_heads"] * C["linear_value_head_dim"]
GDN_QKV = 2 * C["linear_num_key_heads"] * C["linear_key_head_dim"] + GDN_Z
ATTN_QKV = (2 * C["num_attention_heads"] + 2 * C["num_key_value_heads"]) * C["head_dim"]
H, I = C["hidden_size"], C["intermediate_size"]
# (name, out, in): the products of a 27B decode step (the GDN qkv and z run as two packed products in a quantized
# model; their sum is the fused bf16 in_proj's size less the two 48-row gates).
SHAPES = [("mlp gate_up", 2 * I, H), ("mlp down", H, I), ("gdn in_proj qkv+z", GDN_QKV + GDN_Z, H),
          ("attn qkv", ATTN_QKV, H), ("o_proj / gdn out_proj", H, C["num_attention_heads"] * C["head_dim"])]
ROWS = (1, 8, 16, 64)
FLUSH = 256 * 2**20  # bytes of weight copies a timed graph cycles over (the H200's L2 is 50 MB)
GROUP = 128
WINDOW = 16  # feature blocks whose codes a windowed launch reads (int4_mma's `window`): under a MB, held by L2


def floor_ms(weight_bytes: int, rows: int, nout: int, ncols: int, bw: float) -> float:
    """A product's floor in ms: its weight's bytes plus its 16-bit activations in and out ([rows, ncols] and
    [rows, nout]) at `bw` bytes a second."""
    return (weight_bytes + 2 * rows * (ncols + nout)) / bw * 1e3


def product_shape(name: str, flag: str = "") -> tuple[int, int]:
    """The [out, in] of the one of SHAPES whose name starts with `name` ("o_proj", "mlp down"), or ValueError naming
    the option `flag` that gave it."""
    for label, nout, ncols in SHAPES:
        if label.startswith(name):
            return nout, ncols
    raise ValueError(f"{flag + ': ' if flag else ''}no 27B product named {name!r} or starting so; the products: "
                     f"{', '.join(label for label, _, _ in SHAPES)}")


def graph_ms(calls: list[Callable[[], object]], reps: int) -> float:
    """ms per call of `calls` (each on its own weight copy), replayed as one CUDA graph of at least 32 calls."""
    for c in calls:
        c()  # compile, load, pick algorithms
    torch.cuda.synchronize()
    seq = calls * math.ceil(32 / len(calls))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in seq:
            c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in seq:
            c()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / len(seq))
    del graph
    return statistics.median(times)


def _int4_reference(x: torch.Tensor, qw: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    return F.linear(x, dequantize(qw, s, z, x.dtype))


def weight_copies(nbytes: int, make: Callable[[], Any]) -> list[Any]:
    return [make() for _ in range(max(1, min(16, FLUSH // nbytes)))]


def _int4_copies(nout: int, ncols: int, dev: torch.device) -> tuple[int, list[tuple[torch.Tensor, ...]]]:
    """A random [nout, ncols] weight packed to int4 (bf16 scales): its bytes, and enough copies of (qweight, scales,
    qzeros) that a graph cycling over them reads none from L2."""
    qw, s, z = quantize(torch.randn(nout, ncols, device=dev) * 0.02, GROUP)
    s = s.bfloat16()
    n4 = qw.nbytes + s.nbytes + z.nbytes
    return n4, weight_copies(n4, lambda: (qw.clone(), s.clone(), z.clone()))


def mma_copies(nout: int, ncols: int, dev: torch.device) -> tuple[int, list[MmaCodes]]:
    """`_int4_copies`' weight packed for int4_mma (bf16 activations): the packed bytes a call reads, and the copies."""
    _, c4 = _int4_copies(nout, ncols, dev)
    cm = [pack(*p, torch.bfloat16) for p in c4]
    return cm[0].codes.nbytes + cm[0].zs.nbytes, cm


def products(bw: float, reps: int) -> list[dict[str, Any]]:
    rows_out = []
    dev = torch.device("cuda")
    for name, nout, ncols in SHAPES:
        w = torch.randn(nout, ncols, device=dev) * 0.02
        qw, s, z = quantize(w, GROUP)
        s = s.bfloat16()
        f8 = quantize_fp8(w)
        wb = w.bfloat16()
        del w
        n4, nb, n8 = qw.nbytes + s.nbytes + z.nbytes, wb.nbytes, f8.weight.nbytes + f8.scale.nbytes
        c4 = weight_copies(n4, lambda: (qw.clone(), s.clone(), z.clone()))
        cb = weight_copies(nb, wb.clone)
        c8 = weight_copies(n8, lambda: Fp8Weight(f8.weight.clone(), f8.scale.clone()))
        cm = [pack(*p, torch.bfloat16) for p in c4]
        nm = cm[0].codes.nbytes + cm[0].zs.nbytes
        for r in ROWS:
            x = torch.randn(r, ncols, device=dev).bfloat16()
            forms: dict[str, tuple[int, list[Callable[[], object]]]] = {
                "int4": (n4, [partial(int4_gemv, x, *p) for p in c4]),
                "int4 triton": (n4, [partial(int4_triton, x, *p) for p in c4]),
                "int4 mma": (nm, [partial(int4_mma, x, p) for p in cm]),
                "bf16": (nb, [partial(F.linear, x, p) for p in cb]),
                "fp8": (n8, [partial(fp8_linear, x, p) for p in c8]),
                "fp8 triton": (n8, [partial(fp8_gemv, x, p.weight, p.scale) for p in c8]),
            }
            if r == ROWS[-1]:  # where the kernel meets prefill-sized inputs: what packed_linear does above 64 rows
                forms["int4 reference"] = (n4, [partial(_int4_reference, x, *p) for p in c4])
            for form, (nbytes, calls) in forms.items():
                ms = graph_ms(calls, reps)
                floor = floor_ms(nbytes, r, nout, ncols, bw)
                rows_out.append({"shape": name, "out": nout, "in": ncols, "rows": r, "form": form, "ms": ms,
                                 "floor_ms": floor, "x_floor": ms / floor})
                print(f"{name:22s} {nout:6d}x{ncols:<6d} rows {r:3d}  {form:15s} {1e3 * ms:8.1f} us  "
                      f"floor {1e3 * floor:7.1f} us  x{ms / floor:5.2f}", flush=True)
        del c4, cb, c8, cm
        torch.cuda.empty_cache()
    return rows_out


TUNINGS = [Tuning(4, 4, 8), Tuning(2, 4, 8), Tuning(8, 4, 8), Tuning(4, 8, 4), Tuning(4, 2, 16), Tuning(4, 4, 16)]


def kernel_info(t: Tuning, rt: int) -> dict[str, Any]:
    """Registers and local memory a thread of the compiled bf16 kernel uses (spills show as local memory)."""
    disp = kernel("bf16", "bf16", rt, t.ot, t.warps)
    try:
        return {"regs": disp.get_regs_per_thread(), "local_bytes": disp.get_local_mem_per_thread()}
    except (AttributeError, KeyError, TypeError) as e:  # a numba-cuda without these queries: say so, keep timing
        return {"info_error": repr(e)}


def tunings(bw: float, reps: int) -> list[dict[str, Any]]:
    """The int4 kernel's shapes of work (output rows a warp, warps a block, blocks a SM aimed at) at the largest and
    the smallest products, 1 and 8 rows; the first is the default (ignis.kernels.int4_gemv.TUNING)."""
    rows_out = []
    dev = torch.device("cuda")
    for name, nout, ncols in (SHAPES[0], SHAPES[1], SHAPES[4]):
        n4, c4 = _int4_copies(nout, ncols, dev)
        for r in (1, 8):
            x = torch.randn(r, ncols, device=dev).bfloat16()
            floor = floor_ms(n4, r, nout, ncols, bw)
            for t in TUNINGS:
                ms = graph_ms([partial(int4_gemv, x, p[0], p[1], p[2], tuning=t) for p in c4], reps)
                info = kernel_info(t, row_tile(r))
                rows_out.append({"shape": name, "rows": r, "ot": t.ot, "warps": t.warps,
                                 "blocks_per_sm": t.blocks_per_sm, "ms": ms, "x_floor": ms / floor, **info})
                print(f"tuning {name:22s} rows {r}  ot {t.ot} warps {t.warps} blocks/SM {t.blocks_per_sm:2d}  "
                      f"{1e3 * ms:8.1f} us  x{ms / floor:5.2f}  {info}", flush=True)
        del c4
        torch.cuda.empty_cache()
    return rows_out


def triton_configs(rows: int, nout: int, ncols: int, group: int, sms: int) -> list[Config]:
    """The table's choice first, then one knob at a time around it (and larger tiles with a split that keeps the
    programs' count): what --sweep-triton times."""
    base = choose(rows, nout, ncols, group, sms)
    found = [base]
    split2 = 2 * base.split_k
    variants: list[dict[str, int]] = [{"block_n": 64}, {"block_n": 256}, {"warps": 8}, {"warps": 2}]
    variants += [{"stages": n} for n in (2, 3, 4, 5)] + [{"split_k": n} for n in (1, 2, 4, 8, 16)]
    variants += [{"block_k": base.block_k // 2}, {"block_n": 256, "split_k": split2},
                 {"block_n": 256, "warps": 8, "split_k": split2}, {"block_n": 64, "warps": 2}]
    for v in variants:
        c = replace(base, **v)
        try:
            check(c, ncols, group)
        except ValueError:
            continue
        if c not in found:
            found.append(c)
    return found


def _timed(row: dict[str, Any], calls: list[Callable[[], object]], reps: int, floor: float) -> str:
    """A sweep's launch timed into its row (ms and x_floor, or the error of a launch that does not compile or fit:
    reported, not fatal); what its printed line says."""
    try:
        ms = graph_ms(calls, reps)
    except Exception as e:  # noqa: BLE001 - out of shared memory or registers: say so, keep sweeping
        row["error"] = repr(e)[:300]
        return f"failed: {row['error'][:100]}"
    row.update(ms=ms, x_floor=ms / floor)
    return f"{1e3 * ms:8.1f} us  x{ms / floor:5.2f}"


def sweep_triton(bw: float, reps: int) -> list[dict[str, Any]]:
    """The Triton kernel's launch shapes at the largest and the smallest products, 1, 8 and 64 rows: us and x floor
    a config (a config that does not compile or launch is reported, not fatal)."""
    rows_out = []
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for name, nout, ncols in (SHAPES[0], SHAPES[1], SHAPES[4]):
        n4, c4 = _int4_copies(nout, ncols, dev)
        for r in (1, 8, 64):
            x = torch.randn(r, ncols, device=dev).bfloat16()
            floor = floor_ms(n4, r, nout, ncols, bw)
            for i, c in enumerate(triton_configs(r, nout, ncols, GROUP, sms)):
                row: dict[str, Any] = {"shape": name, "rows": r, "table": i == 0, **asdict(c)}
                said = _timed(row, [partial(int4_triton, x, p[0], p[1], p[2], config=c) for p in c4], reps, floor)
                rows_out.append(row)
                print(f"triton {name:22s} rows {r:2d}  {'table' if i == 0 else '     '} bm {c.block_m:2d} bn "
                      f"{c.block_n:3d} bk {c.block_k:3d} split {c.split_k:2d} warps {c.warps} stages {c.stages}  "
                      f"{said}", flush=True)
        del c4
        torch.cuda.empty_cache()
    return rows_out


def loop_tag(ring: bool | None, xring: bool | None) -> str:
    """How a launch's step loop is printed: "" (the plain loop), " ring", or " ring xring" (x in the ring too)."""
    return (" ring" if ring else "") + (" xring" if xring else "")


MMA_KS = (1, 2, 3, 4)  # blocks of threads along the input --sweep-mma tries
MMA_KW = (2, 4, 6, 8, 12, 16)  # warps along a block's part of the input


def shipped(nout: int, ncols: int, group: int, sms: int, rows: int) -> Shape:
    """The launch int4_mma takes for `rows` rows of a weight [nout, ncols] without the SwiGLU store: its split,
    launch's shape for the row tiles, on the ring where int4_mma.RING_LAUNCHES names the weight (1-8 rows)."""
    nt = row_tiles(rows)
    return ringed(mma_launch(mma_split(nout, ncols, group, sms), nt), nt, nout, ncols, group)


def mma_shapes(nout: int, ncols: int, group: int, sms: int, rows: int) -> list[Shape]:
    """int4_mma's own launch for `rows` first (`shipped`; then its plain loop where that is on the ring), then its input
    split changed to every KS x KW of MMA_KS and MMA_KW that the kernel takes: each part at least one unit of the
    input, at most 1,024 threads a block, the blocks' counters within SPLIT_COUNTERS (the rest of each launch as
    int4_mma.launch makes it, on the plain loop). What --sweep-mma times: the split is what leaves the 5,120-row
    products' last wave part-empty on 132 SMs."""
    nt = row_tiles(rows)
    base = mma_split(nout, ncols, group, sms)
    units = ncols // (64 * base.unit)
    found = list(dict.fromkeys((shipped(nout, ncols, group, sms, rows), mma_launch(base, nt))))  # and its plain loop
    for ks in MMA_KS:
        for kw in MMA_KW:
            s = mma_launch(replace(base, ks=ks, kw=kw), nt)
            blocks = math.ceil(nout // 16 / (s.rb * s.f))
            if ks * kw > units or 32 * kw * s.rb > 1024 or (ks > 1 and blocks > SPLIT_COUNTERS) or s in found:
                continue
            found.append(s)
    return found


def mma_loads(nout: int, ncols: int, group: int, sms: int, rows: int) -> list[Shape]:
    """int4_mma's own launch for `rows` first (`shipped`), then the plain loop's with its step's chunks U (the unit's
    divisors that hold whole groups), the steps it loads ahead (AHEAD, 0 to 3) and its feature blocks a warp (F: the
    launch's, or 1, which spills no registers at 64 rows) changed; above 8 rows also RG 2, 4 and 8 (blocks of threads
    that split the row tiles of the same features, each holding fewer sums) at F 1 and 2, where the warps' partial
    sums fit; at one row tile also the ring loop (RING) at U 4 and 2, AHEAD 1 to 3, and with x in the ring (XRING) at
    U 4 AHEAD 1 and U 2 AHEAD 1 and 2. (RB, warps of a block that read the same x, was measured never to pay:
    BENCHMARKS.md.) What --sweep-mma-loads times: none of them changes the order of a row's sums, so a faster launch
    changes no result."""
    nt = row_tiles(rows)
    base = mma_launch(mma_split(nout, ncols, group, sms), nt)  # the plain loop's launch, which the variants change
    found = [shipped(nout, ncols, group, sms, rows)]
    for f in sorted({base.f, 1}, reverse=True):
        for u in (1, 2, 4):
            for ahead in (0, 1, 2, 3):
                s = replace(base, f=f, u=u, ahead=ahead)
                if step_fits(base.unit, u, group) and s not in found:
                    found.append(s)
    if nt == 1:  # the step loop unrolled over its ring, loads kept above each step's compute (int4_mma.RING_LAUNCHES)
        for u, ahead, xring in ((4, 1, False), (4, 2, False), (2, 1, False), (2, 2, False), (2, 3, False),
                                (4, 1, True), (2, 1, True), (2, 2, True)):
            s = replace(base, u=u, ahead=ahead, ring=True, xring=xring)
            if step_fits(base.unit, u, group) and s not in found:
                found.append(s)
    for rg in (r for r in (2, 4, 8) if r <= nt):
        for f in (2, 1):
            s = replace(base, f=f, rg=rg)
            if (s.kw - 1) * f * (nt // rg) * 512 <= MMA_SHARED and s not in found:
                found.append(s)
    return found


# the ring launches (U, AHEAD, XRING) --sweep-mma-deep tries at every split, one row tile
DEEP_RINGS = ((2, 2, False), (2, 3, False), (2, 1, True), (2, 2, True))


def mma_deep(nout: int, ncols: int, group: int, sms: int, rows: int) -> list[Shape]:
    """int4_mma's own launch for `rows` first (`shipped`), then every split that mma_shapes takes, on the plain loop
    with 2 and 3 steps loaded ahead (--sweep-mma has them with one), and at one row tile on the ring loop with each of
    DEEP_RINGS, whose loads stay ahead where the plain loop's do not: fewer warps an SM holding more bytes in flight
    each, so that a product launched programmatic-dependent leaves room on the SMs for the next one's blocks (what
    --sweep-mma-deep times; the split changes the order of a row's sums, AHEAD and the ring do not)."""
    found = mma_shapes(nout, ncols, group, sms, rows)
    plain = [s for s in found if not s.ring]  # every split's plain-loop launch
    deep = found[:1] + [replace(base, ahead=a) for base in plain for a in (2, 3)]
    if row_tiles(rows) == 1:
        deep += [replace(base, u=u, ahead=a, ring=True, xring=x) for base in plain for u, a, x in DEEP_RINGS
                 if step_fits(base.unit, u, group)]
    return list(dict.fromkeys(deep))


def sweep_mma(bw: float, reps: int, loads: bool = False, deep: bool = False,
              rows: tuple[int, ...] | None = None, window: bool = False) -> list[dict[str, Any]]:
    """int4_mma's input splits (mma_shapes) over the five 27B products at 1 and 8 rows, or with `loads` its step
    sizes and loads ahead (mma_loads) at 1, 8, 16 and 64 rows (or `rows`): us and x floor each, its own choice marked
    (a launch that does not compile or launch is reported, not fatal); with `window` each launch windowed as well
    (sweep_hot's: its codes from L2, what it takes when DRAM costs it nothing) as ms_window and x_floor_window. A split
    changes the order of a row's sums, so a faster one replaces choose's only with its tests' references."""
    rows_out = []
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    shapes_of, own = ((mma_loads, (1, 8, 16, 64)) if loads else (mma_deep, (1,)) if deep
                      else (mma_shapes, (1, 8)))
    counts: tuple[int, ...] = rows or own
    for name, nout, ncols in SHAPES:
        nm, cm = mma_copies(nout, ncols, dev)
        for r in counts:
            x = torch.randn(r, ncols, device=dev).bfloat16()
            floor = floor_ms(nm, r, nout, ncols, bw)
            for i, s in enumerate(shapes_of(nout, ncols, GROUP, sms, r)):
                row: dict[str, Any] = {"shape": name, "rows": r, "chosen": i == 0, **asdict(s)}
                said = _timed(row, [partial(int4_mma, x, p, s) for p in cm], reps, floor)
                if window and "ms" in row:
                    windowed: dict[str, Any] = {}
                    said += "  windowed " + _timed(windowed, [partial(int4_mma, x, p, s, window=WINDOW) for p in cm],
                                                   reps, floor)
                    row.update({f"{k}_window": v for k, v in windowed.items() if k in ("ms", "x_floor")})
                rows_out.append(row)
                print(f"mma {name:22s} rows {r:2d}  {'chosen' if i == 0 else '      '} ks {s.ks} kw {s.kw:2d} f {s.f} "
                      f"u {s.u} ahead {s.ahead} rg {s.rg}{loop_tag(s.ring, s.xring)}  {said}", flush=True)
        del cm
        torch.cuda.empty_cache()
    return rows_out


def sweep_hot(bw: float, reps: int) -> list[dict[str, Any]]:
    """int4_mma's own launch at the five 27B products at 1, 8, 16, 32 and 64 rows over weight copies that defeat L2
    ("cold"), over one copy ("one copy": L2 holds it after the first call only where it fits, `fits_l2`), and at 1,
    8 and 16 rows windowed ("window": the same grid and instructions with every block reading the codes of its block
    modulo WINDOW, which L2 holds, int4_mma's `window`): a product whose windowed launch is no faster than its cold one
    is bound by its own instructions and their latency, not by DRAM; one that is faster has that much room on a card
    with faster memory."""
    rows_out = []
    dev = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    for name, nout, ncols in SHAPES:
        nm, cm = mma_copies(nout, ncols, dev)
        fits = nm <= l2 // 2
        print(f"hot {name:22s} {nm / 2**20:.1f} MiB against an L2 of {l2 / 2**20:.0f} MiB: one copy "
              f"{'fits' if fits else 'does not fit'}", flush=True)
        for r in (1, 8, 16, 32, 64):
            x = torch.randn(r, ncols, device=dev).bfloat16()
            floor = floor_ms(nm, r, nout, ncols, bw)
            forms = [("cold", cm, 0), ("one copy", cm[:1], 0)] + ([("window", cm, WINDOW)] if r <= 16 else [])
            for form, weights, window in forms:
                row: dict[str, Any] = {"shape": name, "rows": r, "form": form, "fits_l2": fits}
                said = _timed(row, [partial(int4_mma, x, p, window=window) for p in weights], reps, floor)
                rows_out.append(row)
                print(f"hot {name:22s} rows {r:2d}  {form:8s} {said}", flush=True)
        del cm
        torch.cuda.empty_cache()
    return rows_out


# Launch policies of the Triton int4 kernel: (block_n, warps, stages) of the 16-row tile, and the split's target of
# programs per SM. The first is the table's. ncu at 52056dc: the table's gate_up product at one row ran 272 programs
# of 155 registers (0.69 waves, 2 warps a scheduler, 0.42 instructions a cycle, 35% of DRAM bandwidth), so the
# candidates trade tile width and registers for programs in flight.
POLICIES = [(128, 4, 4, 2), (128, 4, 4, 4), (128, 4, 3, 4), (128, 8, 4, 4), (64, 4, 4, 2), (64, 4, 4, 4),
            (64, 4, 4, 6), (64, 4, 3, 4), (64, 2, 4, 4), (32, 2, 4, 4), (32, 2, 4, 8)]
# how many times a 27B decode step runs each of SHAPES (48 GDN and 16 attention layers, each with an MLP)
STEP_COUNTS = {"mlp gate_up": 64, "mlp down": 64, "gdn in_proj qkv+z": 48, "attn qkv": 16, "o_proj / gdn out_proj": 64}


def policies(bw: float, reps: int) -> dict[str, Any]:
    """Each of POLICIES over the five 27B products at 1 and 8 rows: us a product, and a decode step's products (each
    shape times its count in the step) at 1 and at 8 rows. The best (least sum of the two) stays in force for the
    rest of the run (the decode step), and is reported; ties keep the earlier policy."""
    from ignis.kernels import int4_triton as it

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    weights: dict[str, tuple[int, list[tuple[torch.Tensor, ...]], int, int]] = {}
    for name, nout, ncols in SHAPES:
        weights[name] = (*_int4_copies(nout, ncols, dev), nout, ncols)
    rows_out: list[dict[str, Any]] = []
    sums: list[dict[str, Any]] = []
    for pol in POLICIES:
        bn, warps, stages, pps = pol
        it.tune({16: (bn, warps, stages), 32: (bn, warps, stages)}, pps)
        total = {1: 0.0, 8: 0.0}
        for name, (n4, c4, nout, ncols) in weights.items():
            for r in (1, 8):
                x = torch.randn(r, ncols, device=dev).bfloat16()
                ms = graph_ms([partial(int4_triton, x, *p) for p in c4], reps)
                floor = floor_ms(n4, r, nout, ncols, bw)
                cfg = it.choose(r, nout, ncols, GROUP, sms)
                rows_out.append({"policy": pol, "shape": name, "rows": r, "split_k": cfg.split_k, "ms": ms,
                                 "x_floor": ms / floor})
                total[r] += STEP_COUNTS[name] * ms
                print(f"policy {pol}  {name:22s} rows {r}  split {cfg.split_k:2d}  {1e3 * ms:7.1f} us  "
                      f"x{ms / floor:5.2f}", flush=True)
        sums.append({"policy": pol, "step_ms_1": total[1], "step_ms_8": total[8]})
        print(f"policy {pol}: a decode step's int4 products {total[1]:.3f} ms at 1 row, {total[8]:.3f} at 8",
              flush=True)
    best = min(sums, key=lambda e: e["step_ms_1"] + e["step_ms_8"])
    bn, warps, stages, pps = best["policy"]
    it.tune({16: (bn, warps, stages), 32: (bn, warps, stages)}, pps)
    print(f"best policy {best['policy']} (block_n, warps, stages, programs a SM), in force from here", flush=True)
    del weights
    torch.cuda.empty_cache()
    return {"rows": rows_out, "sums": sums, "best": best}


def layouts(bw: float, reps: int) -> list[dict[str, Any]]:
    """The Triton kernel at its table's launch over the five 27B products at 1 and 8 rows, its codes row-major (the
    format's layout) and k-blocked (int4_triton.k_blocked: a K step's rows contiguous): us and x floor each."""
    from ignis.kernels.int4_triton import choose, k_blocked

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows_out = []
    for name, nout, ncols in SHAPES:
        bk = choose(1, nout, ncols, GROUP, sms).block_k
        n4, row_major = _int4_copies(nout, ncols, dev)
        forms: dict[str, list[tuple[torch.Tensor, ...]]] = {
            "row-major": row_major, "k-blocked": [(k_blocked(qw, bk), s, z) for qw, s, z in row_major]}
        for r in (1, 8):
            x = torch.randn(r, ncols, device=dev).bfloat16()
            floor = floor_ms(n4, r, nout, ncols, bw)
            for form, c4 in forms.items():
                ms = graph_ms([partial(int4_triton, x, *p) for p in c4], reps)
                rows_out.append({"shape": name, "rows": r, "layout": form, "ms": ms, "x_floor": ms / floor})
                print(f"layout {form:9s} {name:22s} rows {r}  {1e3 * ms:7.1f} us  x{ms / floor:5.2f}", flush=True)
        del forms
        torch.cuda.empty_cache()
    return rows_out
