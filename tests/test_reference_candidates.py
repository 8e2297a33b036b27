"""The guarantee's references under error compensation (training/guarantee.py): a reference's
off-menu types are plain candidates (the bytes stock llama-quantize writes: ``ggml_quantize_chunk``
of the float weights with the imatrix), its menu types the run's compensated candidates; the
assignment records which per tensor, export writes exactly the bytes measured, and the dry run's
time model counts the off-menu candidates as plain."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from voodoo_quant.candidates.cache import CandidateCache
from voodoo_quant.candidates.compensate import compensations
from voodoo_quant.candidates.hessian_store import load_hessians
from voodoo_quant.core import ggml
from voodoo_quant.gguf.imatrix import load
from voodoo_quant.model.modeling import load_model
from voodoo_quant.student.build import selectable_weights
from voodoo_quant.training.config import TrainConfig
from voodoo_quant.training.trainer import Trainer

# at --compression_ratio 0.55 the largest uniform files that fit are IQ4_NL (on no menu: plain
# candidates) and Q4_0 (on every menu: the run's compensated candidates), both 4.5 bits a weight
MENU = ("Q8_0", "Q4_0")


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


@pytest.fixture(scope="module")
def trained(imatrix_llama256_hf_dir, synthetic_run_inputs, tmp_path_factory):
    """A compensated gates run whose guarantee measures a reference on no menu's type (uniform
    IQ4_NL) and one on the menus' (uniform Q4_0), and the float weights, imatrix and
    compensations its candidates were made from."""
    d = imatrix_llama256_hf_dir
    root = tmp_path_factory.mktemp("refs")
    synthetic_run_inputs(d, root)
    cfg = TrainConfig(model=str(d), data_dir=str(root / "data"), imatrix=str(root / "imatrix.gguf"), seq_len=32,
                      batch_size=2, max_steps=2, compression_ratio=0.55, candidate_types=MENU,
                      output_dir=str(root / "run"), error_compensation="gptq", compensation_sequences=4,
                      search_evals=0, partial_save_interval=1)
    tr = Trainer(cfg)
    res = tr.train()
    rec = res.assignment.compensation
    comps = compensations(load_hessians(rec["hessians"]), rec["damp"], rec["sweep"])
    imx = load(root / "imatrix.gguf")
    weights = {n: w for n, (w, _) in selectable_weights(load_model(str(d), dtype=torch.float32)).items()}
    plans = {p.name: p for p in tr.run.plans}
    mats = {n: np.ascontiguousarray(p.layout.to_gguf(weights[n].detach()), dtype=np.float32)
            for n, p in plans.items()}
    vecs = {n: imx.get_vector(p.gguf_name, p.n_per_row) for n, p in plans.items()}
    return root, d, tr, res, comps, mats, vecs


def test_off_menu_reference_candidates_are_stock_bytes_and_menu_ones_compensated(trained):
    root, d, tr, res, comps, mats, vecs = trained
    run = tr.run
    plans = {p.name: p for p in run.plans}
    lib = ggml.lib()
    off = on = 0
    for ref in run.references.candidates:
        for n, t in ref.types.items():
            p = plans[n]
            plain = lib.quantize(mats[n], t, vecs[n])  # ggml_quantize_chunk with the imatrix: stock's bytes
            if t not in p.menu.types:
                off += 1
                assert bytes(run.extra_blobs[(n, t)]) == plain, f"{ref.name}: {n} {t} is not stock's bytes"
                assert run.candidate_sha256[(n, t)] == _sha(plain)
            else:
                on += 1
                assert n in comps  # every tensor of this model is compensated (the tied embedding as the head)
                cand = CandidateCache().get(CandidateCache.key(mats[n], t, vecs[n], compensation=comps[n]))
                assert cand is not None and run.candidate_sha256[(n, t)] == _sha(cand), f"{ref.name}: {n} {t}"
                assert cand != plain, f"{n}: compensation changed nothing"
    assert off and on, (off, on)  # both kinds measured, or this test checks nothing
    # the plain bytes are cached apart from the compensated ones of the same (tensor, type)
    n, t = next(iter(run.extra_blobs))
    plain_key, comp_key = (CandidateCache.key(mats[n], t, vecs[n], compensation=c) for c in (None, comps[n]))
    assert plain_key.digest != comp_key.digest
    assert CandidateCache().get(plain_key) == bytes(run.extra_blobs[(n, t)])


def test_a_winning_reference_is_exported_with_the_bytes_it_was_measured_with(trained, tmp_path):
    """The assignment the trainer writes when a reference's off-menu types win (here beside the
    gates' menu types, as the search may leave them: both kinds in one file) records them as plain
    with the measured bytes' sha256, and export writes exactly the bytes measured, with the
    candidate cache or without it."""
    import dataclasses
    import os

    from voodoo_quant.gguf import converter
    from voodoo_quant.selection.assignment import Assignment
    from voodoo_quant.tools.export import ExportConfig, export
    from voodoo_quant.training.choices import tensor_choices
    from voodoo_quant.training.guarantee import rung_bytes

    root, d, tr, res, comps, mats, vecs = trained
    run = tr.run
    plans = {p.name: p for p in run.plans}
    ref = next(c for c in run.references.candidates if c.name == "uniform IQ4_NL")
    won = {n: (ref.types[n] if k % 2 else c.qtype) for k, (n, c) in enumerate(res.assignment.tensors.items())}
    sizes = {n: rung_bytes(plans[n], t) for n, t in won.items()}
    probs = {n: torch.full((len(p.menu.types),), 1.0 / len(p.menu.types)) for n, p in plans.items()}
    asg = dataclasses.replace(res.assignment, tensors=tensor_choices(run, won, sizes, probs))
    path = asg.save(tmp_path / "assignment.json")
    asg = Assignment.load(path)  # as export reads it
    assert {c.compensated for c in asg.tensors.values()} == {True, False}
    out = export(ExportConfig(model=d, assignment=path, output_dir=tmp_path / "out", output_name="tiny.gguf",
                              keep_f32=True))
    r = converter.vendored_gguf().GGUFReader(out.path)
    ours = {t.name: np.asarray(t.data).view(np.uint8).tobytes() for t in r.tensors}
    for n, c in asg.tensors.items():
        measured = (bytes(run.extra_blobs[(n, c.qtype)]) if c.qtype not in c.menu
                    else CandidateCache().get(CandidateCache.key(mats[n], c.qtype, vecs[n], compensation=comps[n])))
        assert c.compensated is (c.qtype in c.menu), (n, c.qtype, c.compensated)
        assert c.sha256 == _sha(measured), n
        assert ours[c.gguf_name] == measured, f"{n}: exported {c.qtype} bytes are not the ones measured"
    # on a machine without the candidate cache each is computed again: the plain ones plain
    old = os.environ["VOODOO_CACHE_DIR"]
    os.environ["VOODOO_CACHE_DIR"] = str(tmp_path / "empty-cache")
    try:
        again = export(ExportConfig(model=d, assignment=path, output_dir=tmp_path / "again", output_name="tiny.gguf",
                                    converted=out.f32_gguf))
    finally:
        os.environ["VOODOO_CACHE_DIR"] = old
    assert again.path.read_bytes() == out.path.read_bytes()
    # the run's own assignment records the same rule for whatever won
    for n, c in res.assignment.tensors.items():
        assert c.compensated is (c.qtype in c.menu) and c.sha256 == run.candidate_sha256[(n, c.qtype)]


def test_the_dry_run_counts_the_references_off_menu_candidates_as_plain(gate_model_dir, tmp_path):
    from voodoo_quant.cli.tp import parse_train_flags
    from voodoo_quant.memory import timing as tm
    from voodoo_quant.memory.dry_run import dry_run
    from voodoo_quant.memory.rates import Rates
    from voodoo_quant.memory.time_plan import plan_time, references
    from voodoo_quant.model.lazyload import text_skeleton
    from voodoo_quant.core import qtypes as qt

    cfg = parse_train_flags(["--model", str(gate_model_dir / "model"), "--data_dir", str(gate_model_dir / "data"),
                             "--output_dir", str(tmp_path / "out"), "--candidate_types", *MENU,
                             "--compression_ratio", "0.55", "--seq_len", "32"])
    assert cfg.method == "gates" and cfg.compensation == "gptq" and cfg.measures
    run = dry_run(cfg)
    model = text_skeleton(cfg.model)
    refs = references(cfg, model, run.plans, run.budget, ())
    n_extra = sum(len(set(ts) - set(next(p for p in run.plans if p.name == n).menu.types))
                  for n, ts in refs.extra.items())
    assert n_extra > 0  # the references use off-menu types, or this test checks nothing
    modules = dict(model.named_modules())
    jobs = tm.candidate_jobs(run.plans, modules, compensated=True, extra=refs.extra)
    menu_jobs = [j for j in jobs if j.qtype in next(p for p in run.plans if p.name == j.name).menu.types]
    assert len(jobs) == len(menu_jobs) + n_extra
    assert all(j.compensated for j in menu_jobs)  # every tensor here has a Hessian (the tied head too)
    assert not any(j.compensated for j in jobs if j not in menu_jobs)
    every = [t for t in qt.QTYPES if t != "F32"]
    rates = Rates(quant={t: 3e6 for t in every}, dequant={t: 5e8 for t in every}, bare={t: 3e6 for t in every},
                  comp_weight={t: 1e-6 for t in every}, comp_step={t: 1e-3 for t in every}, gemm=2e10, gemm1=2e10,
                  chol=5e9, parallel=1.0, sha256=1e9, copy=4e9, curvature=1e-9, threads=2, workers=1)
    plan = plan_time(cfg, model, run.plans, run.budget, rates, n_file=12)
    stage = next(s for s in plan.stages if s.name == "candidates")
    assert f"{len(jobs)} candidates ({len(menu_jobs)} compensated)" in stage.note
    # priced as plain: the same jobs with the off-menu ones compensated would cost their walks more
    walked = [j if j in menu_jobs else tm.Job(j.name, j.qtype, j.rows, j.n, True, j.imatrix) for j in jobs]
    assert sum(map(lambda j: tm.job_seconds(j, rates), walked)) > sum(map(lambda j: tm.job_seconds(j, rates), jobs))
