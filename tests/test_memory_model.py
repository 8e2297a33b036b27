"""The memory model and the dry run: planned from a config alone, no tokens file, no weights.

Its agreement with measured peaks is bench/memory_model.py (CPU, three sizes); here: the dry run
runs where the run could not (no tokens, no weights, no GPU), the terms move the way the flags
say, and the reference recipe (27B hybrid, TP-4) prints a plan with a fit verdict and, when it
does not fit, the flags to change."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from voodoo_quant.cli.tp import parse_train_flags
from voodoo_quant.memory.dry_run import dry_run

ROOT = Path(__file__).resolve().parents[1]
CONFIG_27B = ROOT / "bench" / "configs" / "qwen35_27b"
RECIPE = [
    "--model", str(CONFIG_27B), "--base_checkpoint", "nowhere/base.pt", "--text_model_class", "qwen3_5_text",
    "--teacher_quant", "Q8_0", "--teacher_checkpoint", "nowhere/teacher.pt", "--compression_ratio", "0.30",
    "--budget_reduction", "0.03", "--seq_len", "8192", "--batch_size", "1", "--max_steps", "100", "--lazy",
    "--imatrix", "imatrix.gguf", "--candidate_types", "Q8_0", "Q5_K", "IQ3_S", "IQ2_S", "IQ2_XXS", "IQ1_S",
    "--attention_candidates", "Q5_K", "IQ3_S", "IQ2_S", "IQ2_XXS",
    "--non_attention_candidates", "IQ4_XS", "IQ3_S", "IQ2_S", "IQ2_XXS", "IQ1_S",
    "--tensor_parallel", "4", "--gradient_checkpointing", "--data_dir", "nowhere", "--data_name", "train_tokens.pt",
    "--device", "cuda:0", "--dtype", "bfloat16", "--partial_save_interval", "1", "--no_compile",
]


def _cli(*args, env_extra=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "voodoo_quant.cli.app", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)


def test_train_dry_run_needs_no_tokens_file(gate_model_dir, tmp_path):
    p = _cli("train", "--model", str(gate_model_dir / "model"), "--data_dir", str(tmp_path / "no-data"),
             "--output_dir", str(tmp_path / "out"), "--candidate_types", "Q8_0", "Q4_K", "--compression_ratio", "0.6", "--dry_run")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "predicted memory per rank (1 rank(s), cpu)" in p.stdout
    assert "TOTAL (peak)" in p.stdout and "cpu run peak RSS" in p.stdout
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


def _mem(flags):
    return dry_run(parse_train_flags(flags)).memory


def _term(mem, prefix):
    return next(t.bytes for t in mem.device if t.name.startswith(prefix))


def test_terms_follow_the_flags(gate_model_dir, tmp_path, monkeypatch):
    base = ["--model", str(gate_model_dir / "model"), "--data_dir", str(tmp_path), "--candidate_types", "Q8_0", "Q4_0", "--compression_ratio", "0.6",
            "--seq_len", "64"]
    eager, lazy = _mem(base), _mem(base + ["--lazy"])
    # Q8_0 + Q4_0 per weight: packed 34/32 + 18/32 bytes; int8 codes 2 x (1 + 4/32); 2 dense float32 copies
    assert _term(lazy, "candidates (packed") < _term(eager, "candidates (int8 codes")
    assert _term(eager, "candidates (int8 codes") == pytest.approx(_term(lazy, "candidates") * 2.25 / 1.625, rel=1e-6)
    monkeypatch.setenv("VOODOO_MIX_KERNEL", "0")
    stacks = _mem(base)
    monkeypatch.delenv("VOODOO_MIX_KERNEL")
    assert _term(stacks, "candidates (dense") == pytest.approx(_term(lazy, "candidates") * 8 / 1.625, rel=1e-6)
    ckpt = _mem(base + ["--gradient_checkpointing"])
    assert _term(ckpt, "activations") < _term(eager, "activations")
    longer = _mem(base + ["--seq_len", "128"])
    assert 1.9 < _term(longer, "activations") / _term(eager, "activations") < 2.1  # linear in tokens (flash-like)
    bf16 = _mem(base + ["--dtype", "bfloat16"])
    assert _term(bf16, "mixed weights") == _term(eager, "mixed weights") / 2
    tp2 = dry_run(parse_train_flags(base + ["--tensor_parallel", "2"]), world=2).memory
    assert _term(tp2, "mixed weights") == pytest.approx(_term(eager, "mixed weights") / 2, rel=0.01)
    # per-layer mixing under checkpointing, the packed Q8_0 teacher under --lazy, split layer inputs under TP
    assert _term(ckpt, "mixed weights (one layer") < _term(eager, "mixed weights (cached")
    q8 = ["--teacher_quant", "Q8_0"]
    packed, dense = _mem(base + ["--lazy"] + q8), _mem(base + q8)
    assert _term(packed, "teacher weights (packed") == pytest.approx(_term(dense, "teacher weights") * 34 / 32 / 4, rel=0.05)  # float32 default
    tp2c = dry_run(parse_train_flags(base + ["--tensor_parallel", "2", "--gradient_checkpointing"]), world=2).memory
    assert _term(tp2c, "activations") < _term(ckpt, "activations")


def test_the_guarantees_off_menu_candidates_are_planned_as_the_trainer_holds_them(gate_model_dir, tmp_path):
    """The references' types off the menu (a stock recipe's Q6_K, a uniform Q3_K) are quantized in
    the setup and held packed to the end of the run: the plan counts the very bytes the trainer
    keeps, in the training phase of a CPU run and at the loading peak."""
    from voodoo_quant.training.trainer import Trainer

    flags = ["--model", str(gate_model_dir / "model"), "--data_dir", str(gate_model_dir / "data"), "--output_dir",
             str(tmp_path / "run"), "--candidate_types", "Q8_0", "Q4_K", "Q2_K", "--compression_ratio", "0.6",
             "--seq_len", "32", "--batch_size", "2", "--max_steps", "1"]
    mem = _mem(flags)
    planned = _term(mem, "guarantee's off-menu")
    assert next(t.bytes for t in mem.host if t.name.startswith("guarantee's off-menu")) == planned
    tr = Trainer(parse_train_flags(flags))
    tr.prepare()
    held = sum(len(b) for b in tr.run.extra_blobs.values())
    assert held > 0 and planned == held, (planned, held, sorted({t for _, t in tr.run.extra_blobs}))
    for off in (["--no_guarantee"], ["--search_sequences", "0"]):
        assert not any(t.name.startswith("guarantee's off-menu") for t in [*_mem(flags + off).device, *_mem(flags + off).host])


def _sens(mem):
    return [t for t in mem.host if t.name.startswith("sensitivity pass")]


def test_the_sensitivity_pass_is_planned_where_it_runs(gate_model_dir, tmp_path):
    """One process: the Fisher pass runs layer by layer in place at the loading peak, adding the
    stored layer inputs and the float32 accumulators of the embedding and head and of one layer,
    never one per weight (the output-error kind, its Gram matrices). Tensor-parallel rank 0 streams
    it layer by layer before loading: its own phase, its stored layer inputs in the note. Skipped
    when nothing reads it."""
    import torch

    from voodoo_quant.model.modeling import load_model
    from voodoo_quant.training.layerwise import host_bytes

    base = ["--model", str(gate_model_dir / "model"), "--data_dir", str(tmp_path), "--candidate_types", "Q8_0", "Q4_0",
            "--compression_ratio", "0.6", "--seq_len", "64"]
    one = _mem(base)
    (fisher,) = _sens(one)
    assert fisher.name == "sensitivity pass: layer by layer (Fisher)"
    model = load_model(str(gate_model_dir / "model"))
    text = model.config.get_text_config()
    layer = sum(m.weight.numel() for m in model.model.layers[0].modules() if isinstance(m, torch.nn.Linear)) * 4
    emb = model.model.embed_tokens.weight.numel() * 4  # tied: the embedding and the head are one accumulator
    stored = host_bytes(text.num_hidden_layers, 4, 64, text.hidden_size)
    assert fisher.bytes == stored + emb + layer, (fisher.bytes, stored, emb, layer)
    assert fisher.bytes < _term(one, "mixed weights")  # not an accumulator per weight any more
    assert "one per weight" in fisher.note  # the fallback's size, for a model the layer road refuses
    (gram,) = _sens(_mem(base + ["--sensitivity_kind", "output"]))
    from voodoo_quant.training.sensitivity import GRAM_BYTES

    assert gram.name == "sensitivity pass: input Gram matrices" and 0 < gram.bytes <= GRAM_BYTES
    assert gram.bytes != fisher.bytes
    (tp,) = _sens(dry_run(parse_train_flags(base + ["--tensor_parallel", "2"]), world=2).memory)
    assert tp.bytes == 0 and "layer by layer" in tp.note
    # one process with --lazy loads skeletons: a tensor at a time, the pass streamed
    lazy = _mem(base + ["--lazy"])
    (streamed,) = _sens(lazy)
    assert streamed.name == "sensitivity pass (its own phase)" and streamed.bytes == 0
    names = [t.name for t in lazy.host]
    assert "one full tensor in flight (float32)" in names and not any(n.startswith("student + teacher") for n in names)
    assert lazy.host_total < one.host_total
    assert _sens(dry_run(parse_train_flags(base + ["--tensor_parallel", "2", "--no_warm_start", "--no_polish",
                                                   "--no_guarantee", "--search_evals", "0"]), world=2).memory) == []
    # the search alone (off by default) reads the table's curvature, under TP too
    assert _sens(dry_run(parse_train_flags(base + ["--tensor_parallel", "2", "--no_warm_start", "--no_polish",
                                                   "--no_guarantee", "--search_evals", "8"]), world=2).memory)
    assert _sens(dry_run(parse_train_flags(base + ["--tensor_parallel", "2", "--no_warm_start", "--no_polish",
                                                   "--no_guarantee"]), world=2).memory) == []
    # the measured kind: the teacher log-probs and layer outputs HeldAside keeps (vocab 512, 4 x 64
    # tokens, 2 layers x 256 wide, float32), beside the loaded model
    (meas,) = _sens(_mem(base + ["--sensitivity_kind", "measured"]))
    assert meas.name == "sensitivity pass (measured): caches"
    assert meas.bytes == 4 * 64 * 512 * 4 + 2 * 4 * 64 * 256 * 4


def test_the_loading_peak_holds_one_float32_model_for_a_float_teacher(gate_model_dir, tmp_path):
    """training/setup.py float_teacher: a float32 run shares the base's tensors, a bf16 one casts
    from them; a Q8_0 teacher (changed in place) is a second float32 copy."""
    base = ["--model", str(gate_model_dir / "model"), "--data_dir", str(tmp_path), "--candidate_types", "Q8_0", "Q4_0",
            "--compression_ratio", "0.6", "--seq_len", "64"]
    def host(mem, prefix):
        return next(t.bytes for t in mem.host if t.name.startswith(prefix))

    f32 = host(_mem(base), "student + teacher, float32 (shared)")
    assert host(_mem(base + ["--dtype", "bfloat16"]), "student float32 + teacher cast") == pytest.approx(f32 * 1.5)
    assert host(_mem(base + ["--teacher_quant", "Q8_0"]), "student + teacher, float32 (deep copy)") == pytest.approx(2 * f32)


def test_reference_recipe_plans_from_a_config_alone():
    """27B hybrid, TP-4, seq 8192, --lazy, Q8_0 teacher: no weights, checkpoints, tokens or GPU here."""
    p = _cli("tp", "--nproc", "4", "--", *RECIPE, "--output_dir", "/nonexistent/out", "--dry_run",
             env_extra={"VOODOO_DEVICE_MEMORY_GB": "32"})
    assert p.returncode == 0, p.stderr[-2000:]
    out = p.stdout
    assert "selectable tensors: 498" in out
    assert "predicted memory per rank (4 rank(s), cuda)" in out
    assert "teacher weights" in out and "loss chunk" in out and "activations (--gradient_checkpointing)" in out
    assert "mixed weights (one layer at a time)" in out and "teacher weights (packed Q8_0, --lazy)" in out
    assert "split over 4 ranks" in out
    # the warm start's Fisher pass streams on rank 0: 65 layer inputs x 4 x 8192 tokens x 5120 float32
    assert "sensitivity pass (rank 0, its own phase)" in out and "43.62 GB of stored layer inputs" in out
    verdict = [ln for ln in out.splitlines() if "GB of 32 GB per device" in ln]
    assert len(verdict) == 1
    assert "DOES NOT FIT" not in verdict[0], out[-1500:]  # the recipe fits as written (default 1024-token loss chunks)
    # the guarantee after training: its own phase, under the training peak. A served --lazy rung is
    # dequantized per use (one weight, the 317.8e6-weight LM head shard in bf16), not the whole
    # 13.45 GB model per rank; no search by default, so no probe
    (post,) = [ln for ln in out.splitlines() if "post-bake measurements" in ln]
    assert " 0.00 GB" in post and "a served weight in use 0.64" in post and "probe" not in post, post
    # with the search asked for, its probe back-propagates one sequence in the same phase
    p = _cli("tp", "--nproc", "4", "--", *RECIPE, "--output_dir", "/nonexistent/out", "--dry_run", "--search_evals", "48",
             env_extra={"VOODOO_DEVICE_MEMORY_GB": "32"})
    assert p.returncode == 0, p.stderr[-2000:]
    (post,) = [ln for ln in p.stdout.splitlines() if "post-bake measurements" in ln]
    assert " 0.00 GB" in post and "a served weight in use 0.64" in post and "probe (one sequence)" in post, post
    assert "torch.distributed.run" not in out  # nothing launched
    # error compensation (auto: gptq under TP too): rank 0 collects the Hessians layer by layer, in
    # a device phase under the training peak, and builds the compensated candidates; the Hessians
    # file and the candidate cache are planned on disk
    (coll,) = [ln for ln in out.splitlines() if ln.lstrip().startswith("device  layer-by-layer Hessian collection, rank 0")]
    assert " 0.00 GB" in coll and "own phase, peak" in coll
    assert "host    Hessians (--error_compensation), rank 0" in out
    assert "host    layer-by-layer Hessian collection, rank 0" in out
    assert "disk    candidate cache (VOODOO_CACHE_DIR)" in out and "disk    Hessians file (--output_dir)" in out
    assert "disk    TOTAL" in out


def test_the_hessians_of_error_compensation_are_planned_on_the_host(gate_model_dir, tmp_path, monkeypatch):
    import torch

    from voodoo_quant.candidates.compensate import FACTOR_CACHE_BYTES
    from voodoo_quant.model.modeling import load_model

    monkeypatch.setenv("VOODOO_QUANT_WORKERS", "3")

    base = ["--model", str(gate_model_dir / "model"), "--data_dir", str(tmp_path), "--candidate_types", "Q8_0", "Q4_0",
            "--compression_ratio", "0.6", "--seq_len", "64"]
    plain, comp = _mem(base + ["--error_compensation", "none"]), _mem(base)  # auto: gptq, the model read whole
    assert _mem(base + ["--error_compensation", "gptq"]).host_total == comp.host_total
    assert not any(t.name.startswith("Hessians") for t in plain.host)
    held = next(t.bytes for t in comp.host if t.name.startswith("Hessians"))
    lin = [m for m in load_model(str(gate_model_dir / "model")).modules() if isinstance(m, torch.nn.Linear)]
    n = [m.in_features for m in lin]  # every Linear, the LM head (a tied embedding's H) too
    # the larger phase, beside the loaded model: the collection, one decoder layer at a time in
    # place (32 calibration sequences + one batch of 4 stored, 64 x 256 float32; one layer's
    # accumulators, 6 x 256² + 512² float32; a batch's activations, 4 x 64 tokens x (4 x 256 +
    # 3 x 512) float32), or each of the 3 quantization processes keeping every factor (n² float64
    # each, under FACTOR_CACHE_BYTES on this tiny model) and working on one tensor (float64 H,
    # factor, inverse)
    layer = (6 * 256 ** 2 + 512 ** 2) * 4 + 4 * 64 * (4 * 256 + 3 * 512) * 4
    collect = (32 + 4) * 64 * 256 * 4 + layer
    build = 3 * (sum(k * k * 8 for k in n) + 3 * max(n) ** 2 * 8)
    assert sum(k * k * 8 for k in n) < FACTOR_CACHE_BYTES and build > collect
    assert held == build
    assert comp.host_total == pytest.approx(plain.host_total + held)
    # one quantization process: one set of kept factors
    monkeypatch.setenv("VOODOO_QUANT_WORKERS", "1")
    one = next(t.bytes for t in _mem(base).host if t.name.startswith("Hessians"))
    assert one == max(collect, sum(k * k * 8 for k in n) + 3 * max(n) ** 2 * 8)
    # more calibration sequences: their stored hidden states make the collection the larger phase;
    # one layer's accumulators, not every Hessian (4.1 MB here)
    big = _mem(base + ["--compensation_sequences", "4096"])
    (term,) = [t for t in big.host if t.name.startswith("Hessians")]
    assert term.bytes == (4096 + 4) * 64 * 256 * 4 + layer > sum(k * k * 4 for k in n)
    assert "layer by layer" in term.note and "the loaded model's layers in place" in term.note
    assert not any(t.name.startswith("layer-by-layer") for t in big.host)  # no phase of its own: the model is loaded
    # the whole-model collection's pass size no longer enters the plan of a loaded model
    monkeypatch.setenv("VOODOO_HESSIAN_PASS_GB", "0.001")
    assert _mem(base + ["--compensation_sequences", "4096"]).host_total == big.host_total


def test_the_layer_by_layer_hessians_of_a_lazy_run_are_planned_as_their_own_phase(gate_model_dir, tmp_path,
                                                                                     monkeypatch):
    """--lazy collects the Hessians one decoder layer at a time before anything is loaded
    (training/layer_hessians.py): the stored hidden states of the calibration sequences, one
    float32 layer and its n² accumulators, a batch's activations. The quantization processes'
    factors come later, beside the loading terms."""
    from voodoo_quant.memory.terms import PROCESS_BASELINE

    monkeypatch.setenv("VOODOO_QUANT_WORKERS", "1")
    base = ["--model", str(gate_model_dir / "model"), "--data_dir", str(tmp_path), "--candidate_types", "Q8_0", "Q4_0",
            "--compression_ratio", "0.6", "--seq_len", "64", "--lazy"]
    plain, comp = _mem(base + ["--error_compensation", "none"]), _mem(base)  # auto: gptq under --lazy too
    assert not any("Hessian" in t.name for t in plain.host)
    names = [t.name for t in comp.host]
    assert "Hessians (--error_compensation)" in names and any(n.startswith("layer-by-layer Hessian collection")
                                                                for n in names)
    # the factors of one quantization process: every one kept (under FACTOR_CACHE_BYTES here) + one tensor's float64 work
    n = 2 * ([256] * 6 + [512]) + [256]  # 2 layers: q k v o gate up (256 wide), down (512); the LM head
    factors = next(t.bytes for t in comp.host if t.name == "Hessians (--error_compensation)")
    assert factors == sum(k * k * 8 for k in n) + 3 * 512 ** 2 * 8
    # the phase, from shapes: 32 calibration sequences + one batch of 4 stored (64 x 256 float32);
    # the largest float32 layer (590,336 weights); its accumulators (6 x 256² + 512², float32); a
    # batch's activations (4 x 64 tokens x (4 x 256 + 3 x 512) float32)
    stored = (32 + 4) * 64 * 256 * 4
    phase = stored + 590_336 * 4 + (6 * 256 ** 2 + 512 ** 2) * 4 + 4 * 64 * (4 * 256 + 3 * 512) * 4
    (term,) = [t for t in comp.host if t.name.startswith("layer-by-layer Hessian collection")]
    assert f"peak {(PROCESS_BASELINE + phase) / 1e9:.2f} GB" in term.note
    assert comp.host_total == pytest.approx(max(plain.host_total + factors, PROCESS_BASELINE + phase))
    # more calibration sequences: the stored hidden states outgrow the loading peak, which is then the phase's
    big = _mem(base + ["--compensation_sequences", "4096"])
    (term,) = [t for t in big.host if t.name.startswith("layer-by-layer Hessian collection")]
    assert term.name.endswith(": above loading") and term.bytes > 0
    assert big.host_total == pytest.approx(PROCESS_BASELINE + phase + (4096 - 32) * 64 * 256 * 4)
    assert big.cpu_peak >= big.host_total
    # on an accelerator the layer, accumulators and activations are on the device, the hidden states on the host
    gpu = _mem(base + ["--compensation_sequences", "4096", "--device", "cuda:0"])
    (term,) = [t for t in gpu.host if t.name.startswith("layer-by-layer Hessian collection")]
    assert f"peak {(PROCESS_BASELINE + stored + (4096 - 32) * 64 * 256 * 4) / 1e9:.2f} GB" in term.note
    assert any(t.name.startswith("layer-by-layer Hessian collection") for t in gpu.device)


def test_disk_plan_counts_the_candidate_cache_and_the_hessians_file(gate_model_dir, tmp_path):
    """The candidate cache holds every menu candidate of every tensor; with compensation the
    Hessians file holds at most one n² float32 matrix per compensated tensor (shared inputs once)."""
    import torch

    from voodoo_quant.model.modeling import load_model

    base = ["--model", str(gate_model_dir / "model"), "--data_dir", str(tmp_path), "--candidate_types", "Q8_0", "Q4_0",
            "--compression_ratio", "0.6", "--seq_len", "64"]
    run = dry_run(parse_train_flags(base))
    cache = sum(sum(p.sizes) for p in run.plans)
    disk = {t.name: t.bytes for t in run.memory.disk}
    n = [m.in_features for m in load_model(str(gate_model_dir / "model")).modules() if isinstance(m, torch.nn.Linear)]
    assert disk == {"candidate cache (VOODOO_CACHE_DIR)": cache, "Hessians file (--output_dir)": sum(k * k * 4 for k in n)}
    plain = dry_run(parse_train_flags(base + ["--error_compensation", "none"])).memory
    assert {t.name: t.bytes for t in plain.disk} == {"candidate cache (VOODOO_CACHE_DIR)": cache}
    assert any(ln.startswith("  disk    TOTAL") for ln in run.memory.lines())
    # under tensor parallelism rank 0 collects and builds: its terms say so
    tp2 = dry_run(parse_train_flags(base + ["--tensor_parallel", "2"]), world=2).memory
    assert any(t.name == "Hessians (--error_compensation), rank 0" for t in tp2.host)
    assert any(t.name.startswith("layer-by-layer Hessian collection, rank 0") for t in tp2.host)


def test_a_run_that_trains_nothing_plans_no_student(gate_model_dir, tmp_path):
    """``--method sensitivity`` builds no student, teacher or gates (training/methods.py): its plan
    holds the loaded model, the Fisher pass on it one decoder layer and one sequence at a time, and
    nothing that training holds (the CPU dry run of the 1.5B benchmark model's knapsack counted
    31.4 GB of training terms)."""
    base = ["--model", str(gate_model_dir / "model"), "--data_dir", str(tmp_path), "--candidate_types", "Q8_0", "Q4_0",
            "--compression_ratio", "0.6", "--seq_len", "64"]
    gates, one_shot = _mem(base), _mem(base + ["--method", "sensitivity"])
    from voodoo_quant.memory.plan import loss_chunk_bytes
    from voodoo_quant.model.modeling import load_model

    names = [t.name for t in one_shot.device]
    assert not any(n.startswith(("mixed weights", "candidates", "gates", "teacher", "activations", "loss"))
                   for n in names), names
    assert one_shot.device_total == 0
    host = {t.name: t.bytes for t in one_shot.host}
    assert host["sensitivity pass: layer by layer (Fisher)"] > 0
    # one layer's activations beside the head's logits, not every layer's: half the gates run's
    # (two layers, each with its input) at one float32 sequence
    cfg = parse_train_flags(base)
    f32 = 4 / (cfg.batch_size * {"float32": 4, "bfloat16": 2, "float16": 2}[cfg.dtype])
    every = _term(gates, "activations (all layers saved)") * f32
    logits = loss_chunk_bytes(63, load_model(str(gate_model_dir / "model")).config.vocab_size, 4)
    act = host["sensitivity pass: one sequence's activations and loss"] - logits
    assert 0 < act < every, (act, every)
    assert gates.device_total > 0
    assert not any(n.startswith("guarantee") for n in host)  # nothing is measured after a bake
    # a skeleton streams the pass one decoder layer at a time, on the device
    (layer,) = _mem(base + ["--method", "sensitivity", "--lazy"]).device
    assert layer.name == "sensitivity pass: one decoder layer (float32)" and layer.bytes > 0
