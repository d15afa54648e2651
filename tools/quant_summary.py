"""tools.bench_quant's summary: the lines its result's figures come to (the done-when's, and each sweep's fastest
launch beside the chosen one).

Owns: `summary`. Does not own: the figures (tools.quant_products, tools.quant_launch, tools.bench_quant's decode
steps and quality)."""

from __future__ import annotations

from typing import Any

from tools.quant_products import ROWS, STEP_COUNTS, loop_tag


def _fastest(sweep: list[dict[str, Any]], mark: str) -> tuple[dict[tuple[str, int], dict[str, Any]],
                                                                 dict[tuple[str, int], dict[str, Any]]]:
    """A sweep's timed rows by (shape, rows): the fastest of each, and the one whose `mark` is set (the default)."""
    fastest: dict[tuple[str, int], dict[str, Any]] = {}
    marked: dict[tuple[str, int], dict[str, Any]] = {}
    for p in sweep:
        key = (p["shape"], p["rows"])
        if p[mark]:
            marked[key] = p
        if "ms" in p and (key not in fastest or p["ms"] < fastest[key]["ms"]):
            fastest[key] = p
    return fastest, marked


def _launch_of(p: dict[str, Any]) -> str:
    """A swept mma launch as the summary names it."""
    return (f"ks {p['ks']} kw {p['kw']} f {p['f']} u {p['u']} ahead {p['ahead']} rg {p.get('rg', 1)}"
            f"{loop_tag(p.get('ring'), p.get('xring'))}")


def _step_products(sweep: list[dict[str, Any]]) -> list[str]:
    """--sweep-hot's products as a 27B decode step runs them (each STEP_COUNTS times): their time over their floor
    together, a line for each row count whose every form has all five products timed."""
    lines = []
    for r in dict.fromkeys(p["rows"] for p in sweep):
        together = []
        for form in dict.fromkeys(p["form"] for p in sweep if p["rows"] == r):
            timed = {p["shape"]: p for p in sweep if p["rows"] == r and p["form"] == form and "ms" in p}
            if set(timed) == set(STEP_COUNTS):
                ms = sum(STEP_COUNTS[n] * p["ms"] for n, p in timed.items())
                floor = sum(STEP_COUNTS[n] * p["ms"] / p["x_floor"] for n, p in timed.items())
                together.append(f"{form} x{ms / floor:.2f}")
        if together:
            lines.append(f"mma from DRAM, a decode step's products together, {r:2d} rows: " + ", ".join(together))
    return lines


def summary(result: dict[str, Any]) -> list[str]:
    """The lines the issue's done-when asks for."""
    lines = []
    prods = result.get("products", [])
    for r in ROWS:
        at = {(p["shape"], p["form"]): p for p in prods if p["rows"] == r}
        if not at:
            continue
        worst = max(p["x_floor"] for (_, form), p in at.items() if form == "int4")
        vs = [at[sh, "bf16"]["ms"] / at[sh, "int4"]["ms"] for sh, form in at if form == "int4"]
        vs8 = [at[sh, "bf16"]["ms"] / at[sh, "fp8"]["ms"] for sh, form in at if form == "fp8"]
        lines.append(f"int4 GEMV, {r:2d} rows: worst x{worst:.2f} of its floor; bf16 time / int4 time "
                     f"{min(vs):.2f}..{max(vs):.2f}; bf16 / fp8 {min(vs8):.2f}..{max(vs8):.2f}")
        mma = [p for (_, form), p in at.items() if form == "int4 mma"]
        if mma:
            vm = [at[sh, "bf16"]["ms"] / at[sh, "int4 mma"]["ms"] for sh, form in at if form == "int4 mma"]
            lines.append(f"int4 mma, {r:2d} rows: x{min(p['x_floor'] for p in mma):.2f}..x"
                         f"{max(p['x_floor'] for p in mma):.2f} of its floor; bf16 time / mma time "
                         f"{min(vm):.2f}..{max(vm):.2f}")
        tri = [p for (_, form), p in at.items() if form == "int4 triton"]
        if tri:
            vt = [at[sh, "int4"]["ms"] / at[sh, "int4 triton"]["ms"] for sh, form in at if form == "int4 triton"]
            lines.append(f"int4 Triton, {r:2d} rows: worst x{max(p['x_floor'] for p in tri):.2f} of its floor; numba "
                         f"time / Triton time {min(vt):.2f}..{max(vt):.2f}")
    best, tables = _fastest(result.get("sweep_triton", []), "table")
    for (shape, r), p in best.items():
        table = tables[shape, r]
        lines.append(f"Triton sweep, {shape}, {r:2d} rows: best x{p['x_floor']:.2f} (bm {p['block_m']} bn "
                     f"{p['block_n']} bk {p['block_k']} split {p['split_k']} warps {p['warps']} stages {p['stages']}), "
                     f"the table's x{table.get('x_floor', float('nan')):.2f}")
    fastest, chosen = _fastest(result.get("sweep_mma", []), "chosen")
    for (shape, r), p in fastest.items():
        mine = chosen.get((shape, r), {})
        lines.append(f"mma sweep, {shape}, {r:2d} rows: best x{p['x_floor']:.2f} (ks {p['ks']} kw {p['kw']}), the "
                     f"chosen x{mine.get('x_floor', float('nan')):.2f} (ks {mine.get('ks')} kw {mine.get('kw')})")
    for key in ("sweep_mma", "sweep_mma_loads", "sweep_mma_deep"):
        windowed = [{**p, "ms": p["ms_window"]} for p in result.get(key, []) if "ms_window" in p]
        fastest, chosen = _fastest(windowed, "chosen")
        sweep, nan = key.removeprefix("sweep_mma").lstrip("_") or "sweep", float("nan")
        for (shape, r), p in fastest.items():
            mine = chosen.get((shape, r), {})
            lines.append(f"mma {sweep} windowed, {shape}, {r:2d} rows: best x{p['x_floor_window']:.2f} (cold "
                         f"x{p['x_floor']:.2f}; {_launch_of(p)}), the chosen x{mine.get('x_floor_window', nan):.2f} "
                         f"(cold x{mine.get('x_floor', nan):.2f})")
    for key in ("sweep_mma_loads", "sweep_mma_deep"):
        fastest, chosen = _fastest(result.get(key, []), "chosen")
        for (shape, r), p in fastest.items():
            mine = chosen.get((shape, r), {})
            lines.append(f"mma {key[10:]}, {shape}, {r:2d} rows: best x{p['x_floor']:.2f} ({_launch_of(p)}), the "
                         f"chosen x{mine.get('x_floor', float('nan')):.2f} (f {mine.get('f')} u {mine.get('u')} ahead "
                         f"{mine.get('ahead')} rg {mine.get('rg', 1)}{loop_tag(mine.get('ring'), mine.get('xring'))})")
    hot: dict[tuple[str, int], dict[str, float]] = {}
    for p in result.get("sweep_hot", []):
        if "ms" in p:
            hot.setdefault((p["shape"], p["rows"]), {})[p["form"]] = p["x_floor"]
    for (shape, r), forms in hot.items():
        lines.append(f"mma from DRAM, one copy and windowed, {shape}, {r:2d} rows: "
                     + ", ".join(f"{k} x{v:.2f}" for k, v in forms.items()))
    lines += _step_products(result.get("sweep_hot", []))
    pol = result.get("policies")
    if pol:
        b, table = pol["best"], pol["sums"][0]
        lines.append(f"Triton policies: best {tuple(b['policy'])} (block_n, warps, stages, programs a SM): a decode "
                     f"step's int4 products {b['step_ms_1']:.3f} ms at 1 row and {b['step_ms_8']:.3f} at 8; the "
                     f"table's {tuple(table['policy'])} {table['step_ms_1']:.3f} and {table['step_ms_8']:.3f}")
    dec = result.get("decode")
    if dec and "bf16" in dec:
        lines.append(f"27B decode step, 1 lane, graphs: bf16 {dec['bf16']['graph_ms']:.2f} ms, int4 "
                     f"{dec['int4']['graph_ms']:.2f} ms (x{dec['speedup_int4']:.2f}), int4 with the output head "
                     f"{dec['int4_head']['graph_ms']:.2f} ms (x{dec['speedup_int4_head']:.2f})"
                     + (f", fp8 {dec['fp8']['graph_ms']:.2f} ms (x{dec['speedup_fp8']:.2f})" if "fp8" in dec else ""))
    q = result.get("quality")
    if q:
        lines.append(f"built-in perplexity: bf16 {q['int4']['ppl_reference']:.3f}, int4 "
                     f"{q['int4']['ppl_quantized']:.3f}, int4 with the head {q['int4_head']['ppl_quantized']:.3f}, "
                     f"fp8 {q['fp8']['ppl_quantized']:.3f}; dflash2 tokens a round: "
                     + ", ".join(f"{k} {v:.2f}" for k, v in q["dflash2_tokens_per_round"].items()))
    return lines
