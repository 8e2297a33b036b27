"""The time model of a run (``voodoo train --dry_run``): wall seconds per stage, on this machine.

Work counts come from shapes and the run's settings, on the skeleton the memory plan is made from
(nothing is loaded or quantized); rates come from :mod:`.rates`, measured on this machine by a
probe of a few seconds; each stage's seconds are its work at its rate. Where the work is not what
the probe measures (a whole forward pass against one GEMM, a checkpoint read against a memory
copy), a constant below relates the two, with where it was measured; none was fitted to a run it
is checked against (``bench/time_model.py`` compares a prediction with a run's recorded stage
times, as ratios).

The stages, as ``Trainer.prepare`` and the method run them (one process, the CPU):

* **load**: the checkpoint read (safetensors bytes at :data:`LOAD_BYTES_PER_S`) and the hash of
  the weights the assignment records (sha256).
* **Hessians** (``--error_compensation gptq``): one forward over ``--compensation_sequences`` ×
  ``--seq_len`` tokens through the decoder layers (training/layer_hessians.py, no logits) and
  the upper block triangle of xᵀx per distinct layer input (:func:`hessian_flops`:
  2·tokens·n²·(B+1)/(2B) flops each, B column blocks by training/hessians.py's rule, at the GEMM
  rate), the file written at :data:`DISK_BYTES_PER_S`, then each tensor's Hessian checked and
  hashed once (its cache key).
* **candidates**: every (tensor, menu type) quantized by libggml-base on one thread per job
  (the probe's rate per type, with the imatrix vector where the imatrix covers the tensor, else
  the rate without one; the walk is priced with one), the jobs spread over ``VOODOO_QUANT_WORKERS`` processes at the
  probe's measured parallel throughput; each compensated job adds the walk (the probe's seconds
  per weight and per 32-column step, and its ``rows · n²`` product at the one-thread GEMM rate)
  and each distinct layer input its Cholesky factor (:func:`factor_seconds`) once per worker
  that builds one of its tensors (``min(workers, types)``: a worker keeps a factor for a tensor's
  next type, compensate.FACTOR_CACHE_BYTES); the grid setup of every IQ type each worker runs
  (:data:`GRID_SETUP_S`); a compensated job whose bytes the walk writes (``Rates.written``)
  pays no quantization beyond the walk's own; the parent's pass over every weight (copy to GGUF layout, sha256) before
  the pool starts. Candidates found in the cache (:func:`cached_candidates`) are not built. A
  ``--method gates`` run with the guarantee adds its references' off-menu types, each a plain
  candidate whatever the run's compensation (training/guarantee.py).
* **sensitivity pass** (Fisher, training/layerwise.py): per token of ``--sensitivity_sequences`` ×
  ``--seq_len``, the decoder layers run four times (forward, its recompute with grad, the input
  gradient, the Fisher products δ²ᵀx²) and the LM head three times; then the curvature of every
  tensor's rungs: each rung dequantized by libggml-base and the K × K products (the probe's
  seconds per weight per rung, at the menu's K), the candidate bytes read and hashed.
* ``--method gates``: the **student build** (every rung dequantized twice: libggml-base's
  ``to_float`` and the int8 codes checked against it), the **training steps** (a plain
  forward+backward of the student, 3 forwards, and the teacher's forward, :data:`K_PLAIN_STEP`,
  times :data:`STEP_OVER_PLAIN`), the **guarantee** (the teacher once and the student once per measured
  assignment over the held-aside sequences, each serving its weights).
* after the run, **export** (``voodoo export``): the converter's F32 GGUF (unless a conversion is
  passed with ``--converted``, as ``voodoo quantize`` does), the weights hash, each selected tensor
  quantized once at its type (plain; a compensated one is read from the cache), the file
  written. The types are not known before the run: each tensor is priced at the two menu rungs
  that bracket the target's bits per weight, mixed to meet it.

A forward pass is its flops (2 per weight of every Linear per token, and 4·T·width per layer for
attention) at the probe's float32 GEMM rate on torch's threads, times :data:`K_FORWARD`; the
sensitivity pass and the Hessian collection have their own factor (:data:`K_FISHER`,
:data:`K_HESSIANS`) measured on their own code. Why a probe and not a table: the recorded 1.5B
runs (docs/results/qwen2.5-coder-1.5b.cost.jsonl) ran their imatrix, 1.0e14 flops, in 487–986 s,
100–210 GFLOP/s, where this 2-core machine's probe measured 6–60 GFLOP/s (the latter idle): the
machine behind "the 2-core machine" changes between sessions, and its load within one. The
prediction is for the load at the probe; a run that shares the cores later gets less. Not modeled: ``--device cuda`` (the probe measures
the CPU), tensor parallelism's ranks, ``--sensitivity_kind`` measured/output, the experimental
search. A dry run cannot know whether the Hessians file or sensitivity table in ``--output_dir``
was made from the same inputs (their keys hash the weights and tokens): they are predicted as
computed, and said to be present.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch
import torch.nn as nn

from ..candidates.cache import default_root, lib_version
from ..candidates.compensate import applies
from ..candidates.compensation_walk import STEP
from ..core import qtypes as qt
from ..distributed.parallel import decoder_layers
from ..gguf.imatrix import vector_hash
from ..training.hessians import compensable, gram_flops, reader, shared_inputs
from .rates import Rates

# -- constants, each with where it was measured --------------------------------------------------
# Measured by ``bench/time_model.py constants`` on the 2-core machine, 2026-12-07, with other jobs
# on both cores (bench/results/time_model_constants.json: every value, the medians used here), on
# Qwen2.5-Coder-1.5B's widths and vocabulary (its config with 8 decoder layers, random weights;
# the checkpoint itself for the read and the conversion). The forward factors are a pass's CPU
# seconds per flop ÷ the probe GEMM's, measured before and after it: CPU time, so that the other
# jobs (which moved the wall-clock GEMM rate 4× within one repeat) stretch neither side.
K_FORWARD = 0.90  # a no-grad forward, [1, 512] and [4, 512] (4 values 0.88–1.01)
K_FISHER = 1.05  # training/layerwise.fisher_curvature, 4 layer + 3 head passes (0.99, 1.11)
K_HESSIANS = 0.84  # training/layer_hessians.collect_layerwise, its forward + xᵀx (0.82, 0.86)
# (measured when xᵀx was the full product and priced as 2·tokens·n²; now priced as its upper block triangle
# at the same factor, not measured again)
K_PLAIN_STEP = 1.00  # student forward+backward with weight gradients + teacher forward, 4 forwards (0.99, 1.01)
# a gate training step ÷ that plain step: 1.04–1.07 on SmolLM2-135M, int8 codes and the mixing
# kernel (docs/lab/2026-12-01-ladder-and-training-step.md, bench/step_ratio.py); not measured at 1.5B
STEP_OVER_PLAIN = 1.07
LOAD_BYTES_PER_S = 3.98e9  # model.modeling.load_model of the 7.1 GB checkpoint, page-cached (1.79 s)
DISK_BYTES_PER_S = 2.38e8  # 2 GB through core.fileio (fsync'ed): 9.0 s
CONVERT_BYTES_PER_S = 1.53e8  # gguf.converter.convert of the 1.5B checkpoint to F32: 7.11 GB in 46.5 s
CHOL_LARGE = 1.80  # the one-thread Cholesky rate at n = 8,960 ÷ at the probe's n = 1,024 (2 pairs: 1.32, 2.29)
# a grid type's setup (ggml_quantize_init), once per process that quantizes it: its first
# quantization of 8 rows in a fresh process
GRID_SETUP_S: dict[str, float] = {"IQ1_S": 23.2, "IQ1_M": 23.6, "IQ2_S": 10.5, "IQ2_XS": 5.5, "IQ2_XXS": 2.5,
                                  "IQ3_XXS": 0.38, "IQ3_S": 0.58}


@dataclass
class Stage:
    name: str
    seconds: float
    note: str = ""


@dataclass
class TimePlan:
    """Predicted wall seconds of a run's stages (`stages`) and of the command after it (`after`)."""

    stages: list[Stage] = field(default_factory=list)
    after: list[Stage] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)
    rates: Rates | None = None

    @property
    def total(self) -> float:
        return sum(s.seconds for s in self.stages)

    def seconds(self, name: str) -> float:
        return sum(s.seconds for s in [*self.stages, *self.after] if s.name == name)

    def lines(self) -> list[str]:
        out = ["predicted wall time on this machine; a prediction from a probe of its rates now, not a measurement"]
        for s in self.stages:
            out.append(f"  {s.name:<34} {_hms(s.seconds):>9}  {s.note}")
        out.append(f"  {'TOTAL (voodoo train)':<34} {_hms(self.total):>9}")
        for s in self.after:
            out.append(f"  then {s.name:<29} {_hms(s.seconds):>9}  {s.note}")
        out += [f"  assumes: {a}" for a in self.assumptions]
        return out


def _hms(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


# -- work counts -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shapes:
    """What a model's passes cost, from its shapes: float32 flops per token through the decoder
    layers (their Linears, and attention over `seq_len` keys) and through the LM head, the float32
    bytes of every parameter, and the width of every distinct input compensation collects a
    Hessian of (q/k/v read one input: once)."""

    layer_flops: float
    head_flops: float
    param_bytes: float
    inputs: tuple[int, ...] = ()

    @property
    def flops(self) -> float:
        return self.layer_flops + self.head_flops


def model_shapes(model: nn.Module, plans: Sequence, seq_len: int) -> Shapes:
    prefix, layers = decoder_layers(model)
    layer_flops = head_flops = 0.0
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            f = 2.0 * mod.in_features * mod.out_features
            if name.startswith(prefix + "."):
                layer_flops += f
            else:
                head_flops += f
    text = model.config.get_text_config()
    heads = getattr(text, "num_attention_heads", 0) or 0
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else 0)
    layer_flops += 4.0 * seq_len * heads * head_dim * len(layers)  # q·k and p·v over every key
    seen: set[int] = set()
    params = 0
    for _, t in model.named_parameters(remove_duplicate=False):
        if id(t) not in seen:
            seen.add(id(t))
            params += t.numel()
    return Shapes(layer_flops, head_flops, 4.0 * params, tuple(hessian_inputs(model, plans)))


def hessian_inputs(model: nn.Module, plans: Sequence) -> list[int]:
    """The width of every input compensation stores a Hessian of: one per distinct input tensor
    (training/hessians.py ``shared_inputs``, on a short probe forward; the skeleton runs it on
    ``meta``), else one per compensable tensor (an upper bound)."""
    modules = dict(model.named_modules())
    chosen = [p for p in plans if compensable(p, modules)]
    width = {p.name: modules[reader(p, modules)].in_features for p in chosen}
    try:
        dev = next(model.parameters()).device
        owner = shared_inputs(model, chosen, modules, torch.zeros(1, 8, dtype=torch.long, device=dev))
    except Exception:  # a model whose probe cannot run here: every tensor its own input
        owner = {p.name: p.name for p in chosen}
    return [width[src] for src in dict.fromkeys(owner.values())]


def hessian_flops(tokens: float, inputs: Iterable[int]) -> float:
    """The flops of the Hessians' products over `tokens` for inputs of these widths: each the upper
    block triangle of xᵀx (training/hessians.py ``gram_flops``: (B+1)/(2B) of 2·tokens·n²)."""
    return sum(gram_flops(tokens, n) for n in inputs)


def _numel(p) -> int:
    n = 1
    for s in p.shape:
        n *= int(s)
    return n


def forward_seconds(tokens: float, flops_per_token: float, rates: Rates, k: float = K_FORWARD) -> float:
    return tokens * flops_per_token / rates.gemm * k


# -- the candidate stage -------------------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    name: str
    qtype: str
    rows: int
    n: int
    compensated: bool
    imatrix: bool = True  # quantized with an imatrix vector (the tensor is covered)


def job_seconds(job: Job, rates: Rates) -> float:
    """One thread's seconds for one candidate (the factor not included)."""
    numel = job.rows * job.n
    t = qt.get(job.qtype).name
    walked = job.compensated and applies(job.qtype)
    s = 0.0 if walked and t in rates.written else numel / rates.quant_rate(job.qtype, job.imatrix)  # written: the walk's bytes
    if walked:
        s += (rates.comp_weight[t] * numel + rates.comp_step[t] * job.n / STEP
              + job.rows * float(job.n) ** 2 / rates.gemm1)
    return s


def factor_seconds(n: int, rates: Rates) -> float:
    """A Cholesky factor of width `n` on one thread: n³/3 at the probe's rate (n = 1,024), which
    grows toward n = 8,960 by :data:`CHOL_LARGE` (log-linear in n between, flat outside)."""
    span = math.log(8960 / 1024)
    grow = CHOL_LARGE ** min(1.0, max(0.0, math.log(max(n, 1) / 1024) / span))
    return n ** 3 / 3.0 / (rates.chol * grow)


def candidate_seconds(jobs: Sequence[Job], rates: Rates, factors: Sequence[int], workers: int) -> tuple[float, str]:
    """Wall seconds of building `jobs` on `workers` processes: their one-thread seconds at the
    probe's parallel throughput (never less than the longest job), the Cholesky factors of
    `factors` (each n computed once per worker that needs it) and the workers' grid setup."""
    if not jobs:
        return 0.0, "every candidate found in the cache"
    each = [job_seconds(j, rates) for j in jobs]
    chol = sum(factor_seconds(n, rates) for n in factors)
    par = min(float(workers), rates.parallel)
    grid = sum(GRID_SETUP_S.get(t, 0.0) for t in {j.qtype for j in jobs})
    wall = max((sum(each) + chol) / par, max(each)) + grid
    comp = sum(1 for j in jobs if j.compensated and applies(j.qtype))
    note = (f"{len(jobs)} candidates ({comp} compensated), {sum(each) / 3600:.2f} h on one thread"
            + (f" + factors {chol / 3600:.2f} h" if chol else "") + f", {workers} worker(s) at {par:.2f}× one")
    return wall, note


def candidate_jobs(plans: Sequence, modules: Mapping[str, nn.Module], *, compensated: bool,
                   extra: Mapping[str, Iterable[str]] | None = None, covered: Iterable[str] = ()) -> list[Job]:
    """Every (tensor, type) to build: the menus (compensated where `compensated` and the tensor has
    a Hessian), and `extra` (tensor -> the guarantee's off-menu types), always plain
    (``training/setup.extra_candidate_blobs``); a tensor whose GGUF name `covered` holds is
    quantized with its imatrix vector."""
    covered = set(covered)
    jobs = []
    for p in plans:
        comp = compensated and compensable(p, modules)
        rows = _numel(p) // p.n_per_row
        cov = p.gguf_name in covered
        jobs += [Job(p.name, t, rows, p.n_per_row, comp, cov) for t in p.menu.types]
        jobs += [Job(p.name, t, rows, p.n_per_row, False, cov)
                 for t in sorted(set((extra or {}).get(p.name, ())) - set(p.menu.types))]
    return jobs


def factor_widths(plans: Sequence, modules: Mapping[str, nn.Module], inputs: Sequence[int], workers: int) -> list[int]:
    """The n of every Cholesky factor the build computes: each distinct input's, once per worker
    that builds one of its tensors (at most one per type of the menu)."""
    k = max((len(p.menu.types) for p in plans if compensable(p, modules)), default=0)
    return [n for n in inputs for _ in range(min(workers, k))]


def cached_candidates(plans: Sequence, vectors: Mapping[str, object], root: Path | None = None,
                      extra: Mapping[str, Iterable[str]] | None = None) -> set[tuple[str, str]]:
    """(tensor, type) of the plain candidates the cache appears to hold, of the menus and of
    `extra` (tensor -> off-menu types, plain whatever the run's compensation): an entry whose meta
    names the tensor with its shape, type, imatrix vector and this libggml (cache.py's key, but for
    the weights' contents: hashing them needs the weights). Compensated entries are not matched
    (their key holds the Hessians' hash)."""
    root = root or default_root()
    if not root.is_dir():
        return set()
    version = lib_version()
    want: dict[tuple, tuple[str, str]] = {}
    for p in plans:
        vec = vectors.get(p.gguf_name) if p.gguf_name else None
        for t in dict.fromkeys([*p.menu.types, *sorted((extra or {}).get(p.name, ()))]):
            v = None if qt.get(t).is_float else vec
            want[(p.name, (_numel(p) // p.n_per_row, p.n_per_row), t, vector_hash(v))] = (p.name, t)
    found = set()
    for meta in root.glob("*/*/meta.json"):
        try:
            m = json.loads(meta.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if m.get("lib_version") != version or m.get("compensation") is not None:
            continue
        key = (m.get("name"), tuple(m.get("shape") or ()), m.get("qtype"), m.get("imatrix"))
        if key in want and (meta.parent / "data.bin").is_file():
            found.add(want[key])
    return found
