"""The numbers and the report of ``bench/quality.py``: stock Pareto frontier, excess-KLD ratios,
the Markdown table and the PNG plot. Pure functions of the measured rows (no tools run here), so
they are unit-tested on made-up rows (tests/test_bench_quality.py).

A row is a dict with at least ``name``, ``method`` ("stock", "voodoo", "sensitivity"),
``size_bytes`` and ``kld_mean``; voodoo and sensitivity rows also carry ``size_percent``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

TARGET_VS_STOCK = 0.5  # issue 11: excess KLD over the Q8_0 floor at most half the stock frontier's
TARGET_VS_SENSITIVITY = 0.75  # ... and at most 3/4 of the one-shot sensitivity knapsack's


def pareto(rows: Sequence[dict]) -> list[dict]:
    """The Pareto-optimal rows by (file size, mean KLD), ascending in size: a file stays when no
    file of the same or smaller size has the same or lower KLD."""
    out: list[dict] = []
    for r in sorted(rows, key=lambda r: (r["size_bytes"], r["kld_mean"])):
        if not out or r["kld_mean"] < out[-1]["kld_mean"]:  # sorted by KLD within a size: the first wins
            out.append(r)
    return out


def frontier_kld(front: Sequence[dict], size: float) -> float | None:
    """Mean KLD of the frontier at `size` bytes, linear in log KLD between the two nearest
    frontier files; None outside the frontier's size range (no extrapolation)."""
    if not front or size < front[0]["size_bytes"] or size > front[-1]["size_bytes"]:
        return None
    for a, b in zip(front, front[1:]):
        if a["size_bytes"] <= size <= b["size_bytes"]:
            t = (size - a["size_bytes"]) / (b["size_bytes"] - a["size_bytes"])
            la, lb = math.log(max(a["kld_mean"], 1e-12)), math.log(max(b["kld_mean"], 1e-12))
            return math.exp(la + t * (lb - la))
    return float(front[0]["kld_mean"])  # a frontier of one file, and size equals its size


def _ratio(num: float, den: float | None) -> float | None:
    if den is None or den <= 0:
        return None
    return num / den


def targets(rows: Sequence[dict], floor_name: str) -> dict[str, Any]:
    """Per Voodoo size: excess KLD (over the uniform Q8_0 file's) against the stock frontier's at
    the same file size and against the sensitivity knapsack's at the same standard size."""
    by_name = {r["name"]: r for r in rows}
    if floor_name not in by_name:
        raise ValueError(f"the floor file {floor_name} has no measured row")
    floor = float(by_name[floor_name]["kld_mean"])
    stock = [r for r in rows if r["method"] == "stock"]
    front = pareto(stock)
    sens = {r["size_percent"]: r for r in rows if r["method"] == "sensitivity"}
    out = []
    for r in sorted((r for r in rows if r["method"] == "voodoo"), key=lambda r: r["size_percent"]):
        excess = float(r["kld_mean"]) - floor
        f_kld = frontier_kld(front, r["size_bytes"])
        f_excess = None if f_kld is None else f_kld - floor
        note = ""
        if f_kld is None:
            smallest = front[0] if front else None
            if smallest is not None and r["size_bytes"] < smallest["size_bytes"]:
                note = (f"smaller than every stock file; KLD {'below' if r['kld_mean'] < smallest['kld_mean'] else 'above'} "
                        f"the smallest ({smallest['name']})")
            else:
                note = "outside the stock frontier's size range"
        s = sens.get(r["size_percent"])
        s_excess = None if s is None else float(s["kld_mean"]) - floor
        vs_stock = _ratio(excess, f_excess)
        vs_sens = _ratio(excess, s_excess)
        out.append({
            "size_percent": r["size_percent"], "name": r["name"], "size_bytes": r["size_bytes"],
            "kld_mean": r["kld_mean"], "excess": excess,
            "stock_frontier_kld": f_kld, "stock_excess": f_excess, "ratio_vs_stock": vs_stock,
            "meets_stock_target": None if vs_stock is None else vs_stock <= TARGET_VS_STOCK,
            "sensitivity_name": None if s is None else s["name"],
            "sensitivity_size_bytes": None if s is None else s["size_bytes"],
            "sensitivity_kld": None if s is None else s["kld_mean"], "sensitivity_excess": s_excess,
            "ratio_vs_sensitivity": vs_sens,
            "meets_sensitivity_target": None if vs_sens is None else vs_sens <= TARGET_VS_SENSITIVITY,
            "note": note,
        })
    return {"floor_name": floor_name, "floor_kld": floor, "frontier": [r["name"] for r in front], "sizes": out}


# -- Markdown ----------------------------------------------------------------------------------

def _f(v: Any, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def _yes(v: bool | None) -> str:
    return "—" if v is None else ("yes" if v else "no")


def markdown(result: dict[str, Any]) -> str:
    rows, t, s = result["rows"], result["targets"], result["setup"]
    front = set(t["frontier"])
    lines = [
        "# Voodoo vs stock llama.cpp recipes: quality", "",
        "Reproduce:", "", "```", result["command"], "```", "",
        f"- model: {s['model']} (de-gridded teacher, `make-teacher --degrid_seed {s['degrid_seed']}`); "
        f"reference F32 GGUF PPL {_f(s.get('reference_ppl'), '.4f')}, original (gridded Q4_1) GGUF PPL "
        f"{_f(s.get('original_ppl'), '.4f')} on the same text",
        f"- imatrix: stock `llama-imatrix` on {s['calib_chunks']} × {s['ctx']} tokens of the train split "
        "(the same for every method); stock recipes quantized from the de-gridded F32 GGUF",
        f"- eval: stock `llama-perplexity --kl-divergence` vs the F32 teacher, held-out plays, "
        f"-c {s['ctx']}, {s['eval_chunks']} chunks",
        f"- Voodoo: {s['steps']} steps at seq_len {s['seq_len']}; menu `{' '.join(s['menu'])}`; "
        "sensitivity = `voodoo train --method sensitivity` (one-shot knapsack, no training)",
        "",
        "| file | method | size MB | bpw | PPL | KLD mean | KLD p99 | KLD p99.9 | same top % | stock Pareto |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for r in sorted(rows, key=lambda r: r["size_bytes"]):
        lines.append(
            f"| {r['name']} | {r['method']} | {r['size_bytes'] / 1e6:.2f} | {_f(r.get('bpw'), '.3f')} | "
            f"{_f(r.get('ppl'), '.4f')} | {_f(r.get('kld_mean'), '.6f')} | {_f(r.get('kld_p99'), '.5f')} | "
            f"{_f(r.get('kld_p999'), '.5f')} | {_f(r.get('same_top_p'), '.3f')} | {'✓' if r['name'] in front else ''} |")
    lines += [
        "", f"## Targets (floor: mean KLD of {t['floor_name']} = {t['floor_kld']:.6f})", "",
        "excess = mean KLD − floor. vs stock: the Pareto-optimal stock files, linear in log KLD between the "
        f"two nearest in file size (target ratio ≤ {TARGET_VS_STOCK}). vs sensitivity: the knapsack file of the same "
        f"standard size (target ratio ≤ {TARGET_VS_SENSITIVITY}).", "",
        "| size | Voodoo MB | excess | stock frontier excess | ratio | ≤ 0.5 | sensitivity MB | sensitivity excess | ratio | ≤ 0.75 | note |",
        "|---|---:|---:|---:|---:|:---:|---:|---:|---:|:---:|---|",
    ]
    for x in t["sizes"]:
        sb = x["sensitivity_size_bytes"]
        lines.append(
            f"| Voodoo{x['size_percent']} | {x['size_bytes'] / 1e6:.2f} | {x['excess']:.6f} | {_f(x['stock_excess'], '.6f')} | "
            f"{_f(x['ratio_vs_stock'], '.3f')} | {_yes(x['meets_stock_target'])} | {_f(None if sb is None else sb / 1e6, '.2f')} | "
            f"{_f(x['sensitivity_excess'], '.6f')} | {_f(x['ratio_vs_sensitivity'], '.3f')} | "
            f"{_yes(x['meets_sensitivity_target'])} | {x['note']} |")
    return "\n".join(lines) + "\n"


# -- plot --------------------------------------------------------------------------------------

def plot(result: dict[str, Any], out: Path) -> Path:
    """Mean KLD (log) against file size: stock files and their frontier, Voodoo and sensitivity
    curves, the Q8_0 floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from voodoo_quant import fileio

    rows, t = result["rows"], result["targets"]
    fig, ax = plt.subplots(figsize=(8, 5))
    stock = [r for r in rows if r["method"] == "stock"]
    ax.scatter([r["size_bytes"] / 1e6 for r in stock], [r["kld_mean"] for r in stock], color="0.55", s=18,
               label="stock llama-quantize")
    for r in stock:
        ax.annotate(r["name"].split("stock-")[-1].removesuffix(".gguf"), (r["size_bytes"] / 1e6, r["kld_mean"]),
                    fontsize=6, color="0.35", xytext=(3, 2), textcoords="offset points")
    front = pareto(stock)
    ax.plot([r["size_bytes"] / 1e6 for r in front], [r["kld_mean"] for r in front], color="0.3", lw=1, ls="--",
            label="stock Pareto frontier")
    for method, color in (("voodoo", "tab:red"), ("sensitivity", "tab:blue")):
        pts = sorted((r for r in rows if r["method"] == method), key=lambda r: r["size_bytes"])
        if pts:
            ax.plot([r["size_bytes"] / 1e6 for r in pts], [r["kld_mean"] for r in pts], marker="o", color=color,
                    label="Voodoo (gates)" if method == "voodoo" else "sensitivity knapsack")
    ax.axhline(t["floor_kld"], color="0.6", lw=0.8, ls=":", label=f"floor ({t['floor_name']})")
    ax.set_yscale("log")
    ax.set_xlabel("file size (MB)")
    ax.set_ylabel("mean KLD vs F32 teacher (log)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fileio.write_with(out, lambda p: fig.savefig(p, format="png", dpi=120))
    plt.close(fig)
    return Path(out)
