"""A memory model of a training run: predicted peak device memory per rank and host memory.

Everything is derived from shapes (a skeleton model on the ``meta`` device is enough, so it works
from a ``config.json`` alone) and the run's flags; nothing is allocated. The terms follow what the
code holds:

* **mixed weights**: without ``--gradient_checkpointing``, inside ``layers.cached()``
  (training/trainer.py ``micro_backward``) every gated weight's mixture ``W = Σ p_k W_k`` is
  computed once per step and kept until the backward ends (eager float32 mixtures are written
  into tensors kept from step to step, ``layers.MixBuffers``, and released when training ends:
  the same peak): the rank's part of every selectable weight, in the training dtype (a tied
  embedding / LM head once). With it, each layer's weights
  are mixed when the layer runs and again when it is recomputed (``trainer.mixes_per_layer``): one decoder layer's mixtures, plus
  the LM head's, which lives through the loss; and autograd's gradient of the largest one;
* **candidates**: packed ggml bytes (``--lazy``; this rank's rows / blocks under TP), int8 codes
  and sub-block scales (eager float32 on the CPU, one process: :mod:`voodoo_quant.candidates.compact`) or K
  dense copies (eager otherwise); plus the mixing transient: float32 accumulator, product and dequantized
  candidate of the largest block ``layers._Mix`` mixes at once (a weight over
  ``layers.MIX_CHUNK_ELEMENTS`` whose candidates can be read by rows is mixed by blocks of rows);
* **gates and Adam**: K float32 logits, their gradient and two moments, and the float64 byte sizes;
* **the teacher**: every weight in the training dtype, or, under ``--lazy`` with a Q8_0 teacher,
  its selectable weights as packed Q8_0 (8.5 bits, training/teacher_q8.py) plus what is
  dequantized on use (the LM head's shard through the loss, one block of a layer's weight);
* **activations**: what autograd saves for one decoder layer of each kind, counted by running
  that layer on ``meta`` at ``--batch_size`` × ``--seq_len`` under ``saved_tensors_hooks``
  (attention counted as a flash kernel saves it: q, k, v, output and the log-sum-exp, never the
  T×T matrix); with ``--gradient_checkpointing`` only each layer's input is kept (under tensor
  parallelism 1/world of it per rank, :mod:`voodoo_quant.distributed.tp_checkpoint`), plus one layer
  recomputed in backward;
* **loss chunks**: ``--loss_chunk_size`` tokens × this rank's vocabulary in float32 (student and
  teacher logits, log-softmaxes, the KL product) and both models' final hidden states.

Host memory is the loading peak: the float32 model once, its float teacher sharing its tensors
(or cast from them; a Q8_0 or checkpoint teacher, or TP loaded whole, is a second float32 copy) on
one device, or, from a skeleton, one full tensor and this rank's shards (sharded loading under
tensor parallelism and in one process with ``--lazy``, :mod:`voodoo_quant.model.lazyload`), plus the
process baseline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import torch.nn as nn

from ..candidates import compact
from ..core.errors import ConfigError
from ..core.units import GB
from ..distributed.parallel import decoder_layers
from ..model.lm_head import chunk_reason
from ..selection.budget import Budget
from ..student.build import IdentityLayout
from ..student.layers import MIX_CHUNK_ELEMENTS, chunk_rows
from ..training.target_size import run_budget
from .phases import add_compensation, builds_student, measure_phase, one_shot_device, references_bytes, sensitivity_term
from .probe import _layer_kinds, layer_saved_bytes
from .terms import PROCESS_BASELINE, Term

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class MemoryPlan:
    device: list[Term] = field(default_factory=list)  # per rank, on its device
    host: list[Term] = field(default_factory=list)  # per rank, host RAM at the loading peak
    disk: list[Term] = field(default_factory=list)  # files the run writes or fills (the whole run, not per rank)
    world: int = 1
    device_kind: str = "cpu"
    capacity: float | None = None  # bytes of one device, when given
    advice: list[str] = field(default_factory=list)

    @property
    def device_total(self) -> float:
        return sum(t.bytes for t in self.device)

    @property
    def host_total(self) -> float:
        return sum(t.bytes for t in self.host)

    @property
    def cpu_peak(self) -> float:
        """A CPU run's peak RSS: device and host are the same memory; the larger phase wins."""
        return max(self.device_total, self.host_total - PROCESS_BASELINE) + PROCESS_BASELINE

    def fits(self, headroom: float = 0.9) -> bool | None:
        """Whether the device terms fit `headroom` of the device (allocator and context overhead)."""
        if self.capacity is None:
            return None
        return self.device_total <= headroom * self.capacity

    def lines(self) -> list[str]:
        out = [f"predicted memory per rank ({self.world} rank(s), {self.device_kind}); a prediction, not a measurement"]
        for t in self.device:
            out.append(f"  device  {t.name:<34} {t.bytes / GB:9.2f} GB  {t.note}")
        out.append(f"  device  {'TOTAL (peak)':<34} {self.device_total / GB:9.2f} GB")
        for t in self.host:
            out.append(f"  host    {t.name:<34} {t.bytes / GB:9.2f} GB  {t.note}")
        out.append(f"  host    {'TOTAL (loading peak)':<34} {self.host_total / GB:9.2f} GB")
        for t in self.disk:
            out.append(f"  disk    {t.name:<34} {t.bytes / GB:9.2f} GB  {t.note}")
        if self.disk:
            out.append(f"  disk    {'TOTAL':<34} {sum(t.bytes for t in self.disk) / GB:9.2f} GB")
        if self.device_kind == "cpu":
            out.append(f"  cpu run peak RSS (device and host are one memory): {self.cpu_peak / GB:.2f} GB")
        if self.capacity is not None:
            verdict = "fits" if self.fits() else "DOES NOT FIT"
            out.append(f"  {verdict}: {self.device_total / GB:.2f} GB of {self.capacity / GB:.0f} GB per device "
                       f"(limit 90 % for allocator and context overhead)")
        out += [f"  change: {a}" for a in self.advice]
        return out


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _rank_numel(name: str, shape: Sequence[int], tp_plan, world: int) -> int:
    sh = tp_plan.shard_of(name) if tp_plan is not None else None
    if sh is None:
        return _numel(shape)
    return _numel(shape) * len(sh.index(0, world)) // sh.size


def plan_memory(cfg, model: nn.Module, plans: Sequence, *, adapter=None, tp_plan=None, world: int = 1,
                capacity: float | None = None, device_kind: str | None = None, replan=None,
                covered: set[str] | None = None, budget: Budget | None = None) -> MemoryPlan:
    """The memory plan of `cfg` (a TrainConfig) for `model` (a skeleton or loaded model, not yet
    split or gated) with its `plans`; `tp_plan` / `world` for a tensor-parallel rank. `replan`
    (changes -> MemoryPlan) lets the plan say which flag changes would make it fit. `covered`: the
    GGUF names the imatrix holds (default: every tensor with --imatrix, none without). `budget`:
    the run's (:func:`training.target_size.run_budget`; default: made here, without fixed tensors)."""
    db = DTYPE_BYTES[cfg.dtype]
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.dtype]
    kind = device_kind or ("cuda" if str(cfg.device).startswith("cuda") else "cpu")
    mp = MemoryPlan(world=world, device_kind=kind, capacity=capacity)
    text = model.config.get_text_config()
    hidden, vocab = text.hidden_size, text.vocab_size
    _, layers = decoder_layers(model)
    n_layers = len(layers)
    planned = {p.name for p in plans} | {f"{m}.weight" for p in plans for m in p.modules}

    # -- weights and candidates -----------------------------------------------------------------
    sel = {p.name: _rank_numel(p.name, p.shape, tp_plan, world) for p in plans}
    frac = {p.name: sel[p.name] / _numel(p.shape) for p in plans}
    big = max(sel.values())
    head = _head_plan(model, plans)
    if _mixes_per_layer(cfg):
        per_layer = _layer_numel(plans, sel, model)
        head_n = sel[head] if head else 0
        # a layer's mixtures live through its forward (and its recompute in backward), the LM
        # head's from the loss's forward through its backward: one or the other, never both
        # (bench/memory_model.py, the checkpointed rows: their sum over-predicted by 14-20 %)
        mixed_bytes = (per_layer + head_n) * db  # the probe mixes and keeps both (memory_phases.py)
        mp.device.append(Term("mixed weights (one layer at a time)", max(per_layer, head_n) * db,
                              f"the larger of one layer {per_layer / 1e6:.1f}e6 and the LM head {head_n / 1e6:.1f}e6 "
                              f"weights (of {sum(sel.values()) / 1e9:.2f}e9) x {db} B"))
    else:
        mixed_bytes = sum(sel.values()) * db
        mp.device.append(Term("mixed weights (cached per step)", sum(sel.values()) * db,
                              f"{sum(sel.values()) / 1e9:.2f}e9 weights x {db} B"
                              + ("; --gradient_checkpointing mixes one layer at a time" if not cfg.gradient_checkpointing else "")))
    mp.device.append(Term("gradient of the largest mixed weight", big * db, "autograd's dL/dW, in the training dtype"))
    if cfg.lazy:
        cand = sum(sum(p.sizes) * frac[p.name] for p in plans)
        mp.device.append(Term("candidates (packed, --lazy)", cand, f"{cand * 8 / max(1, sum(sel.values())):.1f} bits/weight"))
    elif compact.holds_codes(kind, cfg.dtype, world):
        cand = sum(compact.held_bytes(p.menu.types, sel[p.name]) for p in plans)
        mp.device.append(Term("candidates (int8 codes, eager)", cand,
                              f"{cand * 8 / max(1, sum(sel.values())):.1f} bits/weight: codes + sub-block scales, "
                              "mixed by the native kernel"))
    else:
        cand = sum(len(p.sizes) * sel[p.name] * db for p in plans)
        mp.device.append(Term("candidates (dense, eager)", cand, "K dense copies; --lazy packs them"))

    def block(p) -> int:  # the elements layers._Mix mixes at once for plan p
        n = sel[p.name]
        if n <= MIX_CHUNK_ELEMENTS or (cfg.lazy and not _rows_readable(p)):
            return n
        shape = (n // (_numel(p.shape) // p.shape[0]), _numel(p.shape) // p.shape[0])
        return chunk_rows(shape) * shape[1]

    blk = max(block(p) for p in plans)
    per = (4 + 4 + 4 + db) if cfg.lazy else (4 + 4)
    mp.device.append(Term("mixing transient (largest block)", blk * per,
                          f"{blk / 1e6:.1f}e6 weights: fp32 accumulator + product" + (" + dequantized W_k" if cfg.lazy else "")
                          + (f"; blocks of rows over {MIX_CHUNK_ELEMENTS / 1e6:.1f}e6" if blk < big else "")))
    others = 0
    seen: set[int] = set()
    for name, p in [*model.named_parameters(remove_duplicate=False)]:
        if name in planned or id(p) in seen:
            continue
        seen.add(id(p))
        others += _rank_numel(name, p.shape, tp_plan, world)
    mp.device.append(Term("other weights (norms, small projections)", others * db))
    n_gates = sum(len(p.sizes) for p in plans)
    mp.device.append(Term("gates, gradients, Adam, byte sizes", n_gates * (4 * 4 + 8)))

    # -- the teacher ----------------------------------------------------------------------------
    t_numel = sum(sel.values()) + others
    q8 = cfg.teacher_quant == "Q8_0" or bool(cfg.teacher_checkpoint)
    on_host_teacher = bool(cfg.teacher_device) and cfg.teacher_device != cfg.device
    teacher_terms = []
    if q8 and cfg.lazy:  # training/teacher_q8.py
        t_bytes = sum(sel.values()) * 34 / 32 + others * db
        teacher_terms.append(Term("teacher weights (packed Q8_0, --lazy)", t_bytes,
                                  f"8.5 bits/weight; {sum(sel.values()) * db / GB:.2f} GB dense in {cfg.dtype}"))
        h = sel[head] if head else 0
        # a layer's weight is dequantized block by block in the teacher's forward, before the
        # student's: that transient (8 B a weight) never meets the larger mixing transient
        teacher_terms.append(Term("teacher dequantized on use", h * db, "its LM head shard, dense through the loss"))
    else:
        t_bytes = t_numel * db
        teacher_terms.append(Term("teacher weights", t_bytes, ("Q8_0 teacher held dequantized; --lazy packs it" if q8
                                                                else "float teacher")))
    if not on_host_teacher:
        mp.device.extend(teacher_terms)

    # -- activations ----------------------------------------------------------------------------
    B, T = cfg.batch_size, cfg.seq_len
    per_kind = {}
    for i in _layer_kinds(model):
        try:
            per_kind[i] = layer_saved_bytes(model, i, B, T, tdtype, adapter, world)
        except Exception:  # an architecture the probe cannot run: a Llama-like estimate
            inter = getattr(text, "intermediate_size", 4 * hidden)
            per_kind[i] = B * T * (8 * hidden + 4 * inter / world) * db
    kinds = _layer_kinds(model)
    types = getattr(text, "layer_types", None)

    def saved_of(j: int) -> float:
        for i in kinds:
            if type(layers[i]) is type(layers[j]) and (not types or types[i] == types[j]):
                return per_kind[i]
        return max(per_kind.values())

    all_layers = sum(saved_of(j) for j in range(n_layers))
    layer_in = B * T * hidden * db
    if cfg.gradient_checkpointing and world > 1:  # tp_checkpoint.py: 1/world of each kept input
        act = n_layers * layer_in / world + layer_in + max(per_kind.values()) + 2 * B * T * hidden * 4
        mp.device.append(Term("activations (--gradient_checkpointing)", act,
                              f"{n_layers} layer inputs split over {world} ranks ({n_layers * layer_in / world / GB:.2f} GB) "
                              f"+ one gathered and recomputed ({(layer_in + max(per_kind.values())) / GB:.2f} GB)"))
    elif cfg.gradient_checkpointing:
        act = n_layers * layer_in + max(per_kind.values()) + 2 * B * T * hidden * 4
        mp.device.append(Term("activations (--gradient_checkpointing)", act,
                              f"{n_layers} layer inputs + one layer recomputed ({max(per_kind.values()) / GB:.2f} GB)"))
    else:
        mp.device.append(Term("activations (all layers saved)", all_layers + layer_in,
                              f"with --gradient_checkpointing: {(n_layers * layer_in + max(per_kind.values())) / GB:.2f} GB"))
    act_bytes = mp.device[-1].bytes  # the activation term just added
    # the teacher's no-grad forward: one layer's intermediates at a time
    mp.device.append(Term("teacher forward (no grad, one layer)", max(per_kind.values()) / 2))

    # -- loss -----------------------------------------------------------------------------------
    n_tok = B * (T - 1)
    chunk = n_tok if cfg.loss_chunk_size <= 0 else min(cfg.loss_chunk_size, n_tok)
    v_rank = -(-vocab // world)
    loss = loss_chunk_bytes(chunk, v_rank, db) + 2 * n_tok * hidden * db
    mp.device.append(Term("loss chunk (logits, log-softmax, KL)", loss,
                          f"{chunk} tokens x {v_rank} vocab" + ("" if cfg.loss_chunk_size > 0 else "; --loss_chunk_size bounds it")))
    # the guarantee's off-menu candidates, packed in RAM from the setup to the end of the run
    if covered is None:
        covered = {p.gguf_name for p in plans if p.gguf_name} if cfg.imatrix else set()
    if cfg.measures and budget is None:
        budget = run_budget(cfg, plans, {})  # no layout map here: no tensor is known to be fixed
    refs, refs_note = references_bytes(cfg, model, plans, covered, budget, frac) if cfg.measures else (0.0, "")
    refs_term = Term("guarantee's off-menu candidates (packed, in RAM)", refs, refs_note) if refs else None
    if refs_term and kind == "cpu":  # a CPU run's device is that RAM, through training too
        mp.device.append(refs_term)
    if cfg.measures:  # the guarantee and the search: their own phase after training (memory_phases.py)
        phase = measure_phase(cfg, db=db, hidden=hidden, vocab_rank=v_rank, n_layers=n_layers, world=world,
                              plain_head=chunk_reason(model) is None, biggest=big, block=blk,
                              probe_mixed=mixed_bytes,
                              probe_activations=act_bytes / B,
                              probe_loss=loss_chunk_bytes(min(cfg.loss_chunk_size or T, T - 1), v_rank, db))
        kept = (cand + others * db + n_gates * (4 * 4 + 8) + (0 if on_host_teacher else sum(t.bytes for t in teacher_terms))
                + (refs if kind == "cpu" else 0.0))
        over = kept + phase.extra - mp.device_total
        mp.device.append(Term("post-bake measurements: above training" if over > 0 else "post-bake measurements",
                              max(0.0, over), f"own phase, peak {(kept + phase.extra) / GB:.2f} GB: {phase.note}"))

    # -- host: the loading peak -----------------------------------------------------------------
    full = sum(_numel(p.shape) for p in plans) + sum(
        p.numel() for n, p in model.named_parameters() if n not in planned)
    biggest = max(_numel(p.shape) for p in plans)
    mp.host.append(Term("process baseline (torch, transformers)", PROCESS_BASELINE))
    skeleton = (world > 1 or cfg.lazy) and _reads_by_name(cfg.model)
    if skeleton:
        mp.host.append(Term("one full tensor in flight (float32)", 3 * biggest * 4, "read, GGUF-layout copy, quantizer input"))
        what = "teacher shards" if world > 1 else "teacher"
        mp.host.append(Term(f"{what} (cast as read)" if not (q8 and cfg.lazy) else f"{what} (packed Q8_0)", t_bytes))
        mp.host.append(Term("student small weights (float32, whole)", sum(
            p.numel() for n, p in model.named_parameters() if n not in planned) * 4))
    else:
        if q8 or world > 1:  # training/models.py load_models: deep copy, else float_teacher
            mp.host.append(Term("student + teacher, float32 (deep copy)", 2 * full * 4, "loaded whole on one device"))
        else:
            mp.host.append(Term("student + teacher, float32 (shared)" if db == 4 else "student float32 + teacher cast from it",
                                full * (4 + (db if db != 4 else 0)), "loaded whole"))
        if q8 and cfg.lazy:  # teacher_q8.py: the blocks exist before the float copy is dropped
            mp.host.append(Term("teacher Q8_0 blocks (packed at load)", sum(sel.values()) * 34 / 32))
        mp.host.append(Term("one tensor's candidate bytes", sum(max(p.sizes) for p in plans[:1]) * 2))
    if on_host_teacher:
        mp.host.append(Term("teacher weights (--teacher_device)", t_bytes))
    if refs_term:  # made while the loaded weights are still there (training/references.py)
        mp.host.append(refs_term)
    if cfg.needs_sensitivity:
        mp.host.append(sensitivity_term(cfg, model, plans, full, world, hidden, n_layers, skeleton))
    if not builds_student(cfg):  # --method sensitivity, a finalize: no student, teacher or gates exist
        f32 = 4 / (B * db)  # the probe's bytes are the training dtype's for B sequences; the pass is float32, one
        mp.device = one_shot_device(cfg, skeleton=skeleton,
                                    layer_bytes=_layer_numel(plans, sel, model) * 4 + max(per_kind.values()) * f32)
        if cfg.needs_sensitivity and not skeleton:  # the loaded model's pass: one sequence through one layer
            mp.host.append(Term("sensitivity pass: one sequence's activations and loss",
                                (max(per_kind.values()) + layer_in) * f32 + loss_chunk_bytes(T - 1, vocab, 4),
                                "one layer's saved activations and the float32 logits of one sequence (the head's)"))
    add_compensation(mp, cfg, model, plans, skeleton=skeleton, world=world)  # last: its layer-by-layer phase is set against the rest
    mp.disk.insert(0, Term("candidate cache (VOODOO_CACHE_DIR)", float(sum(sum(p.sizes) for p in plans)),
                           "every menu candidate of every tensor" + (" (compensated: keyed apart from plain ones)"
                                                                   if cfg.compensation != "none" else "")))
    mp.advice = _advice(cfg, mp, capacity, replan)
    return mp


def _reads_by_name(model: str) -> bool:
    """Whether a training run can build `model` as a skeleton and read its tensors by name
    (training/models.py ``can_load_sharded``: a directory of safetensors; a config-only directory,
    as the dry run plans from, is taken to be one). A GGUF or a ``.bin`` checkpoint loads whole."""
    src = Path(model)
    if not src.is_dir():
        return False
    if any(src.glob("*.safetensors")):
        return True
    return not any(src.glob("*.bin")) and not any(src.glob("*.pt"))


def loss_chunk_bytes(tokens: int, vocab: int, db: int) -> float:
    """Peak bytes of one checkpointed loss chunk over `vocab` columns (bench/loss_memory.py):
    six float32 [tokens, vocab] buffers (student and teacher logits, log-softmaxes, the KL
    product) and the student's logits in the training dtype."""
    return 6 * tokens * vocab * 4 + tokens * vocab * db


def _mixes_per_layer(cfg) -> bool:
    """training/trainer.py ``mixes_per_layer``: checkpointing, no routed steps."""
    return bool(cfg.gradient_checkpointing and not cfg.ptqr and cfg.st_gumbel_fraction <= 0)


def _head_plan(model: nn.Module, plans: Sequence) -> str | None:
    """The plan of the LM head's weight (tied or not), if it is gated."""
    for p in plans:
        if any(m in ("lm_head", "output", "embed_out") or m.endswith(".lm_head") for m in p.modules):
            return p.name
    return None


def _layer_numel(plans: Sequence, sel: dict, model: nn.Module) -> int:
    """The rank's gated weights of the largest decoder layer."""
    prefix, layers = decoder_layers(model)
    per: dict[int, int] = {}
    for p in plans:
        rest = p.name[len(prefix) + 1:] if p.name.startswith(prefix + ".") else ""
        idx = rest.split(".", 1)[0]
        if idx.isdigit():
            per[int(idx)] = per.get(int(idx), 0) + sel[p.name]
    return max(per.values(), default=0)


def _rows_readable(p) -> bool:
    """Whether lazy candidates of plan `p` can be read by rows (student.PackedCandidates.row_reader)."""
    inner = getattr(p.layout, "inner", None)
    if len(p.shape) != 2:
        return False
    return inner.is_identity if inner is not None else isinstance(p.layout, IdentityLayout)


def _advice(cfg, mp: MemoryPlan, capacity, replan) -> list[str]:
    """Flag changes that make the run fit, each with the device total it gives (re-planned), and the
    cheapest combination found greedily (largest saving first) when no single change is enough."""
    if capacity is None or mp.fits() or replan is None:
        return []
    limit = 0.9 * capacity
    options: list[tuple[str, dict]] = []
    if not cfg.gradient_checkpointing:
        options.append(("--gradient_checkpointing", {"gradient_checkpointing": True}))
    if not cfg.lazy:
        options.append(("--lazy", {"lazy": True}))
    if cfg.loss_chunk_size <= 0 or cfg.loss_chunk_size > 1024:
        options.append(("--loss_chunk_size 1024", {"loss_chunk_size": 1024}))
    if cfg.seq_len >= 1024:
        options.append((f"--seq_len {cfg.seq_len // 2}", {"seq_len": cfg.seq_len // 2}))
    if mp.world > 1:
        options.append((f"--tensor_parallel {2 * mp.world}", {"__world": 2 * mp.world}))
    elif not cfg.teacher_device and str(cfg.device).startswith("cuda"):
        options.append(("--teacher_device cpu", {"teacher_device": "cpu"}))
    single, out = [], []
    for flag, change in options:
        try:
            single.append((replan(change).device_total, flag, change))
        except ConfigError as e:  # e.g. a degree the heads do not split into
            out.append(f"{flag}: not possible ({str(e).splitlines()[0]})")
    out = [f"{flag}: {total / GB:.1f} GB" + (" (fits)" if total <= limit else "") for total, flag, _ in single] + out
    if any(total <= limit for total, _, _ in single):
        return out
    chosen, merged, t = [], {}, mp.device_total
    for total, flag, change in sorted(single, key=lambda t: t[0]):
        merged.update(change)
        chosen.append(flag)
        t = replan(dict(merged)).device_total
        if t <= limit:
            out.append(f"together: {' '.join(chosen)}: {t / GB:.1f} GB (fits)")
            return out
    out.append(f"no combination of these flags fits {capacity / GB:.0f} GB (all of them: {t / GB:.1f} GB)")
    return out
