"""The time model of the dry run (memory/timing.py, memory/time_plan.py, memory/rates.py).

Its agreement with measured runs is bench/time_model.py (numbers, as ratios); here: the probe
gives a positive, finite rate for every type of the default menu, and the arithmetic moves the
way the work does, at fixed injected rates: no compensation, no Hessians; twice the tokens, twice
the forward stages; workers divide the candidates; cached candidates are not built."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from typer.testing import CliRunner

from voodoo_quant.cli.app import app
from voodoo_quant.cli.tp import parse_train_flags
from voodoo_quant.core import qtypes as qt
from voodoo_quant.memory import timing as tm
from voodoo_quant.memory.dry_run import dry_run
from voodoo_quant.memory.rates import BASE, DERIVED, Rates, probe
from voodoo_quant.memory.time_plan import plan_time, sequences, time_plan_for
from voodoo_quant.model.lazyload import text_skeleton
from voodoo_quant.selection.menus import DEFAULT_CANDIDATES



def _rates(**kw) -> Rates:
    every = [t for t in qt.QTYPES if t != "F32"]  # the menus and the guarantee's off-menu references
    base = dict(quant={t: 3e6 for t in every} | {"Q8_0": 1e8, "Q4_K": 4e6},
                dequant={t: 5e8 for t in every} | {"Q8_0": 1e9},
                bare={"Q8_0": 1e8, "Q4_K": 8e6},
                comp_weight={t: 1e-6 for t in every} | {"Q8_0": 1e-8, "Q4_K": 2e-7},
                comp_step={t: 1e-3 for t in every} | {"Q8_0": 1e-4, "Q4_K": 5e-4},
                gemm=2e10, gemm1=2e10, chol=5e9, parallel=1.0, sha256=1e9, copy=4e9, curvature=1e-9,
                threads=2, workers=1)
    base.update(kw)
    return Rates(**base)


def _plan(gate_model_dir, tmp_path, extra=(), rates=None, **kw):
    flags = ["--model", str(gate_model_dir / "model"), "--data_dir", str(gate_model_dir / "data"),
             "--output_dir", str(tmp_path / "out"), "--candidate_types", "Q8_0", "Q4_K", "--compression_ratio", "0.6",
             "--seq_len", "32", *extra]
    cfg = parse_train_flags(flags)
    run = dry_run(cfg)
    model = text_skeleton(cfg.model)
    return plan_time(cfg, model, run.plans, run.budget, rates or _rates(), n_file=12, **kw), run


def _stage(plan, name):
    return next(s.seconds for s in plan.stages if s.name == name)


def _names(plan):
    return [s.name for s in plan.stages]


def test_probe_gives_a_rate_for_every_default_menu_type():
    r = probe(DEFAULT_CANDIDATES, hidden=256, intermediate=512, compensation="gptq", workers=2,
              rungs=len(DEFAULT_CANDIDATES))
    for t in DEFAULT_CANDIDATES:
        for what in (r.quant[t], r.dequant[t], r.quant_rate(t, imatrix=False)):
            assert math.isfinite(what) and what > 0, (t, what)
        walk = r.comp_weight[t] * 128 * 512 + r.comp_step[t] * 16  # a 128 x 512 matrix's walk, seconds
        assert math.isfinite(walk) and walk > 0, (t, r.comp_weight[t], r.comp_step[t])
    for what in (r.gemm, r.gemm1, r.chol, r.sha256, r.copy, r.curvature, r.seconds):
        assert math.isfinite(what) and what > 0
    assert 1.0 <= r.parallel <= 2.0
    # the grid types whose setup takes longer than the probe may are priced from IQ2_XXS's rate;
    # every other type, IQ3_XXS's grid included (set up in under a second), is probed itself
    assert set(r.bare) == {"Q8_0", "Q6_K", "Q5_K", "IQ4_XS", "IQ3_S", "Q2_K"}  # the others need a vector
    assert set(r.derived) == {t for t in DEFAULT_CANDIDATES if t in DERIVED} == {"IQ2_S", "IQ1_S"}
    for t in r.derived:
        assert r.quant[t] == pytest.approx(r.quant[BASE] / DERIVED[t]["plain"])
        assert r.comp_weight[t] == pytest.approx(r.comp_weight[BASE] * DERIVED[t]["packed"])  # the default walk


def test_no_compensation_no_hessians_and_plain_candidates(gate_model_dir, tmp_path):
    on, _ = _plan(gate_model_dir, tmp_path, ["--method", "sensitivity"])
    off, _ = _plan(gate_model_dir, tmp_path, ["--method", "sensitivity", "--error_compensation", "none"])
    assert "Hessians (error compensation)" in _names(on)
    assert "Hessians (error compensation)" not in _names(off)
    assert _stage(on, "candidates") > _stage(off, "candidates")  # the walk and the factors
    assert _stage(on, "load and hash the weights") == _stage(off, "load and hash the weights")


def test_forward_stages_scale_with_the_tokens(gate_model_dir, tmp_path):
    def hess(n):
        p, _ = _plan(gate_model_dir, tmp_path, ["--compensation_sequences", str(n), "--method", "sensitivity"])
        return _stage(p, "Hessians (error compensation)")

    def fisher(n):
        p, _ = _plan(gate_model_dir, tmp_path, ["--sensitivity_sequences", str(n), "--method", "sensitivity",
                                                "--error_compensation", "none"])
        return _stage(p, "sensitivity pass")

    for f in (hess, fisher):  # linear in the sequences: each one adds the same seconds
        a, b, c = f(1), f(2), f(3)
        assert b - a > 0 and c - b == pytest.approx(b - a, rel=1e-9)
    steps = [_stage(_plan(gate_model_dir, tmp_path, extra)[0], "training steps")
             for extra in ([], ["--max_steps", "200"], ["--batch_size", "2"])]
    assert steps[1] == pytest.approx(2 * steps[0]) and steps[2] == pytest.approx(2 * steps[0])


def test_workers_divide_the_candidates():
    jobs = [tm.Job(f"t{i}", "Q4_K", 256, 512, compensated=False) for i in range(16)]
    one, _ = tm.candidate_seconds(jobs, _rates(), [], 1)
    two, _ = tm.candidate_seconds(jobs, _rates(parallel=2.0, workers=2), [], 2)
    slow, _ = tm.candidate_seconds(jobs, _rates(parallel=1.3, workers=2), [], 2)  # another job holds a core
    assert two == pytest.approx(one / 2)
    assert slow == pytest.approx(one / 1.3)
    # never faster than its longest job
    big = [tm.Job("head", "IQ2_XXS", 4096, 512, compensated=False)] + jobs[:1]
    alone = tm.job_seconds(big[0], _rates())
    assert tm.candidate_seconds(big, _rates(parallel=2.0, workers=2), [], 2)[0] >= alone


def test_a_tensor_without_an_imatrix_vector_takes_the_bare_rate(gate_model_dir, tmp_path):
    r = _rates()
    with_vec = tm.Job("w", "Q4_K", 256, 512, compensated=False)
    without = dataclasses.replace(with_vec, imatrix=False)
    assert tm.job_seconds(with_vec, r) == pytest.approx(256 * 512 / 4e6)
    assert tm.job_seconds(without, r) == pytest.approx(256 * 512 / 8e6)
    assert tm.job_seconds(dataclasses.replace(without, qtype="Q6_K"), r) == pytest.approx(256 * 512 / 3e6)  # none probed bare
    flags = ["--method", "sensitivity", "--error_compensation", "none"]
    none, run = _plan(gate_model_dir, tmp_path, flags)
    every, _ = _plan(gate_model_dir, tmp_path, flags, covered={p.gguf_name for p in run.plans})
    assert _stage(every, "candidates") > _stage(none, "candidates")  # Q4_K searched against the vectors


def test_compensated_jobs_add_the_walk_and_the_factors():
    plain = tm.Job("w", "Q4_K", 256, 512, compensated=False)
    comp = dataclasses.replace(plain, compensated=True)
    r = _rates()
    extra = r.comp_weight["Q4_K"] * 256 * 512 + r.comp_step["Q4_K"] * 512 / 32 + 256 * 512 ** 2 / r.gemm1
    assert tm.job_seconds(comp, r) == pytest.approx(tm.job_seconds(plain, r) + extra)
    # a type whose bytes the walk writes pays the walk alone (its superblocks quantized inside it)
    assert tm.job_seconds(comp, dataclasses.replace(r, written=("Q4_K",))) == pytest.approx(extra)
    assert tm.job_seconds(plain, dataclasses.replace(r, written=("Q4_K",))) == tm.job_seconds(plain, r)
    without, _ = tm.candidate_seconds([comp], r, [], 1)
    with_factor, _ = tm.candidate_seconds([comp], r, [1024], 1)
    assert with_factor - without == pytest.approx(1024 ** 3 / 3 / r.chol)  # at the probe's width, its rate
    assert tm.factor_seconds(8960, r) == pytest.approx(8960 ** 3 / 3 / (r.chol * tm.CHOL_LARGE))


def test_cached_candidates_are_not_built(gate_model_dir, tmp_path):
    fresh, run = _plan(gate_model_dir, tmp_path, ["--method", "sensitivity", "--error_compensation", "none"])
    every = {(p.name, t) for p in run.plans for t in p.menu.types}
    cached, _ = _plan(gate_model_dir, tmp_path, ["--method", "sensitivity", "--error_compensation", "none"],
                      cached=every)
    r = _rates()
    weights = 4.0 * sum(int(np.prod(p.shape)) for p in run.plans)
    assert _stage(cached, "candidates") == pytest.approx(weights / r.sha256 + weights / r.copy)  # the parent's pass
    assert _stage(fresh, "candidates") > 2 * _stage(cached, "candidates")


def test_the_cache_is_matched_by_name_shape_type_and_imatrix(gate_model_dir, tmp_path):
    from voodoo_quant.candidates.cache import CandidateCache

    _, run = _plan(gate_model_dir, tmp_path)
    p = run.plans[0]
    rows = int(np.prod(p.shape)) // p.n_per_row
    m = np.random.default_rng(0).standard_normal((rows, p.n_per_row)).astype(np.float32)
    root = tmp_path / "cache"
    CandidateCache(root).get_or_build(m, "Q8_0", name=p.name, workers=1)
    assert tm.cached_candidates(run.plans, {}, root) == {(p.name, "Q8_0")}
    vec = np.ones(p.n_per_row, dtype=np.float32)  # with an imatrix vector: another key, not found
    assert tm.cached_candidates(run.plans, {p.gguf_name: vec}, root) == set()
    CandidateCache(root).get_or_build(m, "Q4_K", imatrix=vec, name=p.name, workers=1)
    assert tm.cached_candidates(run.plans, {p.gguf_name: vec}, root) == {(p.name, "Q4_K")}
    assert tm.cached_candidates(run.plans, {}, root) == {(p.name, "Q8_0")}
    assert tm.cached_candidates(run.plans[1:], {}, root) == set()  # another tensor's name


def test_shared_inputs_are_one_hessian(gate_model_dir):
    cfg = parse_train_flags(["--model", str(gate_model_dir / "model"), "--candidate_types", "Q8_0", "Q4_K",
                             "--compression_ratio", "0.6"])
    run = dry_run(cfg)
    shp = tm.model_shapes(text_skeleton(cfg.model), run.plans, 32)
    # per layer q/k/v read one input, gate/up one, o and down their own; the tied head its own
    assert sorted(shp.inputs) == sorted([256, 256, 256, 512] * 2 + [256])


def test_sequences_follow_the_hold_aside(gate_model_dir):
    cfg = parse_train_flags(["--model", str(gate_model_dir / "model"), "--compression_ratio", "0.6"])
    s = sequences(cfg, 12)  # gates: the last min(8, 12 // 4) sequences held aside
    assert (s.held, s.compensation, s.sensitivity) == (3, 9, 4)
    k = sequences(dataclasses.replace(cfg, method="sensitivity"), 12)
    assert (k.held, k.compensation, k.sensitivity) == (0, 12, 4)


def test_no_time_plan_off_the_cpu(gate_model_dir):
    cfg = parse_train_flags(["--model", str(gate_model_dir / "model"), "--compression_ratio", "0.6",
                             "--device", "cuda"])
    run = dry_run(cfg)
    plan, why = time_plan_for(cfg, text_skeleton(cfg.model), run.plans, run.budget, set())
    assert plan is None and "CPU" in why


def test_train_dry_run_prints_the_time(gate_model_dir, tmp_path, synthetic_run_inputs):
    """The dry run of the default menu, with an imatrix so every one of its ten types is on the
    256-wide rows' menus: each is priced, probed itself or, for the grid types the probe leaves
    out, from IQ2_XXS's rate by rates.DERIVED, as its assumes-line says."""
    synthetic_run_inputs(gate_model_dir / "model", tmp_path)  # tmp_path/imatrix.gguf
    res = CliRunner().invoke(app, ["train", "--model", str(gate_model_dir / "model"), "--data_dir",
                                   str(gate_model_dir / "data"), "--output_dir", str(tmp_path / "out"),
                                   "--imatrix", str(tmp_path / "imatrix.gguf"), "--compression_ratio", "0.6",
                                   "--seq_len", "32", "--dry_run"])
    assert res.exit_code == 0, res.output[-2000:]
    out = res.output
    assert "predicted wall time on this machine" in out
    for stage in ("load and hash the weights", "Hessians (error compensation)", "candidates", "sensitivity pass",
                  "training steps", "guarantee", "TOTAL (voodoo train)", "then export"):
        assert stage in out, stage
    assert "12 sequences" in out  # the tokens file was read for the counts
    menus = next(line for line in out.splitlines() if "assumes: menus " in line)
    assert menus.split("assumes: menus ")[1].split(" (")[0].split() == sorted(DEFAULT_CANDIDATES)
    derived = set(menus.split(" (")[1].split(" priced from")[0].split(", "))
    assert derived & set(DEFAULT_CANDIDATES) == {"IQ2_S", "IQ1_S"} and derived <= set(DERIVED)
    assert not (tmp_path / "out").exists()
