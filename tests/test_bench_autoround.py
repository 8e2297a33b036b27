"""bench/autoround.py: AutoRound as a peer in the quality benchmark.

The calibration records AutoRound is given (every one kept by its own loader), the rows' digests
and labels, resumability, the report; AutoRound itself end to end on a tiny random model (slow;
skipped where the optional ``peer`` extra is not installed: auto-round is no dependency of the
product).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from bench_modules import bench_module as _bench  # noqa: E402

HAVE_AUTOROUND = importlib.util.find_spec("auto_round") is not None


@pytest.fixture(scope="module")
def ar():
    return _bench("autoround")


@pytest.fixture(scope="module")
def tok(smollm2_tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_tok_dir)


def _pieces(tmp_path) -> list[str]:
    """The benchmark's calibration pieces (both domains), with a short piece and a repetitive one
    among them."""
    qt = _bench("quality_texts")
    texts = qt.build_texts({n: qt.domain(n) for n in qt.DOMAINS}, qt.DOMAINS, tmp_path / "texts", calib_chars=60_000,
                           eval_chars=4000)
    real = [p for p in (json.loads(ln)["text"] for ln in texts.calib.read_text().splitlines()) if len(p) > 2000]
    return real[:2] + ["KING. Peace.\n"] + real[2:3] + ["la " * 400 + "\n"] + real[3:]


def test_records_are_the_calibration_text_and_each_is_long_enough(ar, tok, tmp_path):
    pieces = _pieces(tmp_path)
    seq_len, n = 128, 5
    records, stats = ar.calib_records(pieces, tok, seq_len, n)
    assert len(records) == n == stats["records"]
    for r in records:  # AutoRound's own tokenization: truncated at seqlen, nothing shorter kept
        ids = tok(r.rstrip(), truncation=True, max_length=seq_len)["input_ids"]
        assert len(ids) == seq_len and ids.count(ids[-1]) <= seq_len // 2
    # the short piece is joined to the next; the repetitive one is skipped; the rest in order
    assert records[2] == ("KING. Peace.\n" + "\n" + pieces[3]).rstrip()
    assert records[:2] == [p.rstrip() for p in pieces[:2]] and records[3] == pieces[5].rstrip()
    assert (stats["joined"], stats["skipped_repetitive"], stats["pieces_used"]) == (1, 1, 7)
    assert stats["pieces_autoround_would_drop"] == 2  # the file as it is would lose those two
    with pytest.raises(ar.PeerError, match="makes 10 records of 128 tokens, not 50"):
        ar.calib_records(pieces[:12], tok, seq_len, 50)


@pytest.mark.skipif(not HAVE_AUTOROUND, reason="auto-round is not installed (make bench-peer-deps)")
def test_autoround_own_loader_keeps_every_record_and_drops_the_raw_files_short_pieces(ar, tok, tmp_path):
    from auto_round import calib_dataset

    pieces = _pieces(tmp_path)
    raw = tmp_path / "raw.jsonl"
    raw.write_text("".join(json.dumps({"text": p}) + "\n" for p in pieces))
    ours = tmp_path / "ours.jsonl"
    stats = ar.write_records(raw, tok, 128, 5, ours)
    assert len(calib_dataset._get_dataset_impl(tok, 128, str(ours), 42, 5)) == 5 == stats["records"]
    kept = len(calib_dataset._get_dataset_impl(tok, 128, str(raw), 42, len(pieces)))
    assert kept == len(pieces) - stats["pieces_autoround_would_drop"] == len(pieces) - 2


# -- rows: digest, labels, resumability, report --------------------------------------------------

def _cfg(q, model, tmp, **kw):
    base = dict(model=model, name="Tiny", results=tmp / "results" / "tiny.jsonl", work=tmp / "work", sizes=(60,),
                fair_sizes=(), calib_chars=20_000, eval_chars=8000, seq_len=64, calib_sequences=4, ctx=128, chunks=2,
                threads=2)
    return q.BenchConfig(**{**base, **kw})


def test_items_labels_and_digests(ar, tmp_path):
    q = _bench("quality")
    qt = _bench("quality_texts")
    model = tmp_path / "Tiny"
    model.mkdir()
    (model / "config.json").write_text("{}")  # the config checks look for config.json only
    cfg = _cfg(q, model, tmp_path)
    texts = qt.Texts(tmp_path / "c.jsonl", "c" * 64, {}, {"plays": "p" * 64, "python": "y" * 64})

    def peer(**kw):
        p = ar.Peer(cfg, version=kw.pop("version", "0.16.1"), **kw)
        p.texts, p.model_sha = texts, "m" * 64
        return p

    p = peer(tuned="gguf:q3_k_m", iters=50)
    assert [i.label for i in p.items(())] == ["autoround-q4_k_m", "autoround-q3_k_m", "autoround-q2_k_s",
                                             "autoround-q3_k_m-iters50"]
    c = p.row_config(ar.PeerItem("q4_k_m"), "plays")
    assert c["file"] == {"method": "autoround", "format": "q4_k_m", "iters": 0}
    assert c["auto-round"] == {"version": "0.16.1", "amp": False, "device": "cpu", "records": ar.RECORDS_RULE}
    assert "train" not in c and c["calib"]["calib_sequences"] == 4 and c["eval"]["text"] == "plays"
    assert p.versions["auto-round"] == "0.16.1"

    from voodoo_quant.tools.manifest import digest

    def d(pp, item=ar.PeerItem("q4_k_m"), text="plays"):
        return digest(pp.row_config(item, text))

    base = d(p)
    assert base == d(peer())  # the same settings: the same row
    others = {d(peer(version="0.17.0")), d(peer(amp=True)), d(p, ar.PeerItem("q4_k_m", 200)), d(p, text="python"),
              d(p, ar.PeerItem("q4_k_s")), digest(q.Bench.row_config(p, q.Item("stock", "Q4_K_M"), "plays"))}
    assert len(others) == 6 and base not in others
    with pytest.raises(SystemExit, match="auto-round's GGUF formats are"):
        peer(formats=("gguf:iq2_xxs",))
    with pytest.raises(SystemExit, match="--iters 0"):
        peer(tuned="q4_k_m", iters=0)
    what, (cfg2, opts, no_report) = ar.parse(["run", "--model", str(model), "--formats", "gguf:q4_k_s,q6_k",
                                              "--tuned", "gguf:q3_k_m", "--iters", "50", "--seq_len", "256", "--amp"])
    assert what == "run" and cfg2.seq_len == 256 and cfg2.calib_sequences == 64 and not no_report
    assert opts == {"formats": ["gguf:q4_k_s", "q6_k"], "tuned": "gguf:q3_k_m", "iters": 50, "amp": True}


def test_a_present_row_is_skipped(ar, tiny_llama_hf_dir, tmp_path):
    """Rows present (by digest) are not made again; only the missing one is due, and the budget
    stops the run before AutoRound would start (no auto-round needed here)."""
    q = _bench("quality")
    store = _bench("quality_rows")
    from voodoo_quant.tools.manifest import digest

    cfg = _cfg(q, tiny_llama_hf_dir, tmp_path, max_minutes=1)
    probe = ar.Peer(cfg, version="0.16.1", log=lambda s: None)
    probe.prepare()
    items = probe.items(())
    due = [(i, t) for i in items for t in ("plays", "python")]
    store.append_rows(cfg.results, [{"digest": digest(probe.row_config(i, t)), "method": "autoround"}
                                    for i, t in due if (i.label, t) != ("autoround-q3_k_m", "python")])
    ticks = itertools.count(0, 3600)  # an hour per look at the clock: the budget is spent at once
    s = ar.Peer(cfg, version="0.16.1", clock=lambda: next(ticks), log=lambda s: None).run()
    assert (s.added, s.present, s.stopped, s.left) == (0, 5, True, ["autoround-q3_k_m"])
    store.append_rows(cfg.results, [{"digest": digest(probe.row_config(items[1], "python")), "method": "autoround"}])
    s = ar.Peer(cfg, version="0.16.1", log=lambda s: None).run()
    assert (s.added, s.present, s.stopped, s.steps_ran) == (0, 6, False, [])


def _row(name, method, size_bytes, kld, text="plays", **kw):
    return {"digest": f"{name}-{text}", "name": name, "method": method, "size_bytes": size_bytes, "kld_mean": kld,
            "text": text, "calib": "plays+python", "bpw": 4.0, "ppl": 30.0, "kld_p99": 1.0, "same_top_p": 80.0,
            "kld_stderr": 0.001, "kld_chunks": [], "session": "s", "date": "2026-12-05T00:00:00+00:00", **kw}


def test_the_report_lists_autoround_beside_ours_and_keeps_it_off_the_curves(tmp_path):
    rep = _bench("quality_report")
    rows = [_row("q8", "stock", 145e6, 0.01, recipe="Q8_0"), _row("q4", "stock", 100e6, 0.05, recipe="Q4_K_M"),
            _row("q3", "stock", 90e6, 0.20, recipe="Q3_K_M"),
            _row("v35", "voodoo", 95e6, 0.03, size=35, seed=0, steps=50)]
    peers = [_row("ar4", "autoround", 99e6, 0.04, format="q4_k_m", iters=0, made_by="auto-round 0.16.1"),
             _row("ar3", "autoround", 80e6, 0.001, format="q3_k_m", iters=200, made_by="auto-round 0.16.1")]
    assert rep.targets(rows + peers) == rep.targets(rows)  # no curve, no ratio moves
    md = rep.write(rows + peers, [], tmp_path / "r.md", tmp_path / "r.png").read_text()
    table = md.split("## Calibration plays+python, eval text plays")[1]
    assert "| autoround-q4_k_m | auto-round 0.16.1 | 99.00 |" in table
    assert "| autoround-q3_k_m (iters 200) | auto-round 0.16.1 | 80.00 |" in table
    order = [ln.split("|")[1].strip() for ln in table.splitlines() if ln.startswith("| ") and " MB " not in ln][:6]
    assert order == ["autoround-q3_k_m (iters 200)", "stock Q3_K_M", "Voodoo35 voodoo (50 steps, seed 0)",
                     "autoround-q4_k_m", "stock Q4_K_M", "stock Q8_0"]  # by file size
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- AutoRound itself ----------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.skipif(not HAVE_AUTOROUND, reason="auto-round is not installed (make bench-peer-deps)")
def test_autoround_file_loads_in_stock_llama_cpp_with_stock_q4_k_m_types(ar, imatrix_llama256_hf_dir, tmp_path):
    """AutoRound's Q4_K_M of a tiny random Llama (hidden 256, 2 layers): scored by stock
    llama-perplexity beside the benchmark's rows, every tensor of stock llama-quantize Q4_K_M's
    type, every calibration record used, quantized in float32; a rerun adds nothing."""
    q = _bench("quality")
    from voodoo_quant.gguf.recipe_inputs import gguf_inputs
    from voodoo_quant.tools.llama_tools import run_tool

    cfg = _cfg(q, imatrix_llama256_hf_dir, tmp_path, keep_files=True)
    logs: list[str] = []
    s = ar.Peer(cfg, "cmd", formats=("gguf:q4_k_m",), log=logs.append).run()
    assert (s.added, s.failed) == (2, [])
    rows = [json.loads(ln) for ln in cfg.results.read_text().splitlines()]
    assert {r["text"] for r in rows} == {"plays", "python"}
    for r in rows:
        assert (r["method"], r["format"], r["iters"], r["n_chunks"]) == ("autoround", "q4_k_m", 0, 2)
        assert 0 <= r["kld_mean"] < 1 and r["made_by"].startswith("auto-round ")
        a = r["autoround"]
        assert (a["dtype"], a["amp"], a["samples"], a["types_vs_stock"]) == ("float32", False, 4, {})
        assert a["loads"] and set(a["loads"]) == {4} and a["peak_rss_mb"]["self"] > 0
    assert any("none dropped" in m for m in logs)
    made = cfg.work / "autoround" / "Tiny.autoround-q4_k_m.gguf"
    stock = tmp_path / "stock-Q4_K_M.gguf"
    run_tool("llama-quantize", [cfg.work / "ladder-plays+python" / "work" / "gguf" / "Tiny.F32.gguf", stock, "Q4_K_M", "2"])
    theirs, ours = gguf_inputs(made)[0], gguf_inputs(stock)[0]
    assert {t.name: t.type for t in theirs} == {t.name: t.type for t in ours}
    assert {t.type for t in theirs} >= {"Q4_K", "Q6_K"}
    again = ar.Peer(cfg, "cmd", formats=("gguf:q4_k_m",), log=lambda m: None).run()
    assert (again.added, again.present) == (0, 2)
    costs = [json.loads(ln) for ln in (cfg.results.parent / "tiny.cost.jsonl").read_text().splitlines()]
    (c,) = [c for c in costs if c["step"] == "autoround-q4_k_m"]
    assert c["item"] == "autoround-q4_k_m" and c["seconds"] > 0 and c["versions"]["auto-round"]
