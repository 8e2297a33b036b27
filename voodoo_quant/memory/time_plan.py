"""The stages of a run and their predicted wall seconds (:func:`plan_time`), from the work counts
and constants of :mod:`.timing` and the rates of :mod:`.rates`; :func:`time_plan_for` probes this
machine and plans what ``voodoo train --dry_run`` prints."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Mapping, Sequence

import torch.nn as nn

from ..candidates.compensate import applies
from ..candidates.hessian_store import FILE as HESSIANS_FILE
from ..core import envs, fileio
from ..core import qtypes as qt
from ..core.units import GB
from ..selection.budget import Budget
from ..training.guarantee import plan_references, stock_provider
from ..training.hessians import compensable
from ..training.sensitivity import TABLE_NAME
from . import timing as tm
from .rates import Rates, probe


@dataclass(frozen=True)
class Sequences:
    """How many sequences each pass reads: the tokens file's count (None: not found, the settings
    are taken as they are) split as ``Trainer.prepare`` splits it (setup.hold_aside)."""

    compensation: int
    sensitivity: int
    held: int
    note: str


def sequences(cfg, n_file: int | None) -> Sequences:
    gates = cfg.method == "gates"
    if n_file is None:
        held = cfg.search_sequences if gates else 0
        return Sequences(cfg.compensation_sequences, cfg.sensitivity_sequences, held,
                         f"{cfg.data_path} not found: the sequence counts as set")
    held = 0
    train = n_file
    if gates and cfg.search_sequences > 0 and n_file >= 2:
        total = min(cfg.search_sequences + max(cfg.search_confirm, 0), max(1, n_file // 4))
        held = min(cfg.search_sequences, total)
        train = n_file - total
    return Sequences(min(cfg.compensation_sequences, train), min(cfg.sensitivity_sequences, train), held,
                     f"{cfg.data_path}: {n_file} sequences of at least {cfg.seq_len} tokens")


def _bits_mix_seconds(p, target_bpw: float, rate_of, imatrix: bool = True) -> float:
    """One thread's seconds to quantize plan `p` at the rungs that bracket `target_bpw`, mixed
    (by weights) to meet it."""
    n = tm._numel(p)
    bpw = [8.0 * s / n for s in p.sizes]
    order = sorted(range(len(bpw)), key=lambda k: bpw[k])
    lo = max((k for k in order if bpw[k] <= target_bpw), key=lambda k: bpw[k], default=order[0])
    hi = min((k for k in order if bpw[k] >= target_bpw), key=lambda k: bpw[k], default=order[-1])
    if bpw[hi] == bpw[lo]:
        return n / rate_of(p.menu.types[lo], imatrix)
    f = (bpw[hi] - target_bpw) / (bpw[hi] - bpw[lo])  # the share at the lower rung
    return n * (f / rate_of(p.menu.types[lo], imatrix) + (1 - f) / rate_of(p.menu.types[hi], imatrix))


def plan_time(cfg, model: nn.Module, plans: Sequence, budget: Budget, rates: Rates, *,
              covered: Collection[str] = (), n_file: int | None = None,
              cached: Collection[tuple[str, str]] = (), stored: Collection[str] = (),
              checkpoint_bytes: float | None = None) -> tm.TimePlan:
    """The stages of `cfg`'s run (a TrainConfig, one process) for `model` (a skeleton or loaded
    model) with its `plans` and `budget`, at `rates`. `covered`: the GGUF names the imatrix covers;
    `n_file`: sequences in the tokens file (None: unknown); `cached`: (tensor, type) of the
    candidates in the cache; `stored`: what ``--output_dir`` holds from the same inputs and the run
    reuses ("hessians", "table": a ladder's later sizes); `checkpoint_bytes`: the safetensors'
    bytes (default: float32)."""
    modules = dict(model.named_modules())
    T = cfg.seq_len
    shp = tm.model_shapes(model, plans, T)
    seqs = sequences(cfg, n_file)
    comp = cfg.compensation != "none" and bool(shp.inputs)
    gates = cfg.method == "gates" and not cfg.finalize_from_partial
    workers = rates.workers
    sel = sum(tm._numel(p) for p in plans)
    sel_bytes = 4.0 * sel
    weigh = sel_bytes / rates.sha256 + sel_bytes / rates.copy  # one pass over every weight: GGUF-layout copy, sha256
    plan = tm.TimePlan(rates=rates)
    add = plan.stages.append

    read = checkpoint_bytes if checkpoint_bytes is not None else shp.param_bytes
    add(tm.Stage("load and hash the weights", read / tm.LOAD_BYTES_PER_S + weigh,
                 f"{read / GB:.2f} GB read, {sel_bytes / GB:.2f} GB hashed"))
    if comp:
        tok = seqs.compensation * T
        flops = tok * shp.layer_flops + tm.hessian_flops(tok, shp.inputs)
        file_bytes = 4.0 * sum(n * n for n in shp.inputs)
        checked = 4.0 * sum(p.n_per_row ** 2 for p in plans if compensable(p, modules))
        s = (flops / rates.gemm * tm.K_HESSIANS + file_bytes / tm.DISK_BYTES_PER_S
             + checked / rates.sha256 + checked / rates.copy)
        note = (f"{seqs.compensation} x {T} tokens through the layers, xᵀx of {len(shp.inputs)} inputs, "
                f"{file_bytes / GB:.1f} GB file")
        if "hessians" in stored:  # read back: each checked and hashed
            s, note = checked / rates.sha256 + checked / rates.copy, "reused from --output_dir"
        elif (cfg.out_dir / HESSIANS_FILE).is_file():
            note += "; a Hessians file is in --output_dir: reused if made from the same inputs (then ~0)"
        add(tm.Stage("Hessians (error compensation)", s, note))

    refs = references(cfg, model, plans, budget, covered)
    jobs = tm.candidate_jobs(plans, modules, compensated=comp, extra=refs.extra if refs else None, covered=covered)
    cached = set(cached)  # plain entries: a compensated job's bytes are another entry
    found = {(j.name, j.qtype) for j in jobs if (j.name, j.qtype) in cached and not (j.compensated and applies(j.qtype))}
    todo = [j for j in jobs if (j.name, j.qtype) not in found]
    factors = tm.factor_widths(plans, modules, shp.inputs, workers) if comp and todo else []
    cand, note = tm.candidate_seconds(todo, rates, factors, workers)
    built_bytes = sum(_job_bytes(j) for j in todo)
    cand += weigh + built_bytes * (1 / rates.sha256 + 1 / tm.DISK_BYTES_PER_S) / min(float(workers), rates.parallel)
    if found:
        note += f"; {len(found)} of {len(jobs)} found in the cache, not built"
    add(tm.Stage("candidates", cand, note))

    cand_bytes = float(sum(sum(p.sizes) for p in plans))
    rungs = [(p, t) for p in plans for t in p.menu.types]
    dequant = sum(tm._numel(p) / rates.dequant_rate(t) for p, t in rungs)
    if cfg.needs_sensitivity and "table" in stored:  # its key hashes the weights; a run that builds no student reads every candidate
        again = 0.0 if gates else weigh + cand_bytes / rates.sha256
        add(tm.Stage("sensitivity pass", weigh + again, "the table reused from --output_dir"))
    elif cfg.needs_sensitivity and cfg.sensitivity_kind == "fisher":
        tok = seqs.sensitivity * T
        fisher = tok * (4 * shp.layer_flops + 3 * shp.head_flops) / rates.gemm * tm.K_FISHER
        products = sum(tm._numel(p) * len(p.menu.types) for p in plans) * rates.curvature
        curv = dequant + products + cand_bytes / rates.sha256 + sum(4.0 * tm._numel(p) for p, _ in rungs) / rates.copy
        note = (f"Fisher: {seqs.sensitivity} x {T} tokens {fisher:.0f} s; curvature of {len(rungs)} rungs "
                f"{curv:.0f} s")
        if (cfg.out_dir / TABLE_NAME).is_file():
            note += "; a table is in --output_dir: reused if made from the same inputs (then ~0)"
        add(tm.Stage("sensitivity pass", weigh + fisher + curv, note))
    elif cfg.needs_sensitivity:
        plan.assumptions.append(f"--sensitivity_kind {cfg.sensitivity_kind}: its pass is not modeled (not counted)")

    if gates:
        add(tm.Stage("student build", weigh + cand_bytes / rates.sha256 + 2 * dequant,
                     f"{len(rungs)} rungs read, dequantized and checked as int8 codes"))
        tok = cfg.max_steps * cfg.grad_accum_steps * cfg.batch_size * T
        steps = tok * 4 * shp.flops / rates.gemm * tm.K_PLAIN_STEP * tm.STEP_OVER_PLAIN
        add(tm.Stage("training steps", steps,
                     f"{cfg.max_steps} x {cfg.grad_accum_steps * cfg.batch_size} x {T} tokens, "
                     f"{steps / max(1, cfg.max_steps):.1f} s a step"))
        if cfg.measures and seqs.held:
            n_cands = (2 if cfg.polish else 1) + len(refs.candidates if refs else ()) + 2
            fwd = tm.forward_seconds(seqs.held * T, shp.flops, rates)
            add(tm.Stage("guarantee", (1 + n_cands) * fwd + n_cands * sel_bytes / rates.copy,
                         f"the teacher and {n_cands} assignments over {seqs.held} x {T} held-aside tokens"))
        if cfg.searches:
            plan.assumptions.append(f"--search_evals {cfg.search_evals}: the search is not modeled (not counted)")

    target_bpw = 8.0 * budget.target_bytes / max(1, sel)
    par = min(float(workers), rates.parallel)
    if comp:  # each tensor's cache key: its weights and its Hessian hashed; the candidate read and hashed
        checked = 4.0 * sum(p.n_per_row ** 2 for p in plans if compensable(p, modules))
        quant = weigh + checked * (1 / rates.sha256 + 1 / rates.copy) + budget.target_bytes / rates.sha256
        how = "compensated candidates read from the cache"
    else:
        quant = sum(_bits_mix_seconds(p, target_bpw, rates.quant_rate, p.gguf_name in set(covered)) for p in plans) / par
        how = f"each tensor quantized once at ~{target_bpw:.2f} bits/weight"
    convert = shp.param_bytes / tm.CONVERT_BYTES_PER_S
    out_bytes = budget.target_bytes + max(0.0, shp.param_bytes - sel_bytes)
    export = convert + weigh + quant + out_bytes / tm.DISK_BYTES_PER_S
    plan.after.append(tm.Stage("export (voodoo export)", export,
                               f"{how}; the converter's F32 GGUF {convert:.0f} s of it (none with --converted)"))

    plan.assumptions += _assumptions(cfg, rates, seqs, comp, plans, len(found), len(jobs))
    return plan


def references(cfg, model: nn.Module, plans: Sequence, budget: Budget, covered: Collection[str]):
    """The guarantee's references (training/references.py, without its knapsacks: they are made
    of menu types) where the run measures them, else None."""
    if not (cfg.method == "gates" and not cfg.finalize_from_partial and cfg.measures):
        return None
    stock = stock_provider(plans, getattr(model, "config", None), has_imatrix=bool(covered))
    return plan_references(plans, budget.upper_bytes, covered=set(covered), stock=stock,
                           stock_ftypes=cfg.stock_references, menu_types=sorted({t for p in plans for t in p.menu.types}))


def _job_bytes(job: tm.Job) -> int:
    return qt.tensor_bytes(job.qtype, (job.rows, job.n))


def _assumptions(cfg, rates: Rates, seqs: Sequences, comp: bool, plans: Sequence, found: int, jobs: int) -> list[str]:
    menu = sorted({t for p in plans for t in p.menu.types})
    out = [f"torch on {rates.threads} thread(s) (float32 GEMM {rates.gemm / 1e9:.0f} GFLOP/s); "
           f"{rates.workers} quantization worker(s) (VOODOO_QUANT_WORKERS) measured at {rates.parallel:.2f}× one thread",
           seqs.note,
           f"menus {' '.join(menu)}" + (f" ({', '.join(rates.derived)} priced from IQ2_XXS's probe: rates.DERIVED)"
                                         if rates.derived else ""),
           (f"error compensation {cfg.compensation}, --compensation_sweep {cfg.compensation_sweep}" if comp
            else "no error compensation"),
           f"{found} of {jobs} candidates found in the cache (plain ones matched by tensor, shape, type, imatrix "
           "and libggml; contents not hashed, compensated ones not matched)",
           f"the probe took {rates.seconds:.1f} s; a shared machine's speed drifts (~1.5× within an hour, "
           "docs/lab/README.md)"]
    return out


def time_plan_for(cfg, model: nn.Module, plans: Sequence, budget: Budget, covered: Collection[str],
                  imx=None) -> tuple[tm.TimePlan | None, str | None]:
    """Probe this machine and plan `cfg`'s run (`imx`: its imatrix, loaded, or None); (None, why)
    where the model does not cover it."""
    if not str(cfg.device).startswith("cpu") or cfg.tensor_parallel > 1 or cfg.device_map:
        return None, "the time model covers one process on the CPU (--device cpu, no tensor parallelism)"
    text = model.config.get_text_config()
    refs = references(cfg, model, plans, budget, covered)
    extra = refs.extra if refs else {}
    menus = {t for p in plans for t in p.menu.types}
    types = menus | {t for ts in extra.values() for t in ts}
    rates = probe(types, hidden=text.hidden_size, intermediate=getattr(text, "intermediate_size", 4 * text.hidden_size),
                  compensation=cfg.compensation, sweep=cfg.compensation_sweep, damp=cfg.compensation_damp,
                  workers=envs.quant_workers(), rungs=max(len(p.menu.types) for p in plans),
                  plain=types - menus)  # the references' off-menu types are built plain: no walk to price
    n_file = None
    if cfg.data_path.is_file():
        try:
            obj = fileio.torch_load(cfg.data_path, what="tokens file")
            obj = obj.get("input_ids", obj.get("tokens")) if isinstance(obj, dict) else obj
            n_file = int(obj.shape[0]) if getattr(obj, "dim", lambda: 0)() == 2 and obj.shape[1] >= cfg.seq_len else 0
        except Exception:  # an unreadable tokens file: the run refuses it; the plan takes the settings
            n_file = None
    vectors = {p.gguf_name: v for p in plans if imx is not None and p.gguf_name
               and (v := imx.get_vector(p.gguf_name, p.n_per_row)) is not None}
    cached = tm.cached_candidates(plans, vectors, extra=extra)
    ckpt = _checkpoint_bytes(Path(cfg.model))
    return plan_time(cfg, model, plans, budget, rates, covered=covered, n_file=n_file, cached=cached,
                     checkpoint_bytes=ckpt), None


def _checkpoint_bytes(model_dir: Path) -> float | None:
    files = list(model_dir.glob("*.safetensors")) if model_dir.is_dir() else []
    return float(sum(f.stat().st_size for f in files)) if files else None


# -- the ladder's other steps (voodoo quantize; bench/time_model.py compares them) ---------------
def imatrix_seconds(shp: tm.Shapes, rates: Rates, tokens: int, checkpoint_bytes: float) -> float:
    """``tools/calibrate.compute``: the float32 model loaded and one forward over `tokens`
    (logits included; its hooks' x² sums are negligible beside the products)."""
    return checkpoint_bytes / tm.LOAD_BYTES_PER_S + tm.forward_seconds(tokens, shp.flops, rates)


def convert_seconds(shp: tm.Shapes) -> float:
    """llama.cpp's converter writing the F32 reference GGUF."""
    return shp.param_bytes / tm.CONVERT_BYTES_PER_S


def stock_seconds(plans: Sequence, types: Mapping[str, str], rates: Rates, threads: int, param_bytes: float,
                  covered: Collection[str] = ()) -> float:
    """Stock ``llama-quantize`` of the F32 reference into `types` (tensor -> type) on `threads`
    threads: each tensor at the probe's one-thread rate for its type (with the imatrix vector where
    `covered` holds its GGUF name), the threads at the probe's
    parallel throughput, each grid type's setup once, the F32 file read and the output written."""
    par = min(float(threads), rates.parallel)
    covered = set(covered)
    work = sum(tm._numel(p) / rates.quant_rate(types[p.name], p.gguf_name in covered)
               for p in plans if p.name in types) / par
    setup = sum(tm.GRID_SETUP_S.get(qt.get(t).name, 0.0) for t in set(types.values()))
    out = sum(qt.tensor_bytes(types[p.name], (tm._numel(p) // p.n_per_row, p.n_per_row)) for p in plans if p.name in types)
    return work + setup + param_bytes / rates.copy + out / tm.DISK_BYTES_PER_S
