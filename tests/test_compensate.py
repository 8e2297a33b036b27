"""Error compensation (voodoo_quant/candidates/compensate.py, training/hessians.py): the quantizer is handed
W' instead of W, so that each block's rounding error is absorbed by the later columns.

- W' lowers the layer-output error ‖(W − Ŵ)X‖² against plain quantization, for legacy, K- and
  IQ types (this can fail: a wrong sign or a wrong factor makes it worse);
- it is deterministic, whatever torch's thread count; float types and dead columns are untouched;
- the cache keys compensated bytes apart from plain ones, and a plain key is what it always was;
- the Hessians are XᵀX of each Linear's input, one per shared input, in GGUF column order;
- end to end: a run with ``--error_compensation gptq`` exports exactly the bytes of its training
  candidates (which differ from plain quantization), and export refuses a changed or missing
  Hessians file.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from voodoo_quant.candidates.cache import FORMAT, CandidateCache
from voodoo_quant.candidates.compensate import (
    Compensation, QuantInputs, compensated_matrix, compensation_of, quantize_compensated,
)
from voodoo_quant.candidates.hessian_store import load_hessians, read_key, write_hessians
from voodoo_quant.core import ggml
from voodoo_quant.core.errors import CorruptFileError, QuantizationInputError


def _problem(rows=64, n=512, tokens=4096, seed=0):
    """W and inputs X with correlated features (as a layer's inputs are), and H = XᵀX."""
    rng = np.random.default_rng(seed)
    mix = rng.normal(size=(n, n)) / np.sqrt(n) + np.eye(n)
    scale = np.exp(rng.normal(0, 0.7, n))  # uneven feature scales, as real activations have
    X = (rng.normal(size=(tokens, n)) @ mix) * scale
    W = rng.normal(0, 0.02, (rows, n)).astype(np.float32)
    H = (X.T @ X).astype(np.float32)
    imx = (X ** 2).mean(0).astype(np.float32)  # the imatrix is the diagonal's mean
    return W, X, H, imx


def _out_err(W, data, q, X):
    Wq = ggml.lib().dequantize(data, q, W.shape)
    D = (W.astype(np.float64) - Wq) @ X.T
    return float((D ** 2).sum())


@pytest.mark.parametrize("q", ["Q4_0", "Q5_1", "Q8_0", "IQ4_NL", "Q4_K", "Q5_K", "Q3_K", "IQ3_S"])
def test_compensation_lowers_the_layer_output_error(q):
    W, X, H, imx = _problem()
    plain = ggml.lib().quantize(W, q, imx)
    comp = quantize_compensated(W, q, imx, Compensation(H, 0.01))
    e0, e1 = _out_err(W, plain, q, X), _out_err(W, comp, q, X)
    print(f"{q}: output error {e1 / e0:.3f} of plain")
    assert e1 < 0.9 * e0, (q, e0, e1)


@pytest.mark.parametrize("seed", [0, 1])
def test_q5_k_is_compensated_a_whole_superblock_at_a_time(seed, monkeypatch):
    """The "requant" sweep: Q5_K's sub-block scales are coded against its superblock's: a superblock quantized again after
    each sub-block moves those already fixed, and one step per superblock leaves the lower error
    (measured 0.90 and 0.96 of the 32-column steps here; 0.69-0.72 on SmolLM2's ffn_down)."""
    from voodoo_quant.candidates import compensate

    W, X, H, imx = _problem(seed=seed)
    assert "Q5_K" in compensate.WHOLE_SUPERBLOCK
    whole = _out_err(W, quantize_compensated(W, "Q5_K", imx, Compensation(H, 0.01, "requant")), "Q5_K", X)
    key = Compensation(H, 0.01, "requant").digest
    monkeypatch.setattr(compensate, "WHOLE_SUPERBLOCK", frozenset())
    assert Compensation(H, 0.01, "requant").digest != key  # another walk: the cache never serves the old bytes
    steps = _out_err(W, quantize_compensated(W, "Q5_K", imx, Compensation(H, 0.01, "requant")), "Q5_K", X)
    assert whole < 0.98 * steps, (whole, steps)


def test_deterministic_whatever_the_thread_count():
    W, _, H, imx = _problem(seed=1)
    c = Compensation(H, 0.1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a = compensated_matrix(W, "Q5_0", imx, c)
        torch.set_num_threads(max(2, threads))
        b = compensated_matrix(W, "Q5_0", imx, Compensation(H.copy(), 0.1))
    finally:
        torch.set_num_threads(threads)
    assert torch.get_num_threads() == threads
    assert a.tobytes() == b.tobytes()
    assert not np.array_equal(a, W)


def test_float_types_and_dead_columns_are_left_alone():
    W, _, H, imx = _problem(seed=2)
    c = Compensation(H, 0.1)
    assert compensated_matrix(W, "F16", imx, c).tobytes() == W.tobytes()
    assert quantize_compensated(W, "F16", None, c) == ggml.lib().quantize(W, "F16")
    H2 = H.copy()
    H2[:, 40] = H2[40, :] = 0  # a feature never active on the calibration text
    out = compensated_matrix(W, "Q4_0", imx, Compensation(H2, 0.1))
    assert np.array_equal(out[:, 40], W[:, 40])
    assert quantize_compensated(W, "Q4_0", imx, None) == ggml.lib().quantize(W, "Q4_0", imx)


def test_bad_inputs_are_refused_before_any_call_into_c():
    W, _, H, imx = _problem(seed=3)
    with pytest.raises(QuantizationInputError, match="columns"):
        compensated_matrix(W[:, :128], "Q4_0", imx[:128], Compensation(H, 0.1))
    with pytest.raises(QuantizationInputError, match="square float32"):
        Compensation(H.astype(np.float64))
    with pytest.raises(QuantizationInputError, match="NaN"):
        Compensation(np.full((4, 4), np.nan, np.float32))
    with pytest.raises(QuantizationInputError, match="damping"):
        Compensation(H, 0.0)


def test_the_cache_keys_compensated_bytes_apart_and_plain_keys_are_unchanged():
    import hashlib

    W, _, H, imx = _problem(seed=4)
    plain = CandidateCache.key(W, "Q4_K", imx, "v")
    old = hashlib.sha256(json.dumps([FORMAT, plain.content, list(plain.shape), plain.qtype, plain.imatrix,
                                     plain.lib_version]).encode()).hexdigest()
    assert plain.compensation is None and plain.digest == old  # caches made before stay valid
    a = CandidateCache.key(W, "Q4_K", imx, "v", compensation=Compensation(H, 0.1))
    b = CandidateCache.key(W, "Q4_K", imx, "v", compensation=Compensation(H, 0.2))
    assert len({plain.digest, a.digest, b.digest}) == 3
    assert CandidateCache.key(W, "F16", None, "v", compensation=Compensation(H, 0.1)).compensation is None


def test_cache_builds_the_compensated_bytes(tmp_path):
    from voodoo_quant.candidates.precache import CandidateJob, build_all

    W, _, H, imx = _problem(seed=5)
    c = Compensation(H, 0.1)
    cache = CandidateCache(tmp_path)
    rep = build_all([CandidateJob("w", "Q5_0", matrix=W, imatrix=imx, compensation=c),
                     CandidateJob("w", "Q8_0", matrix=W, imatrix=imx, compensation=c)], cache, workers=1,
                    progress=False)
    for q in ("Q5_0", "Q8_0"):
        got = rep.paths[("w", q)].read_bytes()
        assert got == quantize_compensated(W, q, imx, c)
        assert got != ggml.lib().quantize(W, q, imx)


def test_an_in_process_build_drops_the_factors_it_kept(tmp_path, monkeypatch):
    """The factors are kept for a tensor's next type; once a build in this process is over they
    are dropped, or a run with one quantization process would hold them through its training."""
    from voodoo_quant.candidates import compensate
    from voodoo_quant.candidates.precache import CandidateJob, build_all

    W, _, H, _ = _problem(rows=16, n=256, tokens=1024, seed=6)
    c = Compensation(H, 0.1)
    compensate.release_factors()  # what earlier tests in this process left
    kept = []
    real = compensate.compensated
    monkeypatch.setattr(compensate, "compensated",
                        lambda *a, **k: (kept.append(len(compensate._FACTORS)), real(*a, **k))[1])
    build_all([CandidateJob("w", "Q5_0", matrix=W, compensation=c), CandidateJob("w", "Q4_0", matrix=W, compensation=c)],
              CandidateCache(tmp_path), workers=1, progress=False)
    assert kept == [0, 1]  # the second type reused the first's factor
    assert not compensate._FACTORS


def test_quant_inputs_are_the_vectors_plus_compensations():
    c = Compensation(np.eye(4, dtype=np.float32))
    qi = QuantInputs({"blk.0.attn_q.weight": np.ones(4, np.float32)}, {"model.x.weight": c})
    assert set(qi) == {"blk.0.attn_q.weight"} and qi.get("nope") is None
    assert compensation_of(qi, "model.x.weight") is c and compensation_of({"a": 1}, "model.x.weight") is None
    assert bool(QuantInputs({}, {"x": c})) and not bool(QuantInputs({}, {}))


def test_hessians_file_round_trip_and_refusals(tmp_path):
    from safetensors.numpy import load_file

    H = np.arange(16, dtype=np.float32).reshape(4, 4)
    p = tmp_path / "h.safetensors"
    write_hessians(p, {"a": 4, "c": 4}, {"b": "a"}, "k1", iter([("a", H), ("c", H + 1)]))
    got = load_hessians(p)
    assert isinstance(got["a"], np.memmap) and not got["a"].flags.writeable  # mapped, never held
    assert np.array_equal(got["a"], H) and got["b"] is got["a"] and np.array_equal(got["c"], H + 1)
    assert set(load_file(str(p))) == {"a", "c"}  # a plain safetensors file; a shared input stored once
    assert read_key(p) == "k1" and load_hessians(p, key="k2") is None
    # in any order (a layer-by-layer collection gives the head's last): each at its offset, the same file
    write_hessians(tmp_path / "y.safetensors", {"a": 4, "c": 4}, {"b": "a"}, "k1", iter([("c", H + 1), ("a", H)]))
    assert (tmp_path / "y.safetensors").read_bytes() == p.read_bytes()
    with pytest.raises(QuantizationInputError, match="not declared, or is written twice"):
        write_hessians(tmp_path / "x.safetensors", {"a": 4, "c": 4}, {}, "k", iter([("c", H), ("c", H)]))
    with pytest.raises(QuantizationInputError, match="not declared"):
        write_hessians(tmp_path / "x.safetensors", {"a": 4, "c": 4}, {}, "k", iter([("a", H), ("b", H)]))
    with pytest.raises(QuantizationInputError, match="never written"):
        write_hessians(tmp_path / "x.safetensors", {"a": 4, "c": 4}, {}, "k", iter([("a", H)]))
    with pytest.raises(QuantizationInputError, match="shared"):
        write_hessians(tmp_path / "x.safetensors", {"a": 4}, {"b": "z"}, "k", iter([("a", H)]))
    assert not (tmp_path / "x.safetensors").exists()  # a failed write leaves nothing behind
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(p.read_bytes()[:-8])
    with pytest.raises(CorruptFileError, match="inside the file"):
        load_hessians(cut)
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CorruptFileError):
        load_hessians(tmp_path / "bad.safetensors")
    assert read_key(tmp_path / "bad.safetensors") is None


def test_a_plans_hessian_is_read_at_its_one_linear():
    from types import SimpleNamespace

    from voodoo_quant.training.hessians import reader

    mods = {"emb": torch.nn.Embedding(10, 4), "head": torch.nn.Linear(4, 10), "o": torch.nn.Linear(4, 4),
            "norm": torch.nn.LayerNorm(4)}

    def r(*names):
        return reader(SimpleNamespace(modules=list(names)), mods)

    assert r("emb", "head") == "head"  # a tied embedding: the LM head's input
    assert r("head") == "head" and r("o") == "o"
    assert r("emb") is None  # an untied embedding reads token ids, not features
    assert r("head", "o") is None and r("norm") is None and r("o", "norm") is None


def test_collected_hessians_are_xtx_of_each_linear_input(tiny_llama_hf_dir):
    from voodoo_quant.model.modeling import load_model
    from voodoo_quant.training.config import TrainConfig
    from voodoo_quant.training.hessians import collect, collect_passes, reader
    from voodoo_quant.training.setup import plan_run

    model = load_model(str(tiny_llama_hf_dir), dtype=torch.float32).eval()
    cfg = TrainConfig(model=str(tiny_llama_hf_dir), candidate_types=("Q8_0", "Q4_0"), compression_ratio=0.6)
    _, plans, _ = plan_run(cfg, model)
    tokens = torch.randint(0, model.config.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    hs = collect(model, plans, tokens, batch_size=2)
    seen = {}
    mods = dict(model.named_modules())
    hooks = [mods[reader(p, mods)].register_forward_hook(
        lambda m, i, o, n=p.name: seen.setdefault(n, []).append(i[0].reshape(-1, i[0].shape[-1])))
        for p in plans if p.name in hs]
    with torch.no_grad():
        model(tokens)
    for h in hooks:
        h.remove()
    assert any("q_proj" in n for n in hs) and any("down_proj" in n for n in hs)
    embd = [p for p in plans if "embed" in p.name]
    assert len(embd) == 1 and "lm_head" in embd[0].modules  # the fixture's embedding is tied
    assert embd[0].name in hs  # compensated as the head: H of the final hidden states
    by = {p.name: p for p in plans}
    for n, H in hs.items():
        x = torch.cat(seen[n]).double()
        ref = (x.T @ x).numpy()
        from voodoo_quant.training.hessians import gguf_columns

        _, cols = gguf_columns(by[n].layout)
        if cols is not None:
            ref = ref[np.ix_(cols, cols)]
        np.testing.assert_allclose(H, ref, rtol=2e-4, atol=1e-3 * np.abs(ref).max())
    q = [n for n in hs if n.endswith("q_proj.weight")][0]
    assert hs[q] is hs[q.replace("q_proj", "v_proj")]  # one shared input, one H
    # in passes of at most one input's accumulator: the same matrices, one forward per stored input
    c = collect_passes(model, plans, tokens, batch_size=2, pass_bytes=1)
    arrays = dict(c.arrays)
    assert c.passes == len(c.sizes) > 1 and set(arrays) == set(c.sizes) and set(c.sizes) | set(c.shared) == set(hs)
    for n, H in hs.items():
        np.testing.assert_array_equal(arrays[c.shared.get(n, n)], H)


@pytest.fixture(scope="module")
def trained_gptq(imatrix_llama256_hf_dir, synthetic_run_inputs, tmp_path_factory):
    from voodoo_quant.training.config import TrainConfig
    from voodoo_quant.training.trainer import Trainer

    d = imatrix_llama256_hf_dir
    root = tmp_path_factory.mktemp("gptq")
    synthetic_run_inputs(d, root)
    cfg = TrainConfig(model=str(d), data_dir=str(root / "data"), imatrix=str(root / "imatrix.gguf"), seq_len=32,
                      batch_size=2, max_steps=2, compression_ratio=0.55, candidate_types=("Q8_0", "Q4_K", "Q3_K"),
                      output_dir=str(root / "run"), error_compensation="gptq", compensation_sequences=4,
                      search_evals=4)
    tr = Trainer(cfg)
    res = tr.train()
    return root, d, tr, res


@pytest.mark.slow
def test_gptq_run_exports_exactly_its_training_candidates(trained_gptq, tmp_path, monkeypatch):
    from voodoo_quant.gguf import converter
    from voodoo_quant.selection.assignment import Assignment
    from voodoo_quant.candidates.compensate import compensations
    from voodoo_quant.gguf.imatrix import load
    from voodoo_quant.model.modeling import load_model
    from voodoo_quant.student.build import selectable_weights
    from voodoo_quant.tools.export import ExportConfig, export

    root, d, tr, res = trained_gptq
    asg = Assignment.load(root / "run" / "assignment.json")
    rec = asg.compensation
    assert rec and rec["method"] == "gptq" and rec["damp"] == 0.1 and rec["tensors"] > 0
    out = export(ExportConfig(model=d, assignment=root / "run" / "assignment.json", output_dir=root / "out",
                              output_name="tiny.gguf"))
    cache, cache_dir = CandidateCache(), os.environ.get("VOODOO_CACHE_DIR")
    # on a machine without the candidates (an empty cache) export computes W' again: the same file
    monkeypatch.setenv("VOODOO_CACHE_DIR", str(tmp_path / "empty-cache"))
    again = export(ExportConfig(model=d, assignment=root / "run" / "assignment.json", output_dir=tmp_path / "out",
                                output_name="tiny.gguf"))
    assert not (tmp_path / "empty-cache").exists() or not any((tmp_path / "empty-cache").rglob("data.bin"))
    assert again.path.read_bytes() == out.path.read_bytes()
    # where the candidates are cached (the training machine), export reads them and computes nothing
    from voodoo_quant.candidates import compensate

    def boom(*a, **k):
        raise AssertionError("export recomputed a cached compensated candidate")

    if cache_dir is None:
        monkeypatch.delenv("VOODOO_CACHE_DIR")
    else:
        monkeypatch.setenv("VOODOO_CACHE_DIR", cache_dir)
    monkeypatch.setattr(compensate, "compensated", boom)
    cached = export(ExportConfig(model=d, assignment=root / "run" / "assignment.json", output_dir=tmp_path / "cached",
                                 output_name="tiny.gguf"))
    assert cached.path.read_bytes() == out.path.read_bytes()
    monkeypatch.undo()
    r = converter.vendored_gguf().GGUFReader(out.path)
    assert r.fields["voodoo.error_compensation"].contents() == "gptq"
    ours = {t.name: np.asarray(t.data).view(np.uint8).tobytes() for t in r.tensors}
    imx = load(root / "imatrix.gguf")
    comps = compensations(load_hessians(rec["hessians"]), rec["damp"])
    weights = {n: w for n, (w, _) in selectable_weights(load_model(str(d), dtype=torch.float32)).items()}
    plans = {p.name: p for p in tr.run.plans}
    compensated = 0
    for name, c in asg.tensors.items():
        p = plans[name]
        m = p.layout.to_gguf(weights[name])
        vec = imx.get_vector(p.gguf_name, p.n_per_row)
        # a guarantee reference's off-menu type (if one won or the search took it) is plain (guarantee.py)
        assert c.compensated is (c.qtype in c.menu), (name, c.qtype, c.compensated)
        cand = cache.get(CandidateCache.key(m, c.qtype, vec, compensation=comps.get(name) if c.compensated else None))
        assert cand is not None, f"{name}: no cache entry for its {c.qtype} candidate"
        assert ours[c.gguf_name] == cand, f"{name}: exported bytes differ from the training candidate"
        if c.compensated:
            compensated += 1
            assert cand != ggml.lib().quantize(m, c.qtype, vec), f"{name}: compensation changed nothing"
    assert set(asg.tensors) <= set(comps)  # every Linear, and the tied embedding as the LM head
    assert compensated == sum(c.qtype in c.menu for c in asg.tensors.values())  # each at a menu type


def test_export_refuses_a_changed_or_missing_hessians_file(trained_gptq, tmp_path):
    from voodoo_quant.selection.assignment import Assignment
    from voodoo_quant.training.provenance import ProvenanceMismatchError, resolve_compensation

    root, d, tr, res = trained_gptq
    asg = Assignment.load(root / "run" / "assignment.json")
    copy = tmp_path / "hessians.safetensors"
    h = load_hessians(asg.compensation["hessians"])
    k = sorted(h)[0]
    write_hessians(copy, {n: v.shape[0] for n, v in h.items()}, {}, "x",
                   ((n, v * 2 if n == k else v) for n, v in h.items()))
    moved = Assignment.from_dict({**asg.to_dict(), "compensation": {**asg.compensation, "hessians": str(copy)}})
    with pytest.raises(ProvenanceMismatchError, match="Hessians mismatch"):
        resolve_compensation(moved, allow=False)
    assert set(resolve_compensation(moved, allow=True)) == set(h)  # the override exports anyway
    gone = Assignment.from_dict({**asg.to_dict(), "compensation": {**asg.compensation,
                                                                  "hessians": str(tmp_path / "nope.safetensors")}})
    with pytest.raises(ProvenanceMismatchError, match="Hessians missing"):
        resolve_compensation(gone, allow=True)


def test_a_finalize_records_the_compensation_its_candidates_had(gate_model_dir, tmp_path):
    """Redoing only the bake reads no candidate when nothing needs the sensitivity table; the
    assignment must still record the compensation, or export would write plain bytes."""
    from voodoo_quant.training.config import TrainConfig
    from voodoo_quant.training.trainer import Trainer

    d = gate_model_dir
    kw = dict(model=str(d / "model"), data_dir=str(d / "data"), seq_len=32, batch_size=2, max_steps=2,
              compression_ratio=0.6, candidate_types=("Q8_0", "Q4_K"), error_compensation="gptq",
              compensation_sequences=2, warm_start=False, polish=False, guarantee=False, search_evals=0,
              partial_save_interval=1)
    res = Trainer(TrainConfig(**kw, output_dir=str(tmp_path / "a"))).train()
    assert res.assignment.compensation["method"] == "gptq"
    fin = Trainer(TrainConfig(**kw, output_dir=str(tmp_path / "a"),
                              finalize_from_partial=str(tmp_path / "a" / "partial.pt"))).train()
    assert fin.assignment.compensation == res.assignment.compensation
    assert fin.assignment.to_dict()["tensors"] == res.assignment.to_dict()["tensors"]


def test_auto_compensation_is_gptq_in_one_process():
    from voodoo_quant.core.errors import ConfigError
    from voodoo_quant.training.config import TrainConfig

    assert TrainConfig(model="m", compression_ratio=0.6).error_compensation == "auto"
    assert TrainConfig(model="m", compression_ratio=0.6).compensation == "gptq"
    assert TrainConfig(model="m", compression_ratio=0.6, lazy=True).compensation == "gptq"  # collected layer by layer
    assert TrainConfig(model="m", compression_ratio=0.6, tensor_parallel=2).compensation == "gptq"  # rank 0 collects
    assert TrainConfig(model="m", compression_ratio=0.6, error_compensation="gptq", tensor_parallel=2).compensation == "gptq"
    assert TrainConfig(model="m", compression_ratio=0.6, error_compensation="none").compensation == "none"
    with pytest.raises(ConfigError, match="error_compensation"):
        TrainConfig(model="m", compression_ratio=0.6, error_compensation="yes")


def test_a_tensors_factor_is_kept_for_its_next_type_and_changes_no_bit(monkeypatch):
    from voodoo_quant.candidates import compensate

    W, X, H, _ = _problem(rows=16, n=256, tokens=1024)
    c = Compensation(H)
    compensate._FACTORS.clear()
    first = compensated_matrix(W, "Q4_0", None, c)
    assert c.factor() is c.factor()  # kept: the next type of this tensor reuses it
    again = compensated_matrix(W, "Q4_0", None, c)
    np.testing.assert_array_equal(first, again)
    monkeypatch.setattr(compensate, "FACTOR_CACHE_BYTES", 4 * 256 * 256 - 1)  # one float32 factor is over the budget
    compensate._FACTORS.clear()
    assert c.factor() is not c.factor() and not compensate._FACTORS


def _mapped_kib(path) -> int:
    """KiB of `path`'s pages resident in this process (its mappings' Rss in /proc/self/smaps)."""
    total, ours = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and not line.startswith(("Rss", "Size")):
            ours = len(head) >= 6 and head[-1] == str(path)
        elif ours and line.startswith("Rss:"):
            total += int(head[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux's /proc/self/smaps")
def test_mapped_hessians_leave_the_resident_set_once_read(tmp_path):
    """A run builds every compensated tensor in one process: a Hessian mapped from its file is read
    (checked, hashed, factored) and its pages given back, so the resident set never holds the whole
    file (9.8 GB at 1.5B); the factors and W' are the same bits as from an array in memory."""
    from voodoo_quant.candidates import compensate
    from voodoo_quant.candidates.hessian_store import load_hessians, write_hessians

    n, k = 512, 12
    hs = {f"t{i}": _problem(rows=2, n=n, tokens=1024, seed=40 + i)[2] for i in range(k)}
    p = tmp_path / "hessians.safetensors"
    write_hessians(p, {name: n for name in hs}, {}, "key", hs.items())
    mapped = load_hessians(p)
    comps = {name: Compensation(h, 0.1) for name, h in mapped.items()}
    assert _mapped_kib(p) <= 4 * n * n // 1024  # checked for NaN/Inf: at most one Hessian's pages left
    W = _problem(rows=8, n=n, tokens=1024, seed=40)[0]
    for name, c in comps.items():
        compensate.release_factors()
        c.factor()
        assert _mapped_kib(p) <= 4 * n * n // 1024
    compensate.release_factors()
    assert np.array_equal(compensated_matrix(W, "Q4_K", None, comps["t0"]),
                          compensated_matrix(W, "Q4_K", None, Compensation(hs["t0"].copy(), 0.1)))
    assert comps["t0"].digest == Compensation(hs["t0"].copy(), 0.1).digest


def test_a_read_only_matrix_is_walked_silently_and_left_as_it_was():
    """The weights often come as a read-only map of the checkpoint: the walk only reads them, so
    torch's warning about writing to a non-writable array would be noise (and a false alarm)."""
    W, _, H, imx = _problem(seed=3)
    ro = W.copy()
    ro.setflags(write=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = compensated_matrix(ro, "Q5_0", imx, Compensation(H, 0.1))
    assert ro.tobytes() == W.tobytes()
    assert out.tobytes() == compensated_matrix(W, "Q5_0", imx, Compensation(H, 0.1)).tobytes()
