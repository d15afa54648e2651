"""A benchmark's results: per-level summaries, the table, the JSON file, the plot and the comparison ratios.

Owns: percentiles of TTFT, TPOT and end-to-end latency, throughput, tokens per round, how they are printed and
written, and the latency-vs-throughput PNG (matplotlib, the `bench` extra; without it the PNG is skipped with a
note). Does not own: measuring (.load).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ignis.bench.load import Sample

PERCENTILES = (50, 90, 99)


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50/p90/p99 and the mean, in milliseconds (nearest rank); None when there is nothing to summarise."""
    out: dict[str, float | None] = {}
    xs = sorted(values)
    for p in PERCENTILES:
        out[f"p{p}"] = round(1000.0 * xs[max(math.ceil(p / 100 * len(xs)) - 1, 0)], 3) if xs else None
    out["mean"] = round(1000.0 * sum(xs) / len(xs), 3) if xs else None
    return out


def summarize(samples: list[Sample], wall_s: float, concurrency: int) -> dict[str, Any]:
    ok = [s for s in samples if s.ok]
    tokens = sum(s.output_tokens for s in ok)
    speculative = [s for s in ok if s.rounds]
    rounds = sum(s.rounds or 0 for s in speculative)
    return {
        "concurrency": concurrency,
        "requests": len(samples),
        "errors": len(samples) - len(ok),
        "first_error": next((s.error for s in samples if not s.ok), None),
        "duration_s": round(wall_s, 3),
        "prompt_tokens": sum(s.prompt_tokens for s in ok),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / wall_s, 2) if wall_s > 0 else 0.0,
        "requests_per_s": round(len(ok) / wall_s, 3) if wall_s > 0 else 0.0,
        "ttft_ms": percentiles([s.ttft for s in ok if s.ttft > 0]),
        "tpot_ms": percentiles([t for s in ok if (t := s.tpot) is not None]),
        "e2e_ms": percentiles([s.e2e for s in ok]),
        # Each decode round commits the accepted drafts plus the model's own token.
        "tokens_per_round": round((rounds + sum(s.accepted or 0 for s in speculative)) / rounds, 3) if rounds else None,
    }


def table(label: str, levels: list[dict[str, Any]]) -> str:
    head = f"{label}\n  {'conc':>4} {'req':>4} {'err':>3} {'out tok/s':>10} {'TTFT p50/p99 ms':>18} " \
           f"{'TPOT p50/p99 ms':>16} {'tok/round':>9}"
    rows = [head]
    for r in levels:
        tpr = f"{r['tokens_per_round']:.2f}" if r["tokens_per_round"] else "-"
        rows.append(f"  {r['concurrency']:>4} {r['requests']:>4} {r['errors']:>3} {r['output_tokens_per_s']:>10.1f} "
                    f"{_pair(r['ttft_ms']):>18} {_pair(r['tpot_ms']):>16} {tpr:>9}")
    return "\n".join(rows)


def _pair(p: dict[str, float | None]) -> str:
    return "-" if p["p50"] is None else f"{p['p50']:.1f}/{p['p99']:.1f}"


def ratios(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """Per concurrency level both targets ran: B over A for throughput and the p50 latencies."""
    by_level = {r["concurrency"]: r for r in a["levels"]}
    out = []
    for rb in b["levels"]:
        ra = by_level.get(rb["concurrency"])
        if ra is None:
            continue
        out.append({
            "concurrency": rb["concurrency"],
            "output_tokens_per_s": _ratio(rb["output_tokens_per_s"], ra["output_tokens_per_s"]),
            "ttft_p50": _ratio(rb["ttft_ms"]["p50"], ra["ttft_ms"]["p50"]),
            "tpot_p50": _ratio(rb["tpot_ms"]["p50"], ra["tpot_ms"]["p50"]),
        })
    return out


def _ratio(x: float | None, y: float | None) -> float | None:
    return round(x / y, 3) if x and y else None


def ratio_table(a: str, b: str, rows: list[dict[str, Any]]) -> str:
    lines = [f"{b} / {a}", f"  {'conc':>4} {'out tok/s':>10} {'TTFT p50':>9} {'TPOT p50':>9}"]
    for r in rows:
        cells = [f"{r[k]:.2f}x" if r[k] is not None else "-" for k in ("output_tokens_per_s", "ttft_p50", "tpot_p50")]
        lines.append(f"  {r['concurrency']:>4} {cells[0]:>10} {cells[1]:>9} {cells[2]:>9}")
    return "\n".join(lines)


def write_json(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def plot(path: Path, targets: list[dict[str, Any]], title: str) -> bool:
    """Latency against throughput, one line per target, one point per concurrency level. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for t in targets:
        xs = [r["output_tokens_per_s"] for r in t["levels"]]
        for ax, key in zip(axes, ("tpot_ms", "ttft_ms")):
            ys = [r[key]["p50"] for r in t["levels"]]
            ax.plot(xs, ys, marker="o", label=t["label"])
            for x, y, r in zip(xs, ys, t["levels"]):
                if y is not None:
                    ax.annotate(f"c={r['concurrency']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    for ax, what in zip(axes, ("time per output token, p50 (ms)", "time to first token, p50 (ms)")):
        ax.set_xlabel("output tokens/s (all requests)")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
