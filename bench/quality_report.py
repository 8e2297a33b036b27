"""The report of ``bench/quality.py``, from its JSON lines alone: curves, frontiers, excess-KLD
ratios with their noise, the Markdown tables and the PNG plot. Pure functions of the rows (no
tool runs here), unit-tested on made-up rows (tests/test_bench_quality.py).

A row (``quality.py``: one file on one eval text) has ``name``, ``method`` ("stock", "uniform",
"voodoo", "knapsack", "knapsack-gptq-<walk>"; rows named "knapsack-gptq" are read as
"knapsack-gptq-<walk>" from the walk their config records: :func:`by_walk`), ``calib`` and ``text`` (the calibration domains and the
eval text), ``size_bytes``, ``kld_mean``, ``kld_stderr`` (standard error over chunks),
``kld_chunks`` (each chunk's mean KLD, for paired differences); stock and uniform rows have
``recipe``, the others ``size`` (percent of uniform Q8_0), the written file (voodoo) also
``steps`` and ``seed``, a knapsack ``seed`` where it was made at another than the default (none:
the default seed). A peer's rows (``autoround.py``: method "autoround") have ``format`` (its
GGUF format, q4_k_m) and ``iters`` (0: its optimized RTN); they are listed and plotted beside ours
and enter no curve. Rows with the same ``digest`` are one measurement: the last counts.

Per (calibration, eval text): each size of the written file is the mean over its seeds (spread
shown) at the step count measured at the most sizes, and so is each size of a knapsack (its file at
the default seed alone where no other was made); the written file's excess KLD over the Q8_0 floor is divided
by the excess of a reference curve at the same file size, linear in log KLD between the curve's
two nearest points (no extrapolation): the stock Pareto frontier (target ≤ 0.5), the compensated
knapsack of the written file's walk (the learned stage's target: ≤ 0.85 at 25–45), the plain Fisher knapsack and the uniform
files' frontier. A point above the stock frontier is flagged, and so is a size whose mean KLD does
not fall below the next smaller size's.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any, Sequence

FLOOR = "Q8_0"
TARGET_VS_STOCK = 0.5
TARGET_VS_KNAPSACK = 0.85
LEARNED_SIZES = (25, 30, 35, 40, 45)  # where the learned stage's target applies
# the compensation walks a row may name (quality_plan.WALKS, and the older "fixed"), the product's default first
WALKS = ("packed", "ruled", "fixed")
# the knapsacks: plain, then compensated by each walk (and "knapsack-gptq": a row that records no walk)
KNAPSACKS = ("knapsack", *(f"knapsack-gptq-{w}" for w in WALKS), "knapsack-gptq")
PEERS = {"autoround": "tab:purple"}  # other quantizers' files (autoround.py): method → plot colour


def latest(rows: Sequence[dict]) -> list[dict]:
    """One row per digest, the last written (a row measured again replaces the earlier one), each
    compensated knapsack named by its walk (:func:`by_walk`)."""
    by: dict[Any, dict] = {}
    for i, r in enumerate(rows):
        by[r.get("digest", i)] = r
    return [by_walk(r) for r in by.values()]


def walk(r: dict) -> str | None:
    """The compensation walk a trained row's file was made with (its config), None for none."""
    train = (r.get("config") or {}).get("train") or {}
    return None if train.get("error_compensation") == "none" else train.get("compensation_sweep")


def by_walk(r: dict) -> dict:
    """A row of the method "knapsack-gptq" (made as the product's default walk of its day) named
    "knapsack-gptq-<walk>" by the walk its config records."""
    w = walk(r) if r.get("method") == "knapsack-gptq" else None
    return {**r, "method": f"knapsack-gptq-{w}"} if w else r


def compensated(rows: Sequence[dict]) -> str:
    """The compensated knapsack the written file is measured against: the one of its own walk (the
    walk most of its rows record), else the product's default walk's, else a compensated knapsack
    whose walk is not recorded."""
    ws = [walk(r) for r in rows if r["method"] == "voodoo" and walk(r)]
    own = [f"knapsack-gptq-{max(sorted(set(ws)), key=ws.count)}"] if ws else []
    have = {r["method"] for r in rows}
    return next((m for m in (*own, f"knapsack-gptq-{WALKS[0]}", "knapsack-gptq") if m in have), (own or ["knapsack-gptq"])[0])


def groups(rows: Sequence[dict]) -> dict[tuple[str, str], list[dict]]:
    """Rows by (calibration, eval text), the calibration with the most rows first."""
    out: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        out.setdefault((r.get("calib", "?"), r.get("text", "?")), []).append(r)
    count = {c: sum(len(v) for (cc, _), v in out.items() if cc == c) for c, _ in out}
    return dict(sorted(out.items(), key=lambda kv: (-count[kv[0][0]], kv[0])))


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


def main_steps(rows: Sequence[dict]) -> int | None:
    """The written file's step count measured at the most sizes (the others are the fair test's)."""
    sizes: dict[int, set] = {}
    for r in rows:
        if r["method"] == "voodoo":
            sizes.setdefault(r.get("steps"), set()).add(r["size"])
    return max(sizes, key=lambda s: (len(sizes[s]), s or 0)) if sizes else None


def curve(rows: Sequence[dict], method: str, steps: int | None = None) -> list[dict]:
    """One point per size of a trained method (at `steps`): means over seeds, with the spread."""
    by: dict[int, list[dict]] = {}
    for r in rows:
        if r["method"] == method and (steps is None or r.get("steps") == steps):
            by.setdefault(int(r["size"]), []).append(r)
    out = []
    for size in sorted(by):
        rs = sorted(by[size], key=lambda r: r.get("seed") or 0)
        klds = [float(r["kld_mean"]) for r in rs]
        errs = [r.get("kld_stderr") for r in rs]
        out.append({
            "size": size, "method": method, "steps": steps, "n_seeds": len(rs), "seeds": [r.get("seed") for r in rs],
            "size_bytes": statistics.fmean(float(r["size_bytes"]) for r in rs), "kld_mean": statistics.fmean(klds),
            "kld_min": min(klds), "kld_max": max(klds),
            # the eval noise of the seed mean: the files' chunk standard errors in quadrature / n
            "kld_stderr": math.sqrt(sum(e * e for e in errs)) / len(errs) if all(e is not None for e in errs) else None,
            "chunks": _mean_chunks(rs), "made_by": [r.get("made_by") for r in rs],
        })
    return sorted(out, key=lambda p: p["size_bytes"])


def _mean_chunks(rs: Sequence[dict]) -> list[float]:
    cs = [r.get("kld_chunks") or [] for r in rs]
    n = min(len(c) for c in cs) if cs else 0
    return [statistics.fmean(c[i] for c in cs) for i in range(n)]


def paired(a: Sequence[float], b: Sequence[float]) -> tuple[float, float] | None:
    """(mean, standard error) of a − b chunk by chunk: both files scored on the same chunks, so the
    text's own chunk-to-chunk spread cancels and the difference is resolved far below either ±."""
    n = min(len(a), len(b))
    if n < 2:
        return None
    d = [a[i] - b[i] for i in range(n)]
    return statistics.fmean(d), statistics.stdev(d) / math.sqrt(n)


def floor_row(rows: Sequence[dict]) -> dict:
    f = [r for r in rows if r["method"] == "stock" and r.get("recipe") == FLOOR]
    if not f:
        raise ValueError(f"the floor ({FLOOR}) has no measured row")
    return f[-1]


def targets(rows: Sequence[dict]) -> dict[str, Any]:
    """For the rows of one (calibration, eval text): per size of the written file, its excess KLD
    over the floor against each reference curve at the same file size; monotonicity; flags."""
    floor = float(floor_row(rows)["kld_mean"])
    ref = {"stock": pareto([r for r in rows if r["method"] == "stock"]),
           "uniform": pareto([r for r in rows if r["method"] == "uniform" or r.get("recipe") == FLOOR]),
           "compensated": curve(rows, compensated(rows)), "knapsack": curve(rows, "knapsack")}
    steps = main_steps(rows)
    out, prev = [], None
    for v in curve(rows, "voodoo", steps):
        x = {**v, "excess": v["kld_mean"] - floor}
        for tag, c in ref.items():
            k = frontier_kld(c, v["size_bytes"])
            x[f"{tag}_kld"] = k
            x[f"ratio_vs_{tag}"] = None if k is None or k - floor <= 0 else x["excess"] / (k - floor)
        same = [p for p in ref["compensated"] if p["size"] == v["size"]]
        x["paired_vs_knapsack"] = paired(v["chunks"], same[0]["chunks"]) if same else None
        x["meets_stock"] = None if x["ratio_vs_stock"] is None else x["ratio_vs_stock"] <= TARGET_VS_STOCK
        x["meets_knapsack"] = (None if x["ratio_vs_compensated"] is None or v["size"] not in LEARNED_SIZES
                               else x["ratio_vs_compensated"] <= TARGET_VS_KNAPSACK)
        x["above_stock"] = x["stock_kld"] is not None and v["kld_mean"] > x["stock_kld"]
        x["falls"] = None if prev is None else v["kld_mean"] < prev["kld_mean"]
        notes = []
        if x["stock_kld"] is None and ref["stock"]:
            smallest = ref["stock"][0]
            if v["size_bytes"] < smallest["size_bytes"]:
                # smaller than stock's smallest file: the target is to beat that file outright
                # (a smaller file with a lower KLD); the larger stock files' KLDs are no bar here
                below = v["kld_mean"] < smallest["kld_mean"]
                notes.append(f"smaller than every stock file; KLD {'below' if below else 'NOT below'} the smallest's "
                             f"({_label(smallest)}, {smallest['kld_mean']:.4f})")
            else:
                notes.append("outside the stock frontier's size range")
        if x["above_stock"]:
            notes.append("ABOVE the stock frontier")
        if x["falls"] is False:
            notes.append(f"NOT below Voodoo{prev['size']}")
        x["note"] = "; ".join(notes)
        out.append(x)
        prev = v
    return {"floor": floor, "steps": steps, "frontier": [r["name"] for r in ref["stock"]], "sizes": out,
            "compensated": compensated(rows),
            "monotone": all(x["falls"] is not False for x in out)}


def knapsacks(rows: Sequence[dict]) -> list[dict]:
    """Each knapsack's point per size (compensated, plain), its excess against the stock frontier's
    at the same file size: the selection's share of the written file's gain, with no gates."""
    floor = float(floor_row(rows)["kld_mean"])
    front = pareto([r for r in rows if r["method"] == "stock"])
    out = []
    for method in KNAPSACKS:
        for v in curve(rows, method):
            k = frontier_kld(front, v["size_bytes"])
            excess = v["kld_mean"] - floor
            note = ""
            if k is None and front:
                side = "smaller" if v["size_bytes"] < front[0]["size_bytes"] else "larger"
                low = min(front, key=lambda r: abs(r["size_bytes"] - v["size_bytes"]))
                note = (f"{side} than every stock file; KLD {'below' if v['kld_mean'] < low['kld_mean'] else 'NOT below'} "
                        f"the nearest's; excess {excess / (low['kld_mean'] - floor):.3f}× the nearest "
                        f"({_label(low)}, {low['size_bytes'] / 1e6:.1f} MB)")
            out.append({**v, "excess": excess, "stock_kld": k, "note": note,
                        "ratio_vs_stock": None if k is None or k - floor <= 0 else excess / (k - floor)})
    return out


def walks(rows: Sequence[dict]) -> list[dict]:
    """Per size where both were measured: the compensated knapsack of each other walk against the
    default walk's (WALKS[0]; the same selection method, only the candidates' walk differs)."""
    floor = float(floor_row(rows)["kld_mean"])
    base = {p["size"]: p for p in curve(rows, f"knapsack-gptq-{WALKS[0]}")}
    out = []
    for w in WALKS[1:]:
        for p in curve(rows, f"knapsack-gptq-{w}"):
            b = base.get(p["size"])
            if b is None:
                continue
            out.append({"size": p["size"], "walk": w, "mb": (b["size_bytes"] / 1e6, p["size_bytes"] / 1e6),
                        "kld": (b["kld_mean"], p["kld_mean"]), "paired": paired(p["chunks"], b["chunks"]),
                        "excess_ratio": None if b["kld_mean"] <= floor else (p["kld_mean"] - floor) / (b["kld_mean"] - floor)})
    return out


def fair(rows: Sequence[dict]) -> list[dict]:
    """The written file at the sizes measured with more than one step count or seed: per step
    count the seed mean, its excess against the compensated knapsack's and the paired difference."""
    floor = float(floor_row(rows)["kld_mean"])
    knap = {p["size"]: p for p in curve(rows, compensated(rows))}
    combos: dict[int, set] = {}
    for r in rows:
        if r["method"] == "voodoo":
            combos.setdefault(r["size"], set()).add((r.get("steps"), r.get("seed")))
    out = []
    for size in sorted(s for s, c in combos.items() if len(c) > 1):
        for steps in sorted({st for st, _ in combos[size]}, key=lambda s: s or 0):
            (v,) = [p for p in curve(rows, "voodoo", steps) if p["size"] == size]
            k = knap.get(size)
            out.append({**v, "vs_knapsack": None if k is None or k["kld_mean"] <= floor
                        else (v["kld_mean"] - floor) / (k["kld_mean"] - floor),
                        "paired_vs_knapsack": paired(v["chunks"], k["chunks"]) if k else None})
    return out


# -- Markdown ----------------------------------------------------------------------------------

def _f(v: Any, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def _pm(v) -> str:
    return "—" if not v else f"{v[0]:+.5f} ± {v[1]:.5f}"


def _seeds(x: dict) -> str:
    """A curve point's spread over its seeds, where it has more than one."""
    return f" ({x['kld_min']:.5f}–{x['kld_max']:.5f}, n={x['n_seeds']})" if x["n_seeds"] > 1 else ""


def _yes(v: bool | None) -> str:
    return "—" if v is None else ("yes" if v else "no")


def peer_label(r: dict) -> str:
    """A peer's file: ``autoround-q4_k_m``, its tuned mode ``autoround-q4_k_m (iters 200)``."""
    return f"{r['method']}-{r['format']}" + (f" (iters {r['iters']})" if r.get("iters") else "")


def _label(r: dict) -> str:
    if r["method"] in ("stock", "uniform"):
        return f"{r['method']} {r['recipe']}"
    if r["method"] in PEERS:
        return peer_label(r)
    if r["method"] == "voodoo":
        return f"Voodoo{r['size']} voodoo ({r.get('steps')} steps, seed {r.get('seed')})"
    return f"Voodoo{r['size']} {r['method']}" + (f" (seed {r['seed']})" if r.get("seed") is not None else "")


def markdown(rows: Sequence[dict], costs: Sequence[dict] = (), plot_name: str | None = None) -> str:
    rows = latest(rows)
    last = max(rows, key=lambda r: r.get("date", ""))
    v = last.get("versions", {})
    lines = [f"# {last.get('model', 'model')}: Voodoo vs stock llama.cpp recipes", "",
             f"Rendered by `bench/quality.py report` from {len(rows)} rows of "
             f"{len({r.get('session') for r in rows})} session(s); latest code {v.get('voodoo_quant', '?')[:12]}, "
             f"llama.cpp {v.get('llama.cpp', '?')[:12]}. The latest command:", "", "```", last.get("command", "?"), "```", "",
             f"KLD: stock `llama-perplexity --kl-divergence` against the F32 reference, -c {last.get('config', {}).get('eval', {}).get('ctx', '?')} "
             f"× {last.get('n_chunks', '?')} chunks of held-out text of each domain (files never in the calibration "
             "text); ± the standard error over chunks. Excess = KLD − the Q8_0 floor; each ratio divides the "
             "written file's excess by a curve's at the same file size (log-linear between its two nearest files).", ""]
    if plot_name:
        lines += [f"![KLD vs file size]({plot_name})", ""]
    for (calib, text), rs in groups(rows).items():
        lines += _group(calib, text, rs)
    lines += _transfer(rows) + _costs(costs)
    return "\n".join(lines) + "\n"


def _group(calib: str, text: str, rs: list[dict]) -> list[str]:
    out = [f"## Calibration {calib}, eval text {text}", ""]
    try:
        t = targets(rs)
    except ValueError as e:
        return out + [f"({e})", ""]
    front = set(t["frontier"])
    out += ["| file | made by | MB | bpw | PPL | KLD | ± | KLD p99 | same top % | stock Pareto |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for r in sorted(rs, key=lambda r: r["size_bytes"]):
        out.append(f"| {_label(r)} | {r.get('made_by') or ''} | {r['size_bytes'] / 1e6:.2f} | {_f(r.get('bpw'), '.3f')} | "
                   f"{_f(r.get('ppl'), '.4f')} | {r['kld_mean']:.6f} | {_f(r.get('kld_stderr'), '.6f')} | "
                   f"{_f(r.get('kld_p99'), '.5f')} | {_f(r.get('same_top_p'), '.2f')} | {'✓' if r['name'] in front else ''} |")
    out += ["", f"Floor {t['floor']:.6f}; " + (f"the written file at {t['steps']} steps (seed mean). " if t["sizes"] else "no written file yet. ") + f"Mean KLD falls with "
            f"every size: {'yes' if t['monotone'] else 'NO'}. Targets: ≤ {TARGET_VS_STOCK} of the stock frontier's "
            f"excess; ≤ {TARGET_VS_KNAPSACK} of the compensated knapsack's ({t['compensated']}) at "
            f"{LEARNED_SIZES[0]}–{LEARNED_SIZES[-1]}.", "",
            "| size | MB | KLD (seeds) | ± | excess | vs stock | ≤ 0.5 | vs compensated knapsack | ≤ 0.85 | "
            "− compensated knapsack, paired | vs Fisher knapsack | vs uniform | note |",
            "|---|---:|---:|---:|---:|---:|:---:|---:|:---:|---:|---:|---:|---|"]
    for x in t["sizes"]:
        out.append(f"| Voodoo{x['size']} | {x['size_bytes'] / 1e6:.2f} | {x['kld_mean']:.6f}{_seeds(x)} | "
                   f"{_f(x['kld_stderr'], '.6f')} | {x['excess']:.6f} | {_f(x['ratio_vs_stock'], '.3f')} | "
                   f"{_yes(x['meets_stock'])} | {_f(x['ratio_vs_compensated'], '.3f')} | {_yes(x['meets_knapsack'])} | "
                   f"{_pm(x['paired_vs_knapsack'])} | {_f(x['ratio_vs_knapsack'], '.3f')} | {_f(x['ratio_vs_uniform'], '.3f')} | "
                   f"{x['note']} |")
    ks = knapsacks(rs)
    if ks:
        out += ["", "The knapsacks alone (no gates), against the stock frontier at the same file size:", "",
                "| file | MB | KLD | ± | excess | stock frontier's KLD there | vs stock | note |", "|---|---:|---:|---:|---:|---:|---:|---|"]
        for x in ks:
            out.append(f"| Voodoo{x['size']} {x['method']} | {x['size_bytes'] / 1e6:.2f} | "
                       f"{x['kld_mean']:.6f}{_seeds(x)} | {_f(x['kld_stderr'], '.6f')} | {x['excess']:.6f} | "
                       f"{_f(x['stock_kld'], '.6f')} | {_f(x['ratio_vs_stock'], '.3f')} | {x['note']} |")
    w = walks(rs)
    if w:
        d = WALKS[0]
        out += ["", f"The compensation walks: the compensated knapsack of each other walk against the default "
                f"walk's ({d}), paired chunk by chunk:", "",
                f"| size | walk | MB {d} / walk | KLD {d} | KLD walk | walk − {d}, paired | excess walk ÷ {d} |",
                "|---|---|---:|---:|---:|---:|---:|"]
        for x in w:
            out.append(f"| Voodoo{x['size']} | {x['walk']} | {x['mb'][0]:.2f} / {x['mb'][1]:.2f} | {x['kld'][0]:.6f} | "
                       f"{x['kld'][1]:.6f} | {_pm(x['paired'])} | {_f(x['excess_ratio'], '.3f')} |")
    f = fair(rs)
    if f:
        out += ["", "The learned stage at more step counts and seeds (excess as a multiple of the compensated "
                "knapsack's; the paired difference chunk by chunk):", "",
                "| size | steps | seeds | KLD (min–max) | ± | vs compensated knapsack | − compensated knapsack, paired | made by |",
                "|---|---:|---|---:|---:|---:|---:|---|"]
        for x in f:
            out.append(f"| Voodoo{x['size']} | {x['steps']} | {', '.join(map(str, x['seeds']))} | {x['kld_mean']:.6f} "
                       f"({x['kld_min']:.5f}–{x['kld_max']:.5f}) | {_f(x['kld_stderr'], '.6f')} | "
                       f"{_f(x['vs_knapsack'], '.3f')} | {_pm(x['paired_vs_knapsack'])} | "
                       f"{', '.join(str(m) for m in x['made_by'])} |")
    return out + [""]


def _transfer(rows: Sequence[dict]) -> list[str]:
    """Each file's excess (the written file's, each knapsack's) against the stock frontier of the
    same calibration, per eval text: how much of the gain over stock travels to the domain the
    calibration did not see."""
    by = groups(rows)
    if len({c for c, _ in by}) < 2:
        return []
    texts = sorted({t for _, t in by})
    out = ["## Transfer: each file's excess as a multiple of the stock frontier's", "",
           "| calibration | file | " + " | ".join(f"on {t}" for t in texts) + " |",
           "|---|---|" + "---:|" * len(texts)]
    for calib in dict.fromkeys(c for c, _ in by):
        per: dict[str, dict[tuple[str, Any], float | None]] = {}
        for t in texts:
            per[t] = {}
            rs = by.get((calib, t), [])
            try:
                per[t].update({("voodoo", x["size"]): x["ratio_vs_stock"] for x in targets(rs)["sizes"]})
                per[t].update({(x["method"], x["size"]): x["ratio_vs_stock"] for x in knapsacks(rs)})
            except ValueError:
                pass
        order = ("voodoo",) + KNAPSACKS
        for m, size in sorted({k for d in per.values() for k in d}, key=lambda k: (order.index(k[0]), k[1])):
            name = "Voodoo" + str(size) + ("" if m == "voodoo" else f" {m}")
            out.append(f"| {calib} | {name} | " + " | ".join(_f(per[t].get((m, size)), ".3f") for t in texts) + " |")
    return out + [""]


def _costs(costs: Sequence[dict]) -> list[str]:
    """Each step of the latest session: wall time and peak RSS (the process's so far, and the
    largest finished stock tool's)."""
    if not costs:
        return []
    last = max(costs, key=lambda c: c.get("date", "")).get("session")
    rs = [c for c in costs if c.get("session") == last]
    out = [f"## Cost (session {last}, {rs[0].get('cpus', '?')} CPUs)", "",
           "Peak RSS is the process's largest so far (it runs the ladder's steps in process). A child started "
           "from it begins at the parent's resident size (Linux keeps the peak across fork and exec), so the "
           "stock tools' column is an upper bound, not their own peak.", "",
           "| step | file | seconds | peak RSS MB (this process) | peak RSS MB (stock tools, at most) |", "|---|---|---:|---:|---:|"]
    for c in rs:
        m = c.get("peak_rss_mb") or {}
        out.append(f"| {c['step']} | {c.get('item') or ''} | {_f(c.get('seconds'), '.1f')} | "
                   f"{_f(m.get('self'), '.0f')} | {_f(m.get('children'), '.0f')} |" + (f" {c['error']}" if c.get("error") else ""))
    return out + [""]


# -- plot --------------------------------------------------------------------------------------

def plot(rows: Sequence[dict], out: Path) -> Path:
    """Mean KLD (log) against file size, one panel per eval text of the main calibration: stock
    files and their frontier, uniform files, the written file (seed means, spread), the
    knapsacks, the peers' files, the Q8_0 floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from voodoo_quant.core import fileio

    by = groups(latest(rows))
    calib = next(iter(by))[0]
    panels = [(t, rs) for (c, t), rs in by.items() if c == calib]
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), 5), squeeze=False)
    for ax, (text, rs) in zip(axes[0], panels):
        for method, color in (("stock", "0.55"), ("uniform", "tab:green")):
            pts = [r for r in rs if r["method"] == method]
            ax.scatter([r["size_bytes"] / 1e6 for r in pts], [r["kld_mean"] for r in pts], color=color, s=16,
                       label=f"{method} llama-quantize" + (" --pure" if method == "uniform" else ""))
            for r in pts:
                ax.annotate(r["recipe"], (r["size_bytes"] / 1e6, r["kld_mean"]), fontsize=6, color="0.35",
                            xytext=(3, 2), textcoords="offset points")
        front = pareto([r for r in rs if r["method"] == "stock"])
        ax.plot([r["size_bytes"] / 1e6 for r in front], [r["kld_mean"] for r in front], color="0.3", lw=1, ls="--",
                label="stock Pareto frontier")
        for method, color, label, steps in (
                ("voodoo", "tab:red", "Voodoo: the written file (seed mean)", main_steps(rs)),
                ("knapsack", "tab:blue", "Fisher knapsack", None),
                *((f"knapsack-gptq-{w}", c, f"compensated knapsack, {w} walk", None)
                  for w, c in zip(WALKS, ("tab:cyan", "tab:olive", "tab:brown"))),
                ("knapsack-gptq", "tab:gray", "compensated knapsack (walk not recorded)", None)):
            pts = curve(rs, method, steps)
            if pts:
                xs = [p["size_bytes"] / 1e6 for p in pts]
                ax.plot(xs, [p["kld_mean"] for p in pts], marker="o", ms=3, color=color, label=label)
                ax.vlines(xs, [p["kld_min"] for p in pts], [p["kld_max"] for p in pts], color=color, lw=2, alpha=0.5)
        for method, color in PEERS.items():
            pts = [r for r in rs if r["method"] == method]
            if pts:
                ax.scatter([r["size_bytes"] / 1e6 for r in pts], [r["kld_mean"] for r in pts], color=color, s=22,
                           marker="D", label=f"{method} (its GGUF export)")
            for r in pts:
                ax.annotate(peer_label(r).removeprefix(f"{method}-"), (r["size_bytes"] / 1e6, r["kld_mean"]),
                            fontsize=6, color=color, xytext=(3, -8), textcoords="offset points")
        try:
            ax.axhline(floor_row(rs)["kld_mean"], color="0.6", lw=0.8, ls=":", label=f"floor ({FLOOR})")
        except ValueError:
            pass
        ax.set_yscale("log")
        ax.set_title(f"eval: {text} (calibration: {calib})", fontsize=9)
        ax.set_xlabel("file size (MB)")
        ax.set_ylabel("mean KLD vs F32 reference (log)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fileio.write_with(out, lambda p: fig.savefig(p, format="png", dpi=110))
    plt.close(fig)
    return Path(out)


def write(rows: Sequence[dict], costs: Sequence[dict], md: Path, png: Path) -> Path:
    """The Markdown report and its plot, beside each other."""
    from voodoo_quant.core import fileio

    plot(rows, png)
    return fileio.write_text(md, markdown(rows, costs, png.name))
