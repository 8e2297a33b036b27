"""bench/quality.py, quality_plan.py, quality_texts.py, quality_rows.py: the benchmark driver on the
product's ladder, its texts, its work order and its JSONL results; end to end on the tiny random
model (slow: stock tools). The report and the pairing of results files: test_bench_report.py.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from bench_modules import bench_module as _bench  # noqa: E402


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


@pytest.mark.parametrize("record", ["results", "six-type"])
def test_the_knapsack_rows_of_the_results_keep_their_digests(monkeypatch, record):
    """Every knapsack row of the 1.5B records, its config rebuilt by the driver from its Item
    (seed included where it has one, and the walk's revision: a row without one is rebuilt under
    the walk before revisions): the same digest, so a rerun skips them. The results file holds
    the default menu's rows (made with it named); the six-type record's rows were made under the
    six-type default, so they are rebuilt under it."""
    from types import SimpleNamespace

    from voodoo_quant.tools.manifest import digest

    q = _bench("quality")
    if record == "six-type":
        monkeypatch.setattr(q, "DEFAULT_CANDIDATES", q.SIX_TYPE_DEFAULT)
    rows = _recorded_rows(q, record)
    knap = [r for r in rows if r["method"].startswith("knapsack")]
    assert len(knap) >= 10
    if record == "six-type":
        assert {r["method"] for r in knap} >= {"knapsack", "knapsack-gptq", "knapsack-gptq-packed"}
    assert any("seed" in r["config"]["file"] for r in knap) and any("seed" not in r["config"]["file"] for r in knap)
    made_as = {v: k for k, v in _bench("quality_plan").LEGACY_KEYS.items()}  # "knapsack-gptq" rows: the ruled walk's
    from voodoo_quant.candidates import compensation_walk

    proxy_types = compensation_walk.PACKED_PROXY
    for r in knap:
        c = r["config"]
        # a row made before the walk had revisions (compensate.revision): rebuilt under that walk
        legacy = "compensation_walk" not in c.get("train", {})
        monkeypatch.setattr(compensation_walk, "WRITE_CODES", not legacy)
        monkeypatch.setattr(compensation_walk, "PACKED_PROXY", frozenset() if legacy else proxy_types)
        item = q.Item(made_as.get(r["method"], r["method"]), size=r["size"], seed=c["file"].get("seed"))
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


def test_a_default_menu_row_is_not_a_row_of_the_six_type_default(tmp_path, monkeypatch):
    """A trained row made without --menu records the product's default menu in its digest, so a
    file made with the ten-type default is a new row, not one the results file already holds from
    the six-type default (whose rows record an empty menu, and keep that digest under it)."""
    from types import SimpleNamespace

    from voodoo_quant.selection.menus import DEFAULT_CANDIDATES
    from voodoo_quant.tools.manifest import digest

    q = _bench("quality")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # all BenchConfig looks for; no row is made

    def config(**kw) -> dict:
        b = q.Bench(q.BenchConfig(model=model, name="T", results=tmp_path / "r.jsonl", work=tmp_path / "w",
                                  sizes=(35,), fair_sizes=(), **kw), "cmd", log=lambda s: None)
        b.texts, b.model_sha = SimpleNamespace(calib_sha256="c", eval_sha256={"plays": "e"}), "m"
        return b.row_config(q.Item("knapsack-gptq-packed", size=35), "plays")

    six = ("Q8_0", "Q5_K", "IQ3_S", "IQ2_S", "IQ2_XXS", "IQ1_S")
    assert q.SIX_TYPE_DEFAULT == six and len(DEFAULT_CANDIDATES) == 10
    now = config()
    assert now["train"]["menu"] == list(DEFAULT_CANDIDATES)
    assert digest(now) == digest(config(menu=DEFAULT_CANDIDATES))  # the same file named either way
    assert digest(now) != digest(config(menu=six))
    monkeypatch.setattr(q, "DEFAULT_CANDIDATES", six)  # the product as the recorded rows were made
    then = config()
    assert then["train"]["menu"] == []
    assert digest(now) != digest(then)
    # the recorded rows of the six-type default: an empty menu is in the config their digest is of
    recorded = [r for r in _recorded_rows(q, "six-type") if "train" in r.get("config", {})]
    assert recorded and all(digest(r["config"]) == r["digest"] for r in recorded)
    assert any(r["config"]["train"]["menu"] == [] for r in recorded)


def _recorded_rows(q, record: str) -> list[dict]:
    """The 1.5B benchmark's rows: the results file (the default menu's), or the record of the
    six-type menu that was the default before."""
    root = Path(__file__).resolve().parents[1] / "docs"
    path = {"results": root / "results" / "qwen2.5-coder-1.5b.jsonl",
            "six-type": root / "lab" / "data" / "qwen2.5-coder-1.5b-menu-six.jsonl"}[record]
    return q.store.read_rows(path)


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
