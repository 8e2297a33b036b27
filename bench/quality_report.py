"""The numbers and the report of ``bench/quality.py``: curves, frontiers, excess-KLD ratios with
their noise, the Markdown table and the PNG plot. Pure functions of the measured rows (no tools
run here), so they are unit-tested on made-up rows (tests/test_bench_quality.py).

A row is a dict with at least ``name``, ``method`` ("stock", "uniform", "voodoo", "sensitivity",
"sensitivity_output"), ``size_bytes`` and ``kld_mean``; the trained methods also carry
``size_percent`` and ``seed``, and every row may carry ``kld_chunks`` (per-chunk mean KLD, from
llama-perplexity's running means) and ``kld_stderr`` (their standard error); both come from
``voodoo_quant.tools.evaluate`` (``chunk_klds``, ``parse_kld_report``).

Comparisons: every Voodoo size is the mean over its seeds (spread shown); its excess
KLD over the Q8_0 floor is divided by the excess of a reference *curve* at the same file size,
linear in log KLD between the curve's two nearest points (no extrapolation): the stock Pareto
frontier (target ≤ 0.5), the one-shot knapsack's curve (≤ 0.75) and the uniform files' frontier
(≤ 1). A Voodoo point above the stock frontier is flagged, and so is a size whose mean KLD does
not fall below the next smaller size's.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any, Sequence

TARGET_VS_STOCK = 0.5
TARGET_VS_SENSITIVITY = 0.75
TARGET_VS_UNIFORM = 1.0
TRAINED = ("voodoo", "sensitivity", "sensitivity_output", "voodoo_gptq", "sensitivity_gptq")
# each gate-trained method against the knapsack of its own candidates (plain or compensated)
VOODOO = (("voodoo", "sensitivity"), ("voodoo_gptq", "sensitivity_gptq"))

def pareto(rows: Sequence[dict]) -> list[dict]:
    """The Pareto-optimal rows by (file size, mean KLD), ascending in size: a file stays when no
    file of the same or smaller size has the same or lower KLD."""
    out: list[dict] = []
    for r in sorted(rows, key=lambda r: (r["size_bytes"], r["kld_mean"])):
        if not out or r["kld_mean"] < out[-1]["kld_mean"]:  # sorted by KLD within a size: the first wins
            out.append(r)
    return out


def frontier_kld(front: Sequence[dict], size: float) -> float | None:
    """Mean KLD of a curve at `size` bytes, linear in log KLD between its two nearest points;
    None outside the curve's size range (no extrapolation)."""
    if not front or size < front[0]["size_bytes"] or size > front[-1]["size_bytes"]:
        return None
    for a, b in zip(front, front[1:]):
        if a["size_bytes"] <= size <= b["size_bytes"]:
            t = (size - a["size_bytes"]) / (b["size_bytes"] - a["size_bytes"])
            la, lb = math.log(max(a["kld_mean"], 1e-12)), math.log(max(b["kld_mean"], 1e-12))
            return math.exp(la + t * (lb - la))
    return float(front[0]["kld_mean"])  # a curve of one point, and size equals its size


def _ratio(num: float, den: float | None) -> float | None:
    if den is None or den <= 0:
        return None
    return num / den


def seed_means(rows: Sequence[dict], method: str) -> list[dict]:
    """One point per size of a trained method: means over seeds of size and KLD, with the spread."""
    by: dict[int, list[dict]] = {}
    for r in rows:
        if r["method"] == method:
            by.setdefault(int(r["size_percent"]), []).append(r)
    out = []
    for pct in sorted(by):
        rs = by[pct]
        klds = [float(r["kld_mean"]) for r in rs]
        errs = [r.get("kld_stderr") for r in rs]
        out.append({
            "size_percent": pct, "method": method, "n_seeds": len(rs), "seeds": [r.get("seed") for r in rs],
            "size_bytes": statistics.fmean(float(r["size_bytes"]) for r in rs), "kld_mean": statistics.fmean(klds),
            "kld_min": min(klds), "kld_max": max(klds),
            "seed_sd": statistics.stdev(klds) if len(klds) >= 2 else None,
            # the eval noise of the seed mean: per-file chunk standard errors, averaged in quadrature / n
            "kld_stderr": (math.sqrt(sum(e * e for e in errs)) / len(errs)) if all(e is not None for e in errs) else None,
            "names": [r["name"] for r in rs],
        })
    return out


def targets(rows: Sequence[dict], floor_name: str) -> dict[str, Any]:
    """Per Voodoo size (seed mean): excess KLD over the floor against the stock frontier, the
    knapsack curve and the uniform frontier at the same file size; monotonicity; flags."""
    by_name = {r["name"]: r for r in rows}
    if floor_name not in by_name:
        raise ValueError(f"the floor file {floor_name} has no measured row")
    floor = float(by_name[floor_name]["kld_mean"])
    front = pareto([r for r in rows if r["method"] == "stock"])
    uni = pareto([r for r in rows if r["method"] in ("uniform", "stock") and _is_uniform(r)])
    knap_out = sorted(seed_means(rows, "sensitivity_output"), key=lambda r: r["size_bytes"])
    plain_knap = sorted(seed_means(rows, "sensitivity"), key=lambda r: r["size_bytes"])
    out = []
    for method, knap_method in VOODOO:
        out += _targets_of(rows, method, knap_method, floor, front, uni, plain_knap, knap_out)
    return {"floor_name": floor_name, "floor_kld": floor, "frontier": [r["name"] for r in front],
            "uniform_frontier": [r["name"] for r in uni], "sizes": out,
            "monotone": all(x["falls"] is not False for x in out)}


def _targets_of(rows, method, knap_method, floor, front, uni, plain_knap, knap_out) -> list[dict]:
    knap = sorted(seed_means(rows, knap_method), key=lambda r: r["size_bytes"])
    out = []
    prev = None
    for v in seed_means(rows, method):
        excess = v["kld_mean"] - floor
        row = {**v, "excess": excess}
        for tag, curve in (("stock", front), ("sensitivity", knap), ("sensitivity_output", knap_out), ("uniform", uni),
                           ("plain_knapsack", plain_knap)):
            k = frontier_kld(curve, v["size_bytes"])
            row[f"{tag}_kld"] = k
            row[f"{tag}_excess"] = None if k is None else k - floor
            row[f"ratio_vs_{tag}"] = None if k is None else _ratio(excess, k - floor)
        row["meets_stock_target"] = None if row["ratio_vs_stock"] is None else row["ratio_vs_stock"] <= TARGET_VS_STOCK
        row["meets_sensitivity_target"] = (None if row["ratio_vs_sensitivity"] is None
                                           else row["ratio_vs_sensitivity"] <= TARGET_VS_SENSITIVITY)
        row["meets_uniform_target"] = None if row["ratio_vs_uniform"] is None else row["ratio_vs_uniform"] <= TARGET_VS_UNIFORM
        row["above_stock_frontier"] = row["stock_kld"] is not None and v["kld_mean"] > row["stock_kld"]
        row["falls"] = None if prev is None else v["kld_mean"] < prev["kld_mean"]
        row["paired_vs_sensitivity"] = paired_difference(rows, v, knap_method)
        notes = []
        if row["stock_kld"] is None and front:
            smallest = front[0]
            if v["size_bytes"] < smallest["size_bytes"]:
                notes.append(f"smaller than every stock file; KLD {'below' if v['kld_mean'] < smallest['kld_mean'] else 'above'} "
                             f"the smallest ({smallest['name']})")
            else:
                notes.append("outside the stock frontier's size range")
        if row["above_stock_frontier"]:
            notes.append("ABOVE the stock frontier")
        if row["falls"] is False:
            notes.append(f"NOT below Voodoo{prev['size_percent']}")
        if knap_method != "sensitivity" and row["ratio_vs_plain_knapsack"] is not None:
            notes.append(f"{row['ratio_vs_plain_knapsack']:.3f}× the plain Fisher knapsack's excess")
        row["note"] = "; ".join(notes)
        out.append(row)
        prev = v
    return out


def paired_difference(rows: Sequence[dict], v: dict, method: str) -> tuple[float, float] | None:
    """(mean, standard error) of Voodoo's per-chunk KLD (its seeds averaged chunk by chunk) minus
    `method`'s at the same size percent: both scored on the same chunks, so the text's own
    chunk-to-chunk spread cancels and the difference is resolved far below either file's ±."""
    ref = [r for r in rows if r["method"] == method and r.get("size_percent") == v["size_percent"]]
    by_name = {r["name"]: r for r in rows}
    mine = [by_name[n].get("kld_chunks") or [] for n in v["names"]]
    if not ref or not mine or not ref[0].get("kld_chunks"):
        return None
    n = min(len(ref[0]["kld_chunks"]), *(len(c) for c in mine))
    if n < 2:
        return None
    d = [statistics.fmean(c[i] for c in mine) - ref[0]["kld_chunks"][i] for i in range(n)]
    return statistics.fmean(d), statistics.stdev(d) / math.sqrt(n)


def _is_uniform(r: dict) -> bool:
    return r["method"] == "uniform" or ".pure-" in r["name"]


# -- Markdown ----------------------------------------------------------------------------------

def _f(v: Any, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def _paired(v) -> str:
    return "—" if not v else f"{v[0]:+.5f} ± {v[1]:.5f}"


def _yes(v: bool | None) -> str:
    return "—" if v is None else ("yes" if v else "no")


def markdown(result: dict[str, Any]) -> str:
    rows, t, s = result["rows"], result["targets"], result["setup"]
    front = set(t["frontier"])
    seeds = s.get("seeds") or [0]
    lines = [
        "# Voodoo vs stock llama.cpp recipes: quality", "",
        "Reproduce:", "", "```", result["command"], "```", "",
        f"- model: {s['model']} (de-gridded teacher, `make-teacher --degrid_seed {s['degrid_seed']}`); "
        f"reference F32 GGUF PPL {_f(s.get('reference_ppl'), '.4f')}, original (gridded Q4_1) GGUF PPL "
        f"{_f(s.get('original_ppl'), '.4f')} on the same text",
        f"- imatrix: stock `llama-imatrix` on {s['calib_chunks']} × {s['ctx']} tokens of the train split "
        "(the same for every method); stock and uniform (`--pure`) files quantized from the de-gridded F32 GGUF",
        f"- eval: stock `llama-perplexity --kl-divergence` vs the F32 teacher, held-out plays (never used to tune "
        f"or to search: the search measures on training sequences held aside), -c {s['ctx']}, {s['eval_chunks']} chunks; "
        "± = standard error of the mean KLD over chunks",
        f"- Voodoo: `voodoo train` defaults (gates and the guarantee; no search unless --train_args asks for one), {s['steps']} steps at seq_len "
        f"{s['seq_len']}, seeds {', '.join(map(str, seeds))} at sizes {', '.join(map(str, s.get('seed_sizes') or [])) or '—'} "
        f"(one seed elsewhere){'; extra flags `' + ' '.join(s.get('train_args') or []) + '`' if s.get('train_args') else ''}; "
        f"menu `{' '.join(s['menu'])}`",
        "- sensitivity = `voodoo train --method sensitivity` (one-shot knapsack on the Fisher ΔKL table, no training); "
        "sensitivity_output = the same on the output-error table (`--sensitivity_kind output`)",
        "",
        "| file | method | size MB | bpw | PPL | KLD mean | ± | KLD p99 | KLD p99.9 | same top % | stock Pareto |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for r in sorted(rows, key=lambda r: r["size_bytes"]):
        lines.append(
            f"| {r['name']} | {r['method']} | {r['size_bytes'] / 1e6:.2f} | {_f(r.get('bpw'), '.3f')} | "
            f"{_f(r.get('ppl'), '.4f')} | {_f(r.get('kld_mean'), '.6f')} | {_f(r.get('kld_stderr'), '.6f')} | "
            f"{_f(r.get('kld_p99'), '.5f')} | {_f(r.get('kld_p999'), '.5f')} | {_f(r.get('same_top_p'), '.3f')} | "
            f"{'✓' if r['name'] in front else ''} |")
    lines += [
        "", f"## Targets (floor: mean KLD of {t['floor_name']} = {t['floor_kld']:.6f})", "",
        "excess = mean KLD − floor; Voodoo = mean over its seeds (min–max shown), ± its eval standard error. Each "
        "ratio divides Voodoo's excess by a curve's excess at the same file size, linear in log KLD between the "
        f"curve's two nearest files: stock Pareto frontier (≤ {TARGET_VS_STOCK}), knapsack (Fisher) curve "
        f"(≤ {TARGET_VS_SENSITIVITY}), uniform (`--pure`) frontier (≤ {TARGET_VS_UNIFORM}). "
        f"Mean KLD falls with every size step: {'yes' if t['monotone'] else 'NO'}.", "",
        "Δ knapsack = Voodoo's KLD minus the Fisher knapsack file's at the same size percent, paired chunk by chunk "
        "(± its standard error).", "",
        "| size | MB | KLD (seeds: min–max) | ± | excess | vs stock | ≤ 0.5 | vs knapsack | ≤ 0.75 | Δ knapsack (paired) "
        "| vs knapsack (output) | vs uniform | ≤ 1 | note |",
        "|---|---:|---:|---:|---:|---:|:---:|---:|:---:|---:|---:|---:|:---:|---|",
    ]
    for x in t["sizes"]:
        spread = f" ({x['kld_min']:.5f}–{x['kld_max']:.5f}, n={x['n_seeds']})" if x["n_seeds"] > 1 else ""
        label = f"Voodoo{x['size_percent']}" + (" gptq" if x["method"].endswith("_gptq") else "")
        lines.append(
            f"| {label} | {x['size_bytes'] / 1e6:.2f} | {x['kld_mean']:.6f}{spread} | "
            f"{_f(x['kld_stderr'], '.6f')} | {x['excess']:.6f} | {_f(x['ratio_vs_stock'], '.3f')} | "
            f"{_yes(x['meets_stock_target'])} | {_f(x['ratio_vs_sensitivity'], '.3f')} | {_yes(x['meets_sensitivity_target'])} | "
            f"{_paired(x.get('paired_vs_sensitivity'))} | {_f(x['ratio_vs_sensitivity_output'], '.3f')} | {_f(x['ratio_vs_uniform'], '.3f')} | "
            f"{_yes(x['meets_uniform_target'])} | {x['note']} |")
    g = [r for r in rows if r["method"] in ("voodoo", "voodoo_gptq") and r.get("guarantee")]
    if g:
        lines += ["", "## What the guarantee and the search did (held-aside calibration KL, not the eval text)", "",
                  "| file | start (winner) | winner KL | gates' bake KL | best reference | search evals | moves kept | "
                  "search's KL | confirmation split: drop ± s.e. | written KL |",
                  "|---|---|---:|---:|---|---:|---:|---:|---|---:|"]
        for r in sorted(g, key=lambda r: (r["size_percent"], r.get("seed") or 0)):
            gg = r["guarantee"]
            cands = {c["name"]: c for c in gg["candidates"]}
            refs = [c for c in gg["candidates"] if not c["name"].startswith("gates")]
            best_ref = min(refs, key=lambda c: c["kl"]) if refs else None
            srch = gg.get("search") or {}
            conf = srch.get("confirm")
            conf_s = (f"{conf['drop']:+.6f} ± {conf['drop_stderr']:.6f} ({'kept' if conf['kept'] else 'start written'})"
                      if conf else "—")
            lines.append(
                f"| {r['name']} | {gg['winner']} | {cands[gg['winner']]['kl']:.6f} | {_f(cands.get('gates', {}).get('kl'), '.6f')} | "
                f"{best_ref['name'] + ' ' + format(best_ref['kl'], '.6f') if best_ref else '—'} | {srch.get('evals', 0)} | "
                f"{len(srch.get('moves', []))} | {_f(srch.get('final_kl'), '.6f')} | {conf_s} | {gg['final_kl']:.6f} |")
    return "\n".join(lines) + "\n"


# -- plot --------------------------------------------------------------------------------------

def plot(result: dict[str, Any], out: Path) -> Path:
    """Mean KLD (log) against file size: stock and uniform files and the stock frontier, the
    Voodoo (seed means, with their spread) and knapsack curves, the Q8_0 floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from voodoo_quant import fileio

    rows, t = result["rows"], result["targets"]
    fig, ax = plt.subplots(figsize=(8, 5))
    for method, color, label in (("stock", "0.55", "stock llama-quantize"), ("uniform", "tab:green", "uniform (--pure)")):
        pts = [r for r in rows if r["method"] == method]
        if not pts:
            continue
        ax.scatter([r["size_bytes"] / 1e6 for r in pts], [r["kld_mean"] for r in pts], color=color, s=18, label=label)
        for r in pts:
            ax.annotate(r["name"].split(f"{'stock' if method == 'stock' else 'pure'}-")[-1].removesuffix(".gguf"),
                        (r["size_bytes"] / 1e6, r["kld_mean"]), fontsize=6, color="0.35", xytext=(3, 2),
                        textcoords="offset points")
    front = pareto([r for r in rows if r["method"] == "stock"])
    ax.plot([r["size_bytes"] / 1e6 for r in front], [r["kld_mean"] for r in front], color="0.3", lw=1, ls="--",
            label="stock Pareto frontier")
    for method, color, label in (("voodoo", "tab:red", "Voodoo (seed mean)"), ("sensitivity", "tab:blue", "knapsack (Fisher)"),
                                 ("sensitivity_output", "tab:purple", "knapsack (output error)"),
                                 ("voodoo_gptq", "tab:orange", "Voodoo, --error_compensation gptq"),
                                 ("sensitivity_gptq", "tab:cyan", "knapsack (Fisher), gptq")):
        pts = sorted(seed_means(rows, method), key=lambda r: r["size_bytes"])
        if not pts:
            continue
        xs = [r["size_bytes"] / 1e6 for r in pts]
        ax.plot(xs, [r["kld_mean"] for r in pts], marker="o", ms=3, color=color, label=label)
        if any(r["n_seeds"] > 1 for r in pts):
            ax.vlines(xs, [r["kld_min"] for r in pts], [r["kld_max"] for r in pts], color=color, lw=2, alpha=0.5)
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
