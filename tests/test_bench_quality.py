"""bench/quality*.py: the benchmark driver on the product's ladder, its texts, its JSONL results and
the report rendered from them.

The report's numbers (frontier, log-KLD interpolation, target ratios, paired differences) are
checked on made-up rows; the driver end to end on the tiny random model (slow: stock tools).
"""

from __future__ import annotations

import importlib
import json
import math
import shutil
import sys
from pathlib import Path

import pytest

from voodoo_quant.tools.evaluate import stderr

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _bench(name: str):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


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


# -- texts -------------------------------------------------------------------------------------

def test_domain_split_never_puts_a_held_out_file_into_calibration(tmp_path):
    qt = _bench("quality_texts")
    domains = {n: qt.domain(n) for n in qt.DOMAINS}
    texts = qt.build_texts(domains, ("plays", "python"), tmp_path / "a", calib_chars=150_000, eval_chars=60_000)
    pieces = [json.loads(ln)["text"] for ln in texts.calib.read_text().splitlines()]
    owner = []  # the domain each calibration piece comes from
    for name, d in domains.items():
        files = dict(qt.domain_files(d))
        cal, held = texts.split[name]["calib"], texts.split[name]["held_out"]
        assert set(cal).isdisjoint(held) and set(cal) | set(held) == set(files) and held
        assert not any(p.startswith(("site-packages/", "test/", "encodings/")) for p in files)
        held_text = "\n".join(files[f] for f in held)
        calib_text = "\n".join(files[f] for f in cal)
        mine = [i for i, p in enumerate(pieces) if p in calib_text]
        owner += [(i, name) for i in mine]
        assert mine and all(pieces[i] not in held_text for i in mine)  # calibration files' text only
        ev = texts.eval_pieces[name]
        assert texts.evals[name].read_text() == "\n\n".join(ev) and len(ev) > 5
        assert all(p in held_text and p not in calib_text for p in ev)  # held-out files' text only
    # every calibration piece is a piece of a calibration file, and the domains alternate
    assert sorted(i for i, _ in owner) == list(range(len(pieces)))
    assert [n for _, n in sorted(owner)][:6] == ["plays", "python"] * 3
    again = qt.build_texts(domains, ("plays", "python"), tmp_path / "b", calib_chars=150_000, eval_chars=60_000)
    assert (again.calib_sha256, again.eval_sha256) == (texts.calib_sha256, texts.eval_sha256)
    one = qt.build_texts(domains, ("python",), tmp_path / "c", calib_chars=150_000, eval_chars=60_000)
    assert one.eval_sha256 == texts.eval_sha256 and one.calib_sha256 != texts.calib_sha256


# -- results file, plan, command line ----------------------------------------------------------

def test_results_file_appends_whole_lines(tmp_path):
    store = _bench("quality_rows")
    p = tmp_path / "r.jsonl"
    store.append_rows(p, [{"a": 1}])
    store.append_rows(p, [{"b": "é"}, {"c": [1, 2]}])
    assert store.read_rows(p) == [{"a": 1}, {"b": "é"}, {"c": [1, 2]}]
    assert store.cost_path(p).name == "r.cost.jsonl" and not list(tmp_path.glob(".*"))  # no temp file left
    p.write_text(p.read_text() + "{half")
    with pytest.raises(ValueError, match=r"r.jsonl:4 is not a JSON line"):
        store.read_rows(p)
    assert len(store.llama_cpp_commit()) == 40


def test_plan_order_and_command_line(tmp_path):
    q = _bench("quality")
    tiny_llama_hf_dir = tmp_path / "Tiny"  # parsing looks for the checkpoint's config.json only
    tiny_llama_hf_dir.mkdir()
    (tiny_llama_hf_dir / "config.json").write_text("{}")
    what, (cfg, _) = q.parse(["run", "--model", str(tiny_llama_hf_dir), "--sizes", "min", "30,35", "45",
                               "--fair_sizes", "30", "--steps", "50", "10", "--seeds", "0", "1", "--stock", "Q4_K_M",
                               "--uniform", "Q4_K_S", "--train_args", "--lr 0.3"])
    assert what == "run" and cfg.sizes == ("min", 30, 35, 45) and cfg.stock == ("Q8_0", "Q4_K_M")
    assert cfg.name == tiny_llama_hf_dir.name and cfg.train_extra == {"lr": 0.3}
    labels = [i.label for i in q.plan(cfg, (30, 35, 45))]
    # at --fair_sizes: the written file's other seeds, each knapsack's (in --methods' order), then the other steps
    assert labels == ["stock-Q8_0", "Voodoo30-s50-seed0", "Voodoo35-s50-seed0", "Voodoo45-s50-seed0", "stock-Q4_K_M",
                      "Voodoo30-knapsack-gptq-packed", "Voodoo35-knapsack-gptq-packed", "Voodoo45-knapsack-gptq-packed",
                      "Voodoo30-knapsack", "Voodoo35-knapsack", "Voodoo45-knapsack", "uniform-Q4_K_S",
                      "Voodoo30-s50-seed1", "Voodoo30-knapsack-gptq-packed-seed1", "Voodoo30-knapsack-seed1",
                      "Voodoo30-s10-seed0"]
    _, (only, _) = q.parse(["run", "--model", str(tiny_llama_hf_dir), "--sizes", "30", "--fair_sizes", "30",
                            "--methods", "knapsack-gptq-packed"])
    made = [i for i in q.plan(only, (30,)) if i.trained]  # the default seeds 0 1 2: the knapsack's too, no gates
    assert [i.label for i in made] == ["Voodoo30-knapsack-gptq-packed", "Voodoo30-knapsack-gptq-packed-seed1",
                                       "Voodoo30-knapsack-gptq-packed-seed2"]
    assert all(i.variant({}).train["compensation_sweep"] == "packed" for i in made)
    # a knapsack at the default seed (0) is the file made everywhere, not a second copy of it
    _, (swapped, _) = q.parse(["run", "--model", str(tiny_llama_hf_dir), "--sizes", "30", "--fair_sizes", "30",
                               "--methods", "knapsack", "--seeds", "1", "0", "2"])
    assert [i.label for i in q.plan(swapped, (30,)) if i.trained] == ["Voodoo30-knapsack", "Voodoo30-knapsack-seed2"]
    # the ruled walk's rows were made as "knapsack-gptq" while it was the default: the same identity
    assert q.Item("knapsack-gptq-ruled", size=30).key() == {"method": "knapsack-gptq", "size": 30}
    assert q.Item("knapsack-gptq-ruled", size=30).variant({}).train["compensation_sweep"] == "ruled"
    v = q.Item("knapsack", size=30).variant({"lr": 0.3})
    assert v.train == {"lr": 0.3, "method": "sensitivity", "error_compensation": "none"}
    with pytest.raises(SystemExit, match="--fair_sizes"):
        q.parse(["run", "--model", str(tiny_llama_hf_dir), "--sizes", "30", "--fair_sizes", "35"])
    with pytest.raises(SystemExit, match="--methods: unknown gates"):
        q.parse(["run", "--model", str(tiny_llama_hf_dir), "--methods", "gates"])


def test_a_knapsack_at_another_seed_is_another_file_and_the_default_seed_keeps_its_identity():
    """``--seed`` picks the sequences of the knapsack's Fisher pass: a knapsack at seed 1 is its
    own run, file and row identity, given to the train config as its seed; with no seed the Item
    is named and keyed as before knapsacks took seeds."""
    from voodoo_quant.training.config import TrainConfig

    q = _bench("quality")
    for method in ("knapsack", "knapsack-gptq-packed", "knapsack-gptq-ruled"):
        plain, seeded = q.Item(method, size=30), q.Item(method, size=30, seed=1)
        assert plain.label == f"Voodoo30-{method}" and plain.variant_name == method
        assert "seed" not in plain.variant({}).train and "seed" not in plain.key()
        assert seeded.label == f"Voodoo30-{method}-seed1" and seeded.variant_name == f"{method}-seed1"
        assert seeded.key() == {**plain.key(), "seed": 1}
        v = seeded.variant({"lr": 0.3})
        assert v.name == f"{method}-seed1" and v.train == {**plain.variant({"lr": 0.3}).train, "seed": 1}
        assert v.apply(TrainConfig(model="m", compression_ratio=0.5)).seed == 1
    assert q.Item("knapsack-gptq-ruled", size=30, seed=2).key() == {"method": "knapsack-gptq", "size": 30, "seed": 2}


def test_the_knapsack_rows_of_the_results_keep_their_digests():
    """Every knapsack row of the 1.5B results, its config rebuilt by the driver from an Item with
    no seed: the same digest, so a rerun skips them (a knapsack's seed must not touch them)."""
    from types import SimpleNamespace

    from voodoo_quant.tools.manifest import digest

    q = _bench("quality")
    results = Path(__file__).resolve().parents[1] / "docs" / "results" / "qwen2.5-coder-1.5b.jsonl"
    rows = [json.loads(ln) for ln in results.read_text().splitlines()]
    knap = [r for r in rows if r["method"].startswith("knapsack")]
    assert len(knap) >= 10 and {r["method"] for r in knap} >= {"knapsack", "knapsack-gptq", "knapsack-gptq-packed"}
    made_as = {v: k for k, v in _bench("quality_plan").LEGACY_KEYS.items()}  # "knapsack-gptq" rows: the ruled walk's
    for r in knap:
        c = r["config"]
        item = q.Item(made_as.get(r["method"], r["method"]), size=r["size"])
        assert item.key() == c["file"]
        t = c["train"]
        cfg = SimpleNamespace(degrid_seed=c["degrid_seed"], calib=tuple(c["calib"]["domains"]),
                              seq_len=c["calib"]["seq_len"], calib_sequences=c["calib"]["calib_sequences"],
                              ctx=c["eval"]["ctx"], chunks=c["eval"]["chunks"], menu=tuple(t["menu"]),
                              device=t["device"], dtype=t["dtype"], train_extra={})
        texts = SimpleNamespace(calib_sha256=c["calib"]["sha256"], eval_sha256={r["text"]: c["eval"]["sha256"]})
        bench = SimpleNamespace(cfg=cfg, texts=texts, model_sha=c["model"], versions={"llama.cpp": c["llama.cpp"]})
        again = q.Bench.row_config(bench, item, r["text"])
        assert again == c and digest(again) == r["digest"], r["name"]


def test_a_damaged_run_assignment_is_one_typed_error_naming_it(tmp_path, tiny_llama_hf_dir):
    """What made a trained row is read from its run's assignment: a truncated file is the
    product's CorruptFileError naming the file, not a JSONDecodeError halfway through a session."""
    from types import SimpleNamespace

    from voodoo_quant.core.errors import CorruptFileError

    q = _bench("quality")
    bench = q.Bench(_cfg(q, tiny_llama_hf_dir, tmp_path, tmp_path / "r.jsonl"), "cmd", log=lambda s: None)
    run = tmp_path / "runs" / "Voodoo60"
    run.mkdir(parents=True)
    (run / "assignment.json").write_text('{"tensors": {')
    ladder = SimpleNamespace(work=tmp_path, run_name=lambda size, variant: f"Voodoo{size}")
    with pytest.raises(CorruptFileError, match="assignment.json"):
        bench.facts(ladder, q.Item("knapsack-gptq-packed", size=60))
    assert bench.facts(ladder, q.Item("stock", recipe="Q4_0")) == {}  # nothing trained, nothing read


# -- the driver end to end on the tiny model -----------------------------------------------------

def _cfg(q, model, tmp, results, **kw):
    base = dict(model=model, name="Tiny", results=results, work=tmp / "work", sizes=(60,), methods=("voodoo",),
                stock=("Q4_0",), uniform=("Q5_0",), steps=(2,), seeds=(0,), fair_sizes=(), calib_chars=20_000,
                eval_chars=8000, seq_len=64, calib_sequences=4, ctx=128, chunks=2, threads=2)
    return q.BenchConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def tiny_bench(tmp_path_factory, tiny_llama_hf_dir):
    q = _bench("quality")
    tmp = tmp_path_factory.mktemp("bench")
    results = tmp / "results" / "tiny.jsonl"
    summary = q.Bench(_cfg(q, tiny_llama_hf_dir, tmp, results), "cmd", log=lambda s: None).run()
    return q, tmp, results, summary


@pytest.mark.slow
def test_bench_rows_then_a_rerun_adds_nothing_and_runs_nothing(tiny_bench, tiny_llama_hf_dir):
    q, tmp, results, first = tiny_bench
    rows = [json.loads(ln) for ln in results.read_text().splitlines()]
    # floor, written file, stock, uniform: each on both eval texts
    assert first.added == 8 == len(rows) and not first.failed and not first.stopped
    assert {(r["method"], r["text"]) for r in rows} == {(m, t) for m in ("stock", "voodoo", "uniform")
                                                        for t in ("plays", "python")}
    for r in rows:
        assert r["size_bytes"] > 0 and r["kld_mean"] >= 0 and r["n_chunks"] == 2 and len(r["digest"]) == 24
        assert r["config"]["eval"]["text"] == r["text"] and r["versions"]["llama.cpp"] and r["command"] == "cmd"
        assert r["peak_rss_mb"]["self"] > 0
    made = {r["method"]: r for r in rows if r["text"] == "plays"}
    assert made["voodoo"]["made_by"] and made["voodoo"]["compensation"] == "gptq"  # the default: compensated
    assert "train-Voodoo60-s2-seed0" in made["voodoo"]["make_seconds"]
    assert "pure-Q5_0" in made["uniform"]["make_seconds"]
    costs = [json.loads(ln) for ln in (results.parent / "tiny.cost.jsonl").read_text().splitlines()]
    assert {"imatrix", "reference", "eval-base-plays", "train-Voodoo60-s2-seed0"} <= {c["step"] for c in costs}
    assert {p.name for p in (tmp / "work").rglob("*.gguf")} == {"Tiny.F32.gguf", "imatrix.gguf"}  # files deleted
    before = results.read_bytes()
    again = q.Bench(_cfg(q, tiny_llama_hf_dir, tmp, results), "cmd", log=lambda s: None).run()
    assert (again.added, again.present, again.steps_ran) == (0, 8, []) and results.read_bytes() == before


@pytest.mark.slow
def test_bench_a_changed_setting_adds_rows_and_the_report_needs_only_the_jsonl(tiny_bench, tiny_llama_hf_dir, tmp_path):
    q, tmp, results, _ = tiny_bench
    s = q.Bench(_cfg(q, tiny_llama_hf_dir, tmp, results, steps=(3,)), "cmd", log=lambda s: None).run()
    assert (s.added, s.present) == (2, 6)  # only the written file depends on the steps
    assert [x for x in s.steps_ran if x.startswith(("train", "stock", "pure"))] == ["train-Voodoo60-s3-seed0"]
    alone = tmp_path / "alone" / "tiny.jsonl"  # the results file by itself, nothing else beside it
    alone.parent.mkdir()
    shutil.copy(results, alone)
    md = Path(q.render(alone)).read_text()
    assert "## Calibration plays+python, eval text python" in md and (alone.parent / "tiny.png").stat().st_size > 0
    assert "Voodoo60 voodoo (3 steps, seed 0)" in md and "Voodoo60 voodoo (2 steps, seed 0)" in md


@pytest.mark.slow
def test_bench_stops_between_files_when_the_budget_is_spent(tiny_bench, tiny_llama_hf_dir):
    q, tmp, _, _ = tiny_bench
    results = tmp / "budget" / "tiny.jsonl"

    def clock() -> float:  # time stands still until the first file's rows are in, then jumps past the budget
        return 1e9 if results.is_file() and len(results.read_text().splitlines()) >= 2 else 0.0

    s = q.Bench(_cfg(q, tiny_llama_hf_dir, tmp, results, max_minutes=5), "cmd", clock=clock, log=lambda s: None).run()
    rows = [json.loads(ln) for ln in results.read_text().splitlines()]
    assert s.stopped and s.added == 2 and [r["name"] for r in rows] == ["Tiny.stock-Q8_0.gguf"] * 2
    assert s.left == ["Voodoo60-s2-seed0", "stock-Q4_0", "uniform-Q5_0"]


@pytest.mark.slow
def test_the_estimate_leaves_out_the_shared_steps_and_bases_this_machine_holds(tiny_bench, tiny_llama_hf_dir):
    """A second run on the machine that made the shared steps counts only each item's own seconds:
    an earlier session's imatrix time must not stop a run that would skip the imatrix."""
    q, tmp, results, _ = tiny_bench
    b = q.Bench(_cfg(q, tiny_llama_hf_dir, tmp, results), "cmd", log=lambda s: None)
    b.prepare()
    b.ready, b.bases = set(), {}
    item = q.Item("stock", "Q4_0")
    own = sum(v for (i, _), v in b.history.items() if i == item.label)
    assert own > 0 and all(b.found(s) for s in ("data", "reference", "imatrix"))
    assert b.estimate(item, ["plays", "python"]) == pytest.approx(own)
    elsewhere = q.Bench(_cfg(q, tiny_llama_hf_dir, tmp / "fresh", results), "cmd", log=lambda s: None)
    elsewhere.prepare()
    elsewhere.ready, elsewhere.bases = set(), {}
    assert elsewhere.estimate(item, ["plays", "python"]) > own  # a fresh machine: the shared steps count


def test_an_item_never_made_is_estimated_from_its_kind(tmp_path, tiny_llama_hf_dir):
    """A stock file never made costs what the stock files made did (their median), so a run with
    --max_minutes does not start one with no time left; a method's file at a new size, the same."""
    q = _bench("quality")

    b = q.Bench(_cfg(q, tiny_llama_hf_dir, tmp_path, tmp_path / "r.jsonl"), "cmd", log=lambda s: None)
    b.ready, b.bases = {"shared"}, {}
    b.history = {("stock-Q8_0", "stock-Q8_0"): 10.0, ("stock-Q8_0", "eval-plays"): 50.0,
                 ("stock-IQ2_XXS", "stock-IQ2_XXS"): 200.0, ("stock-IQ2_S", "stock-IQ2_S"): 400.0,
                 ("stock-IQ2_S", "eval-plays"): 100.0, ("Voodoo30-knapsack", "train-Voodoo30-knapsack"): 900.0,
                 (None, "imatrix"): 1000.0}
    assert b.estimate(q.Item("stock", "IQ3_XXS"), []) == 200.0  # median of 60, 200, 500
    assert b.estimate(q.Item("stock", "IQ2_S"), []) == 500.0  # its own
    assert b.estimate(q.Item("knapsack", size=40), []) == 900.0
    assert b.estimate(q.Item("uniform", "Q4_K_S"), []) == 0.0  # nothing of its kind recorded


def test_a_variant_overrides_train_settings_but_not_the_ladders():
    from voodoo_quant.core.errors import ConfigError
    from voodoo_quant.tools.quantize import Variant
    from voodoo_quant.training.config import TrainConfig

    t = Variant("knapsack", {"method": "sensitivity", "error_compensation": "none"}).apply(
        TrainConfig(model="m", compression_ratio=0.5, seed=3))
    assert (t.method, t.compensation, t.seed, t.compression_ratio) == ("sensitivity", "none", 3, 0.5)
    with pytest.raises(ConfigError, match="belong to the ladder"):
        Variant("x", {"compression_ratio": 0.3})
    with pytest.raises(ConfigError, match="unknown train settings nope"):
        Variant("x", {"nope": 1})
    with pytest.raises(ConfigError, match="letters, digits"):
        Variant("a/b")


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
