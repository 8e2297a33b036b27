"""The memory of a run's phases beside its training steps, for :func:`voodoo_quant.memory.plan.plan_memory`.

**The sensitivity pass** (training/sensitivity.py) runs before training, one decoder layer at a
time: in place at the loading peak on a loaded model, or on a skeleton before anything is loaded
(:func:`sensitivity_term`).

**The post-bake measurements**, the guarantee and the search (training/objective.py), run after
the last training step, when the step's mixtures, activations and loss chunks are gone. They are a
phase of their own: the run's device peak is the larger of the two phases, and
:func:`voodoo_quant.memory.plan.plan_memory` adds the excess as one term (:func:`measure_phase`). Beside what
training leaves resident (candidates, teacher, other weights, gates) the phase holds:

* **served weights**: none beyond a layer's use: each gated weight serves one rung, produced when
  its layer runs (a view of an eager stack; a ``--lazy`` rung dequantized and dropped after use:
  ``rungs.RungSource``), so one dense weight at a time.
* **the probe** (the search only): one forward and backward of one held-aside sequence, each
  tensor serving the one-hot mixture of its three neighbouring rungs: the mixtures autograd keeps
  for backward (as a training step keeps them), a training step's activations at batch 1, one
  loss chunk (its logits recomputed in backward), autograd's gradient of the largest weight, and
  the mixing transient of the largest block with float64 dot products.
* **HeldAside's caches**: the teacher's log-probabilities when they fit in
  ``TEACHER_CACHE_BYTES``, else its final hidden states; under tensor parallelism its hidden
  states when they fit, else nothing, the teacher then running at every measurement. And the
  committed assignment's decoder-layer outputs, kept only when they fit in
  ``PREFIX_CACHE_BYTES``.

**The guarantee's off-menu candidates** (training/references.py): the references' types that are
on no tensor's menu, quantized in the setup (plain, never compensated: training/guarantee.py) and
held packed in RAM to the end of the run (:func:`references_bytes`); a tensor-parallel rank holds
the bytes of its shards.

``--search_sequences`` counts the held-aside sequences; the search's confirmation
(``--search_confirm``) measures its own split after the search's is released, so the larger of
the two counts. ``hold_aside`` keeps at most a quarter of the tokens file, so on a small file this
is an upper bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch.nn as nn

from ..candidates.compensate import FACTOR_CACHE_BYTES
from ..core import envs
from ..core.units import GB
from ..selection.budget import Budget
from ..training.guarantee import plan_references, rung_bytes, stock_provider
from ..training.hessians import compensable
from ..training.layer_hessians import phase_bytes
from ..training.layerwise import accumulator_bytes, host_bytes
from ..training.objective import PREFIX_CACHE_BYTES, TEACHER_CACHE_BYTES
from ..training.sensitivity import GRAM_BYTES, gram_bytes
from .terms import PROCESS_BASELINE, Term


@dataclass(frozen=True)
class MeasurePhase:
    extra: float  # bytes the phase holds beyond what training leaves resident
    note: str


def measure_phase(cfg, *, db: int, hidden: int, vocab_rank: int, n_layers: int, world: int, plain_head: bool,
                  biggest: float, block: float, probe_mixed: float, probe_activations: float,
                  probe_loss: float) -> MeasurePhase:
    """What the guarantee and the search add to the resident weights of one rank, at their peak
    (the search's probe). `plain_head`: the LM head is a plain linear layer
    (``losses.chunk_reason`` is None), so HeldAside can chunk it; `biggest`: this rank's largest
    gated weight and `block` the most elements ``layers._Mix`` mixes at once; `probe_mixed`: the
    mixtures autograd keeps for backward, as in a training step (every weight's, or with
    ``--gradient_checkpointing`` one layer's and the head's); `probe_activations` / `probe_loss`:
    one training step's activations at batch 1 and one loss chunk."""
    n_seq, T = max(cfg.search_sequences, cfg.search_confirm if cfg.searches else 0), cfg.seq_len
    n_pred = n_seq * (T - 1)
    served = biggest * db if cfg.lazy else 0.0  # one dequantized rung in use
    if world > 1:
        teacher = n_pred * hidden * db if n_pred * hidden * 4 <= TEACHER_CACHE_BYTES else 0.0
    elif plain_head and n_pred * vocab_rank * 4 > TEACHER_CACHE_BYTES:
        teacher = n_pred * hidden * db
    else:
        teacher = n_pred * vocab_rank * 4.0
    prefix_need = n_layers * n_seq * T * hidden
    prefix = prefix_need * db if prefix_need * 4 <= PREFIX_CACHE_BYTES else 0.0
    # float32 accumulator and product forward; the float64 gradient block and candidate backward
    probe = (probe_mixed + probe_activations + probe_loss + biggest * db + block * (8 + 8 + db)
             if cfg.searches else 0.0)
    parts = [("a served weight in use", served), ("teacher cache", teacher), ("layer-output cache", prefix),
             ("probe (one sequence)", probe)]
    note = ", ".join(f"{name} {b / GB:.2f}" for name, b in parts if b > 0) or "nothing beyond the resident weights"
    return MeasurePhase(max(served, probe) + teacher + prefix, note + " GB")


def references_bytes(cfg, model: nn.Module, plans: Sequence, covered: set[str], budget: Budget,
                     frac: Mapping[str, float] | None = None) -> tuple[float, str]:
    """The packed candidates of the guarantee's off-menu types (``training/references.py``: a stock
    recipe's Q6_K where the menu has none), made in the trainer's setup and held in RAM to the end
    of the run, with a note of which types. The same references the trainer plans: the uniform
    files and stock recipes that fit `budget`, the run's (the knapsack is made of menu types). `frac`: the
    share of each tensor a tensor-parallel rank holds (its shard's bytes). 0 without the guarantee."""
    if not cfg.guarantee:
        return 0.0, ""
    stock = stock_provider(plans, getattr(model, "config", None), has_imatrix=bool(covered))
    refs = plan_references(plans, budget.upper_bytes, covered=covered, stock=stock, stock_ftypes=cfg.stock_references,
                           menu_types=sorted({t for p in plans for t in p.menu.types}))
    by = {p.name: p for p in plans}
    total = float(sum(rung_bytes(by[n], t) * (frac or {}).get(n, 1.0) for n, types in refs.extra.items() for t in types))
    kinds = sorted({t for types in refs.extra.values() for t in types})
    refs_named = ", ".join(c.name for c in refs.candidates)
    return total, (f"{', '.join(kinds)} for {refs_named}" if kinds else "")


def sensitivity_term(cfg, model: nn.Module, plans: Sequence, full: int, world: int, hidden: int,
                     n_layers: int, skeleton: bool) -> Term:
    """The sensitivity pass (training/sensitivity.py). The Fisher kind runs one decoder layer at a
    time (training/layerwise.py): on a loaded model, in place at the loading peak, adding the
    stored layer inputs (:func:`host_bytes`) and the float32 Fisher accumulators of the embedding
    and head and of one layer (one sequence's activations through a layer and the head's logits
    are the run's own term, ``plan_memory``); a model whose code the layer road cannot follow
    (its embeddings changed before the first layer) runs whole, a float32 accumulator per weight,
    stated in the note. On a skeleton (tensor parallelism, or --lazy in one process) it runs
    before anything is loaded: its own phase, stated in the note and not added to the peak. The
    output kind adds its Gram matrices (at most ``GRAM_BYTES`` at once) to a loaded model."""
    skip = "skipped with --no_warm_start --no_polish --no_guarantee --search_evals 0"
    seqs = cfg.sensitivity_sequences
    who = "rank 0, its own phase" if world > 1 else "its own phase"
    if cfg.sensitivity_kind == "fisher":
        stored = host_bytes(n_layers, seqs, cfg.seq_len, hidden)
        if skeleton:
            return Term(f"sensitivity pass ({who})", 0.0,
                        f"layer by layer before loading: {stored / GB:.2f} GB of stored layer inputs "
                        f"({seqs} x {cfg.seq_len} tokens) + one float32 layer; {skip}")
        outside, layer = accumulator_bytes(model, plans)
        return Term("sensitivity pass: layer by layer (Fisher)", float(stored + outside + layer),
                    f"in place: stored layer inputs {stored / GB:.2f} GB ({seqs} x {cfg.seq_len} tokens) + float32 "
                    f"Fisher accumulators of the embedding and head {outside / GB:.2f} GB and of one layer "
                    f"{layer / GB:.2f} GB (a model the layer road refuses runs whole: one per weight, "
                    f"{full * 4 / GB:.2f} GB); {skip}")
    if cfg.sensitivity_kind == "measured":  # training/measured.py: HeldAside's caches beside the model
        tokens, vocab = seqs * cfg.seq_len, int(getattr(getattr(model, "config", None), "vocab_size", 0) or 0)
        logp = tokens * vocab * 4 if tokens * vocab * 4 <= TEACHER_CACHE_BYTES else tokens * hidden * 4
        prefix = n_layers * tokens * hidden * 4 if n_layers * tokens * hidden * 4 <= PREFIX_CACHE_BYTES else 0
        if str(cfg.device) == "cpu":
            return Term("sensitivity pass (measured): caches", logp + prefix, f"one forward per tensor and rung; {skip}")
        return Term("sensitivity pass (measured, its own phase)", 0.0,
                    f"on the device: the float32 model {full * 4 / GB:.2f} GB + caches {(logp + prefix) / GB:.2f} GB "
                    f"(one forward per tensor and rung); {skip}")
    modules = dict(model.named_modules())
    gram = min(GRAM_BYTES, sum(gram_bytes(p, modules) for p in plans))
    if skeleton:  # the output kind: (rank 0) loads the float32 model whole for it
        return Term(f"sensitivity pass ({who})", 0.0,
                    f"the whole float32 model {full * 4 / GB:.2f} GB + input Gram matrices {gram / GB:.2f} GB; "
                    f"--sensitivity_kind fisher streams it; {skip}")
    return Term("sensitivity pass: input Gram matrices", gram, skip)


def compensation_term(cfg, model: nn.Module, plans: Sequence, *, skeleton: bool = False, world: int = 1) -> Term | None:
    """``--error_compensation``, the larger of its two phases (the stored Hessians are mapped from
    their file, not held), both beside the loaded model:

    - collection (training/layer_hessians.py): one forward over the calibration text, one decoder
      layer at a time, the loaded model's layers run in place on the host: the stored hidden
      states of ``--compensation_sequences`` × ``--seq_len`` tokens (float32), one layer's n²
      float32 accumulators and a batch's activations (:func:`phase_bytes`); on a skeleton
      (`skeleton`: --lazy, tensor parallelism) the collection runs before anything is loaded, a
      phase of its own (:func:`add_compensation`), and is not counted here;
    - candidates: in each of the ``VOODOO_QUANT_WORKERS`` quantization processes, the factors it
      keeps for a tensor's next type (compensate.py, at most ``FACTOR_CACHE_BYTES``) plus, for the
      tensor it works on, the float64 H and its factor and the float32 factor kept.

    Under tensor parallelism (`world` > 1) both are rank 0's: it collects the Hessians and builds
    every candidate while the other ranks wait (training/compensation.py ``ensure``)."""
    if getattr(cfg, "compensation", "none") == "none":
        return None
    dims = compensable_dims(model, plans)
    if not dims:
        return None
    workers = envs.quant_workers()
    per_worker = min(FACTOR_CACHE_BYTES, sum(n * n * 8 for n in dims)) + 3 * max(dims) ** 2 * 8
    name = "Hessians (--error_compensation)" + (", rank 0" if world > 1 else "")
    build = (f"{workers} quantization process(es) × (kept factors, ≤ {FACTOR_CACHE_BYTES >> 20} MiB, + one "
             f"tensor's float64 H and factor, float32 factor: {per_worker / GB:.2f} GB) (VOODOO_QUANT_WORKERS)")
    if skeleton:
        return Term(name, workers * per_worker, f"{build}; collected layer by layer below")
    stored, in_layer, note = phase_bytes(cfg, model, plans, loaded=True)
    collect = stored + in_layer
    return Term(name, max(collect, workers * per_worker),
                f"the larger of the collection ({collect / GB:.2f} GB, {note}) and {build}")


def compensable_dims(model: nn.Module, plans: Sequence) -> list[int]:
    """The input width n of every tensor compensation reads a Hessian for (n × n each)."""
    modules = dict(model.named_modules())
    return [p.layout.n_per_row for p in plans if compensable(p, modules)]


def add_compensation(mp, cfg, model: nn.Module, plans: Sequence, *, skeleton: bool, world: int = 1) -> None:
    """Append ``--error_compensation``'s terms to `mp` (after every other term): the
    :func:`compensation_term`, and on a skeleton (--lazy, tensor parallelism) the layer-by-layer
    collection (training/layer_hessians.py), a phase of its own before the student and teacher
    are read (rank 0's under tensor parallelism): what it holds beyond the rest of the host plan
    (and, on an accelerator, beyond the device's training peak) is added, its own peak stated in
    the note. On disk: the Hessians file, ``<output_dir>/hessians.safetensors``."""
    term = compensation_term(cfg, model, plans, skeleton=skeleton, world=world)
    if term is None:
        return
    mp.host.append(term)
    dims = compensable_dims(model, plans)
    mp.disk.append(Term("Hessians file (--output_dir)", float(sum(n * n * 4 for n in dims)),
                        f"at most: {len(dims)} n² float32 matrices (an input read by several tensors, as q/k/v, "
                        "is stored once); mapped, not loaded, by the run and by export"))
    if not skeleton:
        return
    who = ", rank 0" if world > 1 else ""
    stored, on_device, note = phase_bytes(cfg, model, plans)
    host = PROCESS_BASELINE + stored + (on_device if mp.device_kind == "cpu" else 0.0)
    over = host - mp.host_total
    mp.host.append(Term(f"layer-by-layer Hessian collection{who}" + (": above loading" if over > 0 else ""),
                        max(0.0, over), f"own phase, peak {host / GB:.2f} GB: {note}"))
    if mp.device_kind != "cpu":
        over = on_device - mp.device_total
        mp.device.append(Term(f"layer-by-layer Hessian collection{who}" + (": above training" if over > 0 else ""),
                              max(0.0, over), f"own phase, peak {on_device / GB:.2f} GB on the device"))


def builds_student(cfg) -> bool:
    """Whether the run builds the gated student (training/methods.py ``runner_for``: ``--method
    sensitivity`` writes the knapsack's layout and a finalize bakes a journal's gates; neither
    builds a student, a teacher or gates)."""
    return cfg.method == "gates" and not cfg.finalize_from_partial


def one_shot_device(cfg, *, skeleton: bool, layer_bytes: float) -> list[Term]:
    """The device of a run that builds no student: the loaded model's sensitivity pass runs where
    the model was loaded (the host); a skeleton's streams one decoder layer at a time on the device
    (training/layerwise.py)."""
    if not (cfg.needs_sensitivity and skeleton):
        return [Term("nothing trains (--method sensitivity)", 0.0, "the sensitivity pass runs on the loaded model, on the host")]
    return [Term("sensitivity pass: one decoder layer (float32)", layer_bytes,
                 "its weights and one sequence's activations, streamed layer by layer")]
