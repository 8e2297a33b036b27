"""bench/quality_report.py and bench/quality_compare.py: the report's numbers (frontier, log-KLD
interpolation, target ratios, seed means, paired differences) and the pairing of two results
files, checked on made-up rows (the driver itself: test_bench_quality.py).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from voodoo_quant.tools.evaluate import stderr

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from bench_modules import bench_module as _bench  # noqa: E402


@pytest.fixture(scope="module")
def rep():
    return _bench("quality_report")


def _row(name, method, size_bytes, kld, *, size=None, seed=None, steps=None, recipe=None, text="plays",
         calib="plays+python", chunks=None):
    return {"digest": f"{name}-{text}-{calib}", "name": name, "method": method, "size_bytes": size_bytes,
            "kld_mean": kld, "size": size, "seed": seed, "steps": steps, "recipe": recipe, "text": text, "calib": calib,
            "bpw": 4.0, "ppl": 30.0, "kld_p99": 1.0, "same_top_p": 80.0, "kld_stderr": 0.001,
            "kld_chunks": chunks or [], "session": "s", "date": "2026-12-05T00:00:00+00:00"}


STOCK = [
    _row("s-A", "stock", 90e6, 0.20, recipe="IQ2_M"),
    _row("s-B", "stock", 92e6, 0.25, recipe="Q2_K"),  # dominated by A (bigger, worse)
    _row("s-C", "stock", 100e6, 0.05, recipe="Q4_K_M"),
    _row("s-Q8", "stock", 145e6, 0.01, recipe="Q8_0"),
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
        _row("v35a", "voodoo", 95e6, 0.03, size=35, seed=0, steps=50),
        _row("v35b", "voodoo", 95e6, 0.05, size=35, seed=1, steps=50),  # mean 0.04
        _row("k30", "knapsack-gptq", 90e6, 0.10, size=30), _row("k40", "knapsack-gptq", 100e6, 0.04, size=40),
        _row("pureA", "uniform", 88e6, 0.30, recipe="Q3_K_S"), _row("pureB", "uniform", 110e6, 0.03, recipe="Q4_K_S"),
        _row("v30", "voodoo", 80e6, 0.15, size=30, seed=0, steps=50),
    ]
    t = rep.targets(rows)
    assert t["floor"] == 0.01 and t["frontier"] == ["s-A", "s-C", "s-Q8"] and t["steps"] == 50
    small, x = t["sizes"]
    assert small["size"] == 30 and small["ratio_vs_stock"] is None
    assert "KLD below the smallest's (stock IQ2_M, 0.2000)" in small["note"]  # 0.15 < s-A's 0.20
    assert x["n_seeds"] == 2 and x["kld_mean"] == pytest.approx(0.04) and x["kld_min"] == 0.03
    assert x["kld_stderr"] == pytest.approx(math.sqrt(2) * 0.001 / 2)
    assert x["ratio_vs_stock"] == pytest.approx(0.03 / (math.sqrt(0.20 * 0.05) - 0.01))
    assert x["meets_stock"] is True  # 0.03 / 0.09 ≈ 0.33
    assert x["ratio_vs_compensated"] == pytest.approx(0.03 / (math.sqrt(0.10 * 0.04) - 0.01))
    assert x["meets_knapsack"] is True  # 0.03 / 0.053 ≈ 0.57 at Voodoo35, where the learned stage's target holds
    assert x["ratio_vs_knapsack"] is None  # no plain knapsack measured
    # the uniform frontier holds the floor (Q8_0 is uniform) beside the --pure files
    uni = math.exp(math.log(0.30) + (95 - 88) / (110 - 88) * (math.log(0.03) - math.log(0.30)))
    assert x["ratio_vs_uniform"] == pytest.approx(0.03 / (uni - 0.01))
    assert x["falls"] is True and t["monotone"] and not x["above_stock"]


def test_the_knapsacks_alone_are_set_against_the_stock_frontier(rep):
    rows = STOCK + [_row("k35", "knapsack-gptq", 95e6, 0.04, size=35), _row("p35", "knapsack", 95e6, 0.06, size=35),
                    _row("p25", "knapsack", 85e6, 0.15, size=25), _row("p20", "knapsack", 80e6, 0.30, size=20)]
    got = {(x["method"], x["size"]): x for x in rep.knapsacks(rows)}
    mid = math.sqrt(0.20 * 0.05)
    assert got[("knapsack-gptq", 35)]["ratio_vs_stock"] == pytest.approx(0.03 / (mid - 0.01))
    assert got[("knapsack", 35)]["ratio_vs_stock"] == pytest.approx(0.05 / (mid - 0.01))
    small = got[("knapsack", 25)]  # below stock's smallest file (s-A, 0.20): beats it, and says by how much
    assert small["ratio_vs_stock"] is None and "; KLD below the nearest's" in small["note"]
    assert "0.737× the nearest (stock IQ2_M, 90.0 MB)" in small["note"]  # 0.14 / 0.19
    assert "KLD NOT below the nearest's" in got[("knapsack", 20)]["note"]


def test_the_two_compensation_walks_are_set_side_by_side_paired(rep):
    base = [0.05, 0.20, 0.08, 0.30]
    rows = STOCK + [_row("k30", "knapsack-gptq-ruled", 89e6, sum(base) / 4, size=30, chunks=base),
                    _row("w30", "knapsack-gptq-packed", 88e6, sum(base) / 4 + 0.002, size=30,
                         chunks=[x + 0.002 + 0.0005 * (i % 2) for i, x in enumerate(base)]),
                    _row("w40", "knapsack-gptq-packed", 99e6, 0.05, size=40)]
    (x,) = rep.walks(rows)  # 40 has no ruled-walk file to pair with
    assert x["size"] == 30 and x["walk"] == "ruled" and x["mb"] == (88.0, 89.0)
    d, se = x["paired"]  # ruled − packed (the default walk)
    assert d == pytest.approx(-0.00225) and 0 < se < 0.001
    assert x["excess_ratio"] == pytest.approx((sum(base) / 4 - 0.01) / (sum(base) / 4 + 0.002 - 0.01))
    assert "| Voodoo30 | ruled | 88.00 / 89.00 |" in rep.markdown(rows)
    assert {k["method"] for k in rep.knapsacks(rows)} == {"knapsack-gptq-ruled", "knapsack-gptq-packed"}


def test_rows_are_named_by_the_walk_their_config_records(rep):
    """A "knapsack-gptq" row (the default walk of its day) is read as the walk its config records,
    and the written file is measured against the compensated knapsack of its own walk."""
    def cfg(r, walk):
        return {**r, "config": {"train": {"compensation_sweep": walk}}}
    rows = STOCK + [cfg(_row("r30", "knapsack-gptq", 89e6, 0.10, size=30), "ruled"),
                    cfg(_row("p30", "knapsack-gptq-packed", 89e6, 0.12, size=30), "packed"),
                    cfg(_row("v30", "voodoo", 89e6, 0.09, size=30, seed=0, steps=50), "ruled"),
                    {**_row("n30", "knapsack", 89e6, 0.2, size=30), "config": {"train": {"error_compensation": "none"}}}]
    named = rep.latest(rows)
    assert [r["method"] for r in named[-4:]] == ["knapsack-gptq-ruled", "knapsack-gptq-packed", "voodoo", "knapsack"]
    assert rep.compensated(named) == "knapsack-gptq-ruled"
    assert rep.compensated([r for r in named if r["method"] != "voodoo"]) == "knapsack-gptq-packed"
    (x,) = rep.targets(named)["sizes"]
    assert x["ratio_vs_compensated"] == pytest.approx(0.08 / 0.09)


def test_a_knapsacks_seeds_are_named_and_shown_as_a_mean_with_their_spread(rep):
    """A knapsack made at more seeds: each file listed under its seed, the knapsack's point at that
    size the seed mean with its spread (as the written file's), and the written file measured
    against that mean; a size made at the default seed alone reads as before."""
    rows = STOCK + [_row("k30", "knapsack-gptq-packed", 89e6, 0.10, size=30),
                    _row("k30s1", "knapsack-gptq-packed", 89e6, 0.12, size=30, seed=1),
                    _row("k30s2", "knapsack-gptq-packed", 89e6, 0.14, size=30, seed=2),
                    _row("k40", "knapsack-gptq-packed", 99e6, 0.05, size=40),
                    _row("v30", "voodoo", 89e6, 0.07, size=30, seed=0, steps=50)]
    md = rep.markdown(rows)
    files = md.split("| file | made by |")[1].split("\n\n")[0]
    assert [ln.split(" | ")[0] for ln in files.splitlines() if "knapsack" in ln] == [
        "| Voodoo30 knapsack-gptq-packed", "| Voodoo30 knapsack-gptq-packed (seed 1)",
        "| Voodoo30 knapsack-gptq-packed (seed 2)", "| Voodoo40 knapsack-gptq-packed"]
    alone = md.split("The knapsacks alone")[1].split("\n\n")[1].splitlines()
    assert alone[2].startswith("| Voodoo30 knapsack-gptq-packed | 89.00 | 0.120000 (0.10000–0.14000, n=3) | ")
    assert alone[3].startswith("| Voodoo40 knapsack-gptq-packed | 99.00 | 0.050000 | ")
    (x,) = rep.targets(rows)["sizes"]
    assert x["compensated_kld"] == pytest.approx(0.12) and x["ratio_vs_compensated"] == pytest.approx(0.06 / 0.11)


def test_learned_stage_target_and_flags(rep):
    rows = STOCK + [_row("v35", "voodoo", 95e6, 0.15, size=35, seed=0, steps=50),
                    _row("v40", "voodoo", 99e6, 0.16, size=40, seed=0, steps=50),
                    _row("k35", "knapsack-gptq", 95e6, 0.16, size=35)]
    t = rep.targets(rows)
    a, b = t["sizes"]
    assert a["above_stock"] and "ABOVE" in a["note"]
    assert a["ratio_vs_compensated"] == pytest.approx(0.14 / 0.15) and a["meets_knapsack"] is False
    assert b["falls"] is False and "NOT below Voodoo35" in b["note"] and not t["monotone"]
    with pytest.raises(ValueError, match="floor"):
        rep.targets(STOCK[:2])


def test_paired_difference_cancels_the_texts_spread(rep):
    """Two files whose per-chunk KLDs move together (hard and easy chunks) differ by a constant:
    the paired difference resolves it with a standard error far below either file's spread."""
    base = [0.05, 0.20, 0.08, 0.30, 0.11, 0.06]
    rows = STOCK + [
        _row("k", "knapsack-gptq", 89e6, sum(base) / 6, size=30, chunks=base),
        _row("v0", "voodoo", 89e6, 0.0, size=30, seed=0, steps=50, chunks=[x - 0.010 for x in base]),
        _row("v1", "voodoo", 89e6, 0.0, size=30, seed=1, steps=50,
             chunks=[x - 0.012 + 0.001 * (i % 2) for i, x in enumerate(base)]),
        _row("v0s10", "voodoo", 89e6, 0.0, size=30, seed=0, steps=10, chunks=[x + 0.002 for x in base]),
    ]
    (x,) = rep.targets(rows)["sizes"]
    d, se = x["paired_vs_knapsack"]
    assert d == pytest.approx(-0.01075, abs=1e-12)  # (−0.010 + −0.0115) / 2
    assert se < 0.001 < stderr(base)
    fair = rep.fair(rows)  # Voodoo30 at two step counts
    assert [(f["steps"], f["n_seeds"]) for f in fair] == [(10, 1), (50, 2)]
    assert fair[0]["paired_vs_knapsack"][0] == pytest.approx(0.002)


def test_report_renders_groups_transfer_and_costs(rep, tmp_path):
    rows = []
    for calib, vk in (("plays+python", 0.03), ("python", 0.06)):
        for text in ("plays", "python"):
            rows += [{**r, "calib": calib, "text": text, "digest": f"{r['name']}-{calib}-{text}"} for r in STOCK]
            rows.append(_row("v35", "voodoo", 95e6, vk, size=35, seed=0, steps=50, text=text, calib=calib))
            rows.append(_row("k35", "knapsack", 95e6, 2 * vk, size=35, text=text, calib=calib))
    rows[0] = {**rows[0], "command": ".venv/bin/python bench/quality.py run --max_minutes 150",
               "date": "2026-12-06T00:00:00+00:00"}
    costs = [{"step": "imatrix", "item": None, "seconds": 12.5, "peak_rss_mb": {"self": 900.0, "children": 10.0},
              "session": "s", "date": "x", "cpus": 2}]
    md = rep.write(rows, costs, tmp_path / "r.md", tmp_path / "r.png").read_text()
    assert "bench/quality.py run --max_minutes 150" in md and "![KLD vs file size](r.png)" in md
    assert md.index("## Calibration plays+python, eval text plays") < md.index("## Calibration python, eval text plays")
    assert "| Voodoo35 | 95.00 | 0.030000 |" in md
    transfer = md.split("## Transfer")[1].split("##")[0]
    stock_excess = math.sqrt(0.20 * 0.05) - 0.01
    assert f"| python | Voodoo35 | {0.05 / stock_excess:.3f} | {0.05 / stock_excess:.3f} |" in transfer
    assert f"| python | Voodoo35 knapsack | {0.11 / stock_excess:.3f} | {0.11 / stock_excess:.3f} |" in transfer
    assert "| imatrix |  | 12.5 | 900 | 10 |" in md
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a row measured again (same digest) replaces the earlier one
    assert len(rep.latest(rows + [{**rows[-1], "kld_mean": 0.5}])) == len(rows)


def test_compare_pairs_the_same_file_of_two_variants_chunk_by_chunk():
    cmp = _bench("quality_compare")
    a = [_row("k55", "knapsack", 80e6, 0.20, size=55, chunks=[0.1, 0.3, 0.2]),
         _row("q8", "stock", 145e6, 0.01, recipe="Q8_0", chunks=[0.01, 0.01, 0.01]),
         _row("k65", "knapsack", 90e6, 0.10, size=65, chunks=[0.1, 0.1, 0.1])]
    b = [_row("k55", "knapsack", 80e6, 0.15, size=55, chunks=[0.05, 0.25, 0.15]),
         _row("q8", "stock", 145e6, 0.01, recipe="Q8_0", chunks=[0.01, 0.01, 0.01])]
    out = cmp.compare(a, b)
    assert [e["label"] for e in out] == ["Voodoo55 knapsack", "stock Q8_0"]  # k65: in A only
    assert out[0]["paired"][0] == pytest.approx(-0.05) and out[0]["paired"][1] == pytest.approx(0.0)
    assert "-0.05000 ± 0.00000" in cmp.markdown(out, "A", "B")
    b[0]["config"] = {"eval": {"sha256": "other", "ctx": 512, "chunks": 3}}
    with pytest.raises(SystemExit, match="different eval texts"):
        cmp.compare(a, b)


def test_compare_pairs_a_knapsacks_files_seed_by_seed():
    """A knapsack at seed 1 pairs with the other run's seed-1 file, never with its default-seed
    file, and the table names which is which."""
    cmp = _bench("quality_compare")
    a = [_row("k30", "knapsack", 80e6, 0.20, size=30, chunks=[0.2, 0.2, 0.2]),
         _row("k30s1", "knapsack", 80e6, 0.30, size=30, seed=1, chunks=[0.3, 0.3, 0.3])]
    b = [_row("k30s1", "knapsack", 80e6, 0.25, size=30, seed=1, chunks=[0.25, 0.25, 0.25]),
         _row("k30", "knapsack", 80e6, 0.10, size=30, chunks=[0.1, 0.1, 0.1]),
         _row("k30s2", "knapsack", 80e6, 0.40, size=30, seed=2, chunks=[0.4, 0.4, 0.4])]
    out = cmp.compare(a, b)
    assert [(e["label"], e["key"][-1]) for e in out] == [("Voodoo30 knapsack", None), ("Voodoo30 knapsack (seed 1)", 1)]
    assert [e["paired"][0] for e in out] == [pytest.approx(-0.1), pytest.approx(-0.05)]
    table = cmp.markdown(out, "A", "B")
    assert "| plays+python | plays | Voodoo30 knapsack (seed 1) | 80.00 | 80.00 | 0.30000" in table
    methods = cmp.compare(a, [dict(r, method="knapsack-gptq-packed") for r in b], ("knapsack", "knapsack-gptq-packed"))
    assert [(e["key"][-1], e["b"]["kld_mean"]) for e in methods] == [(None, 0.10), (1, 0.25)]


def test_compare_pairs_two_methods_of_one_results_file():
    cmp = _bench("quality_compare")
    rows = [_row("p30", "knapsack-gptq-packed", 80e6, 0.20, size=30, chunks=[0.2, 0.3, 0.1]),
            _row("r30", "knapsack-gptq", 80e6, 0.15, size=30, chunks=[0.1, 0.25, 0.1]),
            _row("r40", "knapsack-gptq", 90e6, 0.10, size=40, chunks=[0.1, 0.1, 0.1]),
            _row("k30", "knapsack", 80e6, 0.30, size=30, chunks=[0.3, 0.3, 0.3])]
    out = cmp.compare(rows, rows, ("knapsack-gptq-packed", "knapsack-gptq"))
    assert [e["key"][3] for e in out] == [30]  # only Voodoo30 has both methods; the plain knapsack is left out
    assert out[0]["paired"][0] == pytest.approx(-0.05) and out[0]["a"]["kld_mean"] == 0.20
    assert cmp.compare(rows, rows, ("knapsack", "knapsack-gptq-packed"))[0]["paired"][0] == pytest.approx(-0.1)
