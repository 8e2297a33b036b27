"""bench/quality_report.py: stock Pareto frontier, log-KLD interpolation and the target ratios,
on made-up rows (the benchmark itself runs stock tools for an hour and is not a test)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from voodoo_quant.tools.evaluate import stderr

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def rep():
    spec = importlib.util.spec_from_file_location("quality_report", BENCH / "quality_report.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["quality_report"] = mod
    spec.loader.exec_module(mod)
    return mod


def _row(name, method, size, kld, pct=None, seed=None):
    return {"name": name, "method": method, "size_bytes": size, "kld_mean": kld, "size_percent": pct, "seed": seed,
            "bpw": 4.0, "ppl": 30.0, "kld_p99": 1.0, "kld_p999": 2.0, "same_top_p": 80.0, "kld_stderr": 0.001}


STOCK = [
    _row("s-A", "stock", 90e6, 0.20),
    _row("s-B", "stock", 92e6, 0.25),  # dominated by A (bigger, worse)
    _row("s-C", "stock", 100e6, 0.05),
    _row("s-Q8", "stock", 145e6, 0.01),
]


def test_pareto_drops_dominated_files(rep):
    assert [r["name"] for r in rep.pareto(STOCK)] == ["s-A", "s-C", "s-Q8"]
    same_size = [_row("x", "stock", 90e6, 0.3), _row("y", "stock", 90e6, 0.1)]
    assert [r["name"] for r in rep.pareto(same_size)] == ["y"]


def test_frontier_is_linear_in_log_kld(rep):
    front = rep.pareto(STOCK)
    mid = rep.frontier_kld(front, 95e6)  # halfway between A (0.20) and C (0.05): geometric mean
    assert mid == pytest.approx(math.sqrt(0.20 * 0.05), rel=1e-12)
    assert rep.frontier_kld(front, 90e6) == pytest.approx(0.20)
    assert rep.frontier_kld(front, 89e6) is None and rep.frontier_kld(front, 146e6) is None


def test_targets_ratios_use_seed_means_and_curves(rep):
    rows = STOCK + [
        _row("v60a", "voodoo", 95e6, 0.03, 60, 0), _row("v60b", "voodoo", 95e6, 0.05, 60, 1),  # mean 0.04
        _row("sens55", "sensitivity", 90e6, 0.10, 55), _row("sens65", "sensitivity", 100e6, 0.04, 65),
        _row("pureA", "uniform", 88e6, 0.30), _row("pureB", "uniform", 110e6, 0.03),
        _row("v55", "voodoo", 80e6, 0.15, 55, 0),
    ]
    t = rep.targets(rows, "s-Q8")
    assert t["floor_kld"] == 0.01 and t["frontier"] == ["s-A", "s-C", "s-Q8"]
    small, x = t["sizes"]
    assert small["size_percent"] == 55 and small["ratio_vs_stock"] is None and "below" in small["note"]
    assert x["n_seeds"] == 2 and x["kld_mean"] == pytest.approx(0.04) and x["kld_min"] == 0.03
    assert x["kld_stderr"] == pytest.approx(math.sqrt(2) * 0.001 / 2)
    stock_excess = math.sqrt(0.20 * 0.05) - 0.01
    assert x["ratio_vs_stock"] == pytest.approx(0.03 / stock_excess)
    assert x["meets_stock_target"] is True  # 0.03 / 0.09 ≈ 0.33
    assert x["ratio_vs_sensitivity"] == pytest.approx(0.03 / (math.sqrt(0.10 * 0.04) - 0.01))
    uni = math.exp(math.log(0.30) + (95 - 88) / (110 - 88) * (math.log(0.03) - math.log(0.30)))
    assert x["ratio_vs_uniform"] == pytest.approx(0.03 / (uni - 0.01))
    assert x["falls"] is True and t["monotone"] and not x["above_stock_frontier"]
    md = rep.markdown({"rows": rows, "targets": t, "command": "python bench/quality.py --quick",
                       "setup": {"model": "M", "degrid_seed": 0, "calib_chunks": 8, "ctx": 512, "eval_chunks": 4,
                                 "steps": 5, "seq_len": 256, "menu": ["Q8_0"], "reference_ppl": 40.0,
                                 "seeds": [0, 1], "seed_sizes": [60]}})
    assert "python bench/quality.py --quick" in md and "| Voodoo60 | 95.00 | 0.040000 (0.03000–0.05000, n=2) |" in md


def test_targets_flag_a_size_that_does_not_improve_and_a_point_above_the_frontier(rep):
    rows = STOCK + [_row("v60", "voodoo", 95e6, 0.15, 60, 0), _row("v65", "voodoo", 99e6, 0.16, 65, 0)]
    t = rep.targets(rows, "s-Q8")
    a, b = t["sizes"]
    assert a["above_stock_frontier"] and "ABOVE" in a["note"]
    assert b["falls"] is False and "NOT below Voodoo60" in b["note"] and not t["monotone"]


def test_targets_need_the_floor(rep):
    with pytest.raises(ValueError, match="floor"):
        rep.targets(STOCK[:2], "s-Q8")


def test_plot_writes_png(rep, tmp_path):
    rows = STOCK + [_row("v60", "voodoo", 95e6, 0.04, 60, 0), _row("v60b", "voodoo", 95e6, 0.05, 60, 1)]
    out = rep.plot({"rows": rows, "targets": rep.targets(rows, "s-Q8")}, tmp_path / "p.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- bench/ablation.py: the table of training modes --------------------------------------------

@pytest.fixture(scope="module")
def abl():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("ablation", BENCH / "ablation.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ablation"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_ablation_table_reports_excess_relative_to_the_defaults(abl):
    rows = [
        {"variant": "soft-warm", "size_percent": 55, "size_bytes": 82e6, "kld_mean": 0.105, "steps": 25},
        {"variant": "ptqr", "size_percent": 55, "size_bytes": 81e6, "kld_mean": 0.055, "steps": 25},
        {"variant": "ptqr", "size_percent": 70, "size_bytes": 104e6, "kld_mean": 0.04, "steps": 25},
    ]
    md = abl.markdown({"floor": {"kld_mean": 0.005}, "setup": {}, "command": "cmd", "rows": rows})
    lines = {ln.split(" | ")[0].strip("| "): ln for ln in md.splitlines() if ln.startswith("| ")}
    assert "| ptqr | 25 | 81.00 | 0.0550 | 0.500 | 104.00 | 0.0400 | – |" == lines["ptqr"]  # no default at V70: no ratio
    assert "| 1.000 |" in lines["soft-warm"] and "– | – | –" in lines["soft-warm"]  # V70 default not measured
    # table rows follow the variant list's order, not the measurement order
    assert md.index("| soft-warm |") < md.index("| ptqr |")


def test_ablation_refuses_unknown_variants(abl, tmp_path):
    (tmp_path / "settings.json").write_text("{}")
    with pytest.raises(SystemExit, match="unknown nope"):
        abl.parse(["--base", str(tmp_path), "--variants", "ptqr,nope"])


def test_paired_difference_cancels_the_texts_spread(rep):
    """Two files whose per-chunk KLDs move together (hard and easy chunks) differ by a constant:
    the paired difference resolves it with a standard error far below either file's spread."""
    base = [0.05, 0.20, 0.08, 0.30, 0.11, 0.06]
    knap = {**_row("k", "sensitivity", 89e6, sum(base) / 6, pct=60), "kld_chunks": base}
    v0 = {**_row("v0", "voodoo", 89e6, 0.0, pct=60, seed=0), "kld_chunks": [x - 0.010 for x in base]}
    v1 = {**_row("v1", "voodoo", 89e6, 0.0, pct=60, seed=1), "kld_chunks": [x - 0.012 + 0.001 * (i % 2) for i, x in enumerate(base)]}
    rows = [knap, v0, v1]
    mean = {"size_percent": 60, "names": ["v0", "v1"]}
    d, se = rep.paired_difference(rows, mean, "sensitivity")
    assert d == pytest.approx(-0.01075, abs=1e-12)  # (−0.010 + −0.0115) / 2
    assert se < 0.001 < stderr(base)
    assert rep.paired_difference(rows, {"size_percent": 70, "names": ["v0"]}, "sensitivity") is None
