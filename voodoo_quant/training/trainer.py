"""``voodoo train``: distil the gates under a dead-zone size budget, then bake.

    loss = CE(student) + λ · KL(teacher ‖ student) + size_weight · dead_zone(E[size] / target − 1)²

Only the gate logits train (Adam, ``--lr``); τ anneals geometrically from ``--tau_start`` to
``--tau_end``; every ``--partial_save_interval`` steps the journal is written, and rerunning the
same command resumes from it. After the last step the gates are baked (``bake.py``) and the
outputs are written atomically to ``--output_dir``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..candidates.cache import default_root
from ..candidates.compensate import QuantInputs
from ..core import faults, fileio
from ..core.errors import ConfigError
from ..core.sizes import parse_size
from ..distributed.device_map import apply_device_map, gate_sum, parse_device_map
from ..distributed.parallel import TPContext, apply_tp, check_same_choice, plan_tp, sync_gate_grads
from ..distributed.tp_checkpoint import install
from ..hardware import resolve_device as _resolve
from ..selection.assignment import Assignment
from ..selection.budget import size_penalty
from ..student import layers
from .. import experimental
from ..experimental import routing
from ..experimental.relaxation import RelaxationGap
from . import journal, methods, provenance
from .bake import BakeResult, bake, polish_baked
from .choices import tensor_choices
from .compensation import ensure as ensure_compensation
from .config import TrainConfig
from .finalize import improve
from .journal import StepMetrics
from .journal import append_log as _append_log
from .journal import read_log as _read_log
from .losses import distill_terms
from .models import TORCH_DTYPES, load_models, sensitivity_model, shard_teacher
from .references import complete_curvature, plan_references_for
from .schedule import batch_indices, tau_at
from .sensitivity import ensure_table, load_stored
from .setup import (
    RunSetup, build_student, candidate_sources, hold_aside, imatrix_vectors, load_imatrix, load_tokens, plan_run,
    plan_shard, reader_weights, tiny,
)
from .tp_losses import tp_distill_terms

log = logging.getLogger(__name__)
LOG_NAME = "train_log.jsonl"


@dataclass
class TrainResult:
    assignment: Assignment
    bake: BakeResult
    output_pt: Path
    assignment_json: Path
    tensor_types: Path
    history: list[StepMetrics] = field(default_factory=list)
    resumed_from: int = 0


def resolve_device(spec: str) -> torch.device:
    return _resolve(spec)


def check_scale_flags(cfg: TrainConfig) -> None:
    """Refuse the combinations tensor parallelism does not cover (before anything loads)."""
    if cfg.tensor_parallel > 1:
        if cfg.ptqr or cfg.st_gumbel_fraction > 0:
            raise ConfigError("--ptqr / --st_gumbel_fraction are single-device modes; drop them with --tensor_parallel")
        if cfg.teacher_device and cfg.teacher_device != cfg.device:
            raise ConfigError("--teacher_device: under --tensor_parallel the teacher is split across the ranks' devices "
                              "like the student; drop --teacher_device")
        if cfg.method != "gates" or cfg.finalize_from_partial:
            raise ConfigError("--method sensitivity and --finalize_from_partial train nothing: run them without "
                              "--tensor_parallel")


class Trainer:
    def __init__(self, cfg: TrainConfig, *, on_step: Callable[[StepMetrics], None] | None = None,
                 progress: bool = False, on_search: Callable | None = None):
        self.cfg = tiny(cfg)
        self.on_step = on_step
        self.on_search = on_search  # called with a search.SearchEvent after every measurement
        self.progress = progress
        self.run: RunSetup | None = None

    # -- setup -------------------------------------------------------------------------------
    @property
    def is_main(self) -> bool:
        """The process that writes the outputs (always, unless a tensor-parallel rank > 0)."""
        return self.run is None or self.run.tp is None or self.run.tp.is_main

    def prepare(self, *, build: bool = True) -> RunSetup:
        cfg = self.cfg
        check_scale_flags(cfg)
        tp = None
        if cfg.tensor_parallel > 1:
            tp = TPContext.current(cfg.tensor_parallel, "gloo" if cfg.device == "cpu" else "nccl")
        devices = _devices(cfg, tp)
        device = devices[0]
        dtype = TORCH_DTYPES[cfg.dtype]
        if build:
            fileio.ensure_writable(cfg.out_dir)  # before minutes of loading and quantizing
        need_tokens = build or cfg.needs_sensitivity or cfg.compensation != "none"  # the Hessians' key
        tokens = load_tokens(cfg.data_path, cfg.seq_len) if need_tokens else torch.empty(0, 0, dtype=torch.long)
        # a tensor-parallel rank reads only its shards, and --lazy reads one tensor at a time
        # (training/models.py load_models): the float model is never held whole
        base, teacher = load_models(cfg, dtype, sharded=(tp is not None or cfg.lazy) and build and cfg.method == "gates")
        if build:
            check_vocab(tokens, base, cfg.data_path)
        imx = load_imatrix(cfg)
        adapter, plans, budget = plan_run(cfg, base, imx)
        vectors = imatrix_vectors(imx, plans)
        tp_plan = None
        compensation = None
        if tp is not None:
            tp_plan = plan_tp(base, adapter, tp.world, plans)  # refuses a degree that cannot split, before work
        mixed = {}
        self.run = RunSetup(cfg, adapter, base, teacher, tokens, plans, budget, mixed, {}, device, dtype,
                            teacher_device=resolve_device(cfg.teacher_device) if cfg.teacher_device else device,
                            tp=tp, tp_plan=tp_plan)
        self.run.provenance = provenance.run_record(cfg, plans, base, getattr(imx, "sha256", None), budget)  # before any cast
        if build and cfg.method == "gates":  # under TP too: every rank trains on the same batches as one process
            self.run.tokens, self.run.held_tokens, self.run.confirm_tokens = hold_aside(
                tokens, cfg.search_sequences, cfg.search_confirm)
        if cfg.compensation != "none":  # also for a finalize: the assignment records what export redoes
            # the training split, also where a finalize holds nothing aside: the Hessians (and
            # their key, which a resume checks) are those the trained candidates were built with
            calib = hold_aside(tokens, cfg.search_sequences, cfg.search_confirm)[0] if cfg.method == "gates" else tokens
            comps, compensation = ensure_compensation(cfg, base, plans, calib,
                                                    weights_sha256=self.run.provenance["weights_sha256"],
                                                    progress=self.progress, device=device, tp=tp)
            vectors = QuantInputs(vectors, comps)
            self.run.compensated = frozenset(comps)
        self.run.provenance["compensation"] = compensation
        if cfg.needs_sensitivity:
            need_curv = build and ((self.measures and cfg.searches) or (cfg.relaxation_gap and cfg.method == "gates"))
            with _main_first(tp):  # rank 0 computes and saves the table; the others load it
                sens = ensure_table(cfg, sensitivity_model(cfg, base, tp), plans, vectors, self.run.tokens,
                                    progress=self.progress, need_curvature=need_curv, device=device,
                                    hashes=self.run.candidate_sha256)
            self.run.sensitivity, self.run.curvature = sens.table, sens.curvature
        if not (build and cfg.method == "gates") and not self.run.candidate_sha256:
            # no student is built (the knapsack alone, a finalize) and a stored table read no
            # candidate: the assignment still records each chosen candidate's sha256 for export
            read = candidate_sources(plans, reader_weights(base, plans), vectors, hashes=self.run.candidate_sha256)
            for p in plans:
                read(p)
        if build and cfg.method == "gates" and self.measures:
            # rank 0 quantizes the references' off-menu candidates into the cache and extends the
            # stored curvature to them; the others read both (every rank ranks moves alike)
            with _main_first(tp):
                plan_references_for(self.run, base, vectors, imx, progress=self.progress)
                if cfg.searches:
                    if not self.is_main:
                        _reload_curvature(self.run, sens)
                    complete_curvature(self.run, base, vectors, sens, save=self.is_main)
        if build and cfg.method == "gates":
            check_space(cfg, plans)
            init = methods.warm_start_logits(self.run) if cfg.warm_start else None
            with _main_first(tp):  # rank 0 fills the candidate cache; the others read it
                mixed.update(build_student(cfg, base, plans, budget, vectors, device, dtype, progress=self.progress,
                                           init_logits=init, tp=tp, tp_plan=tp_plan, hashes=self.run.candidate_sha256))
            if cfg.relaxation_gap and self.run.curvature:
                self.run.gap = RelaxationGap(mixed, self.run.curvature)
            if tp is not None:
                apply_tp(base, tp_plan, tp, gated=mixed)
                shard_teacher(teacher, tp_plan, tp)
                self.run.tp_sharded = {p.name for p in plans if plan_shard(tp_plan, p) is not None}
            else:
                shard_teacher(teacher, None, None)  # a --lazy skeleton: read whole, one tensor at a time
            teacher.to(self.run.teacher_device)
            if len(devices) > 1 or cfg.device_map:
                apply_device_map(base, devices)
                if not cfg.teacher_device:
                    apply_device_map(teacher, devices)
            if cfg.gradient_checkpointing and hasattr(base, "gradient_checkpointing_enable"):
                base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                base.train()  # HF only checkpoints in training mode; the models have no dropout left active
                _disable_dropout(base)
                if tp is not None:  # each rank keeps 1/world of every layer's input (tp_checkpoint.py)
                    install(base, tp)
        info = {"path": cfg.imatrix, "sha256": getattr(imx, "sha256", None), "covered": len(vectors)}
        self.run.imatrix_info = info
        return self.run

    @property
    def measures(self) -> bool:
        """Whether the bake is followed by the guarantee and the search on the held-aside split."""
        run = self.run
        return self.cfg.measures and run is not None and run.held_tokens is not None

    # -- training loop -----------------------------------------------------------------------
    def train(self) -> TrainResult:
        runner = methods.runner_for(self.cfg)  # a run that trains nothing here (methods.py)
        if runner is not None:
            _check_writable(self.cfg.out_dir)
            return runner(self)
        for exp in experimental.active(self.cfg):
            log.warning("experimental: %s (%s; measured no better than the default: %s)", exp.name, exp.what, exp.lab)
        run = self.run or self.prepare()
        cfg = run.cfg
        out_dir = cfg.out_dir
        _check_writable(out_dir)
        if self.is_main:
            fileio.remove_stale_temps(out_dir, (journal.JOURNAL_NAME, LOG_NAME, "assignment.json", "tensor-types.txt",
                                                cfg.output_name))  # left by a run killed mid-write
        gates = [m.gates for m in run.mixed.values()]
        opt = torch.optim.Adam(gates, lr=cfg.lr)
        torch.manual_seed(cfg.seed)
        start = 0
        jpath = out_dir / journal.JOURNAL_NAME
        names = set(run.mixed)
        jcomp = journal.compensation_of(run.provenance.get("compensation"))  # what the candidates were built with
        src = Path(cfg.resume_from_partial) if cfg.resume_from_partial else jpath
        if cfg.resume_from_partial and not src.exists():
            raise ConfigError(f"--resume_from_partial: no journal at {src}")
        if src.exists() and (cfg.resume or cfg.resume_from_partial):
            st = journal.load(src, expect_hash=cfg.result_hash(), expect_names=names, expect_compensation=jcomp)
            with torch.no_grad():
                for n, g in st.gates.items():
                    run.mixed[n].gates.copy_(g)
            opt.load_state_dict(st.optimizer)
            torch.set_rng_state(st.rng)
            start = st.step
            log.info("resuming from %s at step %d", src, start)
        if cfg.ptqr or cfg.st_gumbel_fraction > 0:
            skipped = routing.unroutable(run.student)
            if skipped:
                log.warning("routing keeps the soft mixture for %d layer(s) with their own forward: %s",
                            len(skipped), ", ".join(skipped[:4]))
        cfg.log_path.parent.mkdir(parents=True, exist_ok=True)
        history = _read_log(cfg.log_path, start)
        try:
            for step in range(start, cfg.max_steps):
                m = self._step(run, opt, step)
                faults.hit("step")  # tests: killed after the update, before the log and the journal
                history.append(m)
                if self.is_main:
                    _append_log(cfg.log_path, m, truncate=(step == start))
                if self.on_step:
                    self.on_step(m)
                done = step + 1
                if self.is_main and (done % cfg.partial_save_interval == 0 or done == cfg.max_steps):
                    journal.save(
                        jpath,
                        journal.JournalState(
                            done, {n: mq.gates for n, mq in run.mixed.items()}, opt.state_dict(),
                            torch.get_rng_state(), cfg.result_hash(), cfg.to_dict(), jcomp,
                        ),
                    )
        finally:
            run.mix_buffers.clear()  # one dense copy of every gated weight: not needed past training
        return self.finish(history, resumed_from=start)

    def _step(self, run: RunSetup, opt: torch.optim.Optimizer, step: int) -> StepMetrics:
        cfg = run.cfg
        t0 = time.perf_counter()
        tau = tau_at(step, cfg.max_steps, cfg.tau_start, cfg.tau_end)
        for mq in run.mixed.values():
            mq.tau = tau
        opt.zero_grad(set_to_none=True)
        router = routing.router_for(cfg, step)
        acc_n, ce, kl, n_tok = cfg.grad_accum_steps, 0.0, 0.0, 0
        for micro in range(acc_n):  # micro-batch j of step s is batch s·A + j of the seeded order
            pos = step * acc_n + micro
            ids = run.tokens[batch_indices(pos, cfg.batch_size, run.tokens.shape[0], cfg.seed)].to(run.device)
            ce_m, kl_m = micro_backward(run, ids, router, acc_n)
            ce, kl, n_tok = ce + float(ce_m.detach()) / acc_n, kl + float(kl_m.detach()) / acc_n, n_tok + ids.numel()
        if run.tp is not None:  # the shards' contributions to each gate gradient, summed
            sync_gate_grads([mq.gates for n, mq in run.mixed.items() if n in run.tp_sharded], run.tp)
        expected = gate_sum((mq.expected_bytes() for mq in run.mixed.values()), run.device)
        pen = size_penalty(expected, run.budget.train_target_bytes, cfg.size_tolerance, cfg.size_weight)
        gap = run.gap(run.device) if run.gap is not None else None  # after the TP sync: identical on every rank
        extra = pen if gap is None else pen + cfg.distill_weight * gap
        if extra.requires_grad:
            extra.backward()
        gap_v = 0.0 if gap is None else float(gap.detach())
        loss = ce + cfg.distill_weight * (kl + gap_v) + float(pen.detach())
        opt.step()
        with torch.no_grad():
            ent = torch.stack([mq.entropy().cpu() for mq in run.mixed.values()]).mean()
        dt = time.perf_counter() - t0
        return StepMetrics(
            step=step + 1, loss=float(loss), ce=float(ce), kl=float(kl), size_penalty=float(pen.detach()),
            expected_bytes=float(expected.detach()), target_bytes=run.budget.train_target_bytes, tau=tau,
            gate_entropy=float(ent), tokens_per_s=n_tok / dt, memory_bytes=methods.peak_memory_bytes(run.device),
            relaxation_gap=gap_v,
        )

    # -- bake and outputs --------------------------------------------------------------------
    def finish(self, history: list[StepMetrics], *, resumed_from: int = 0,
               probs: dict[str, torch.Tensor] | None = None, gates: dict[str, torch.Tensor] | None = None,
               bake_with: tuple[dict, dict[str, int] | None] | None = None) -> TrainResult:
        """Bake and write the outputs; `probs`/`gates` stand in for the live gates when a run
        trained nothing here (``--method sensitivity``, ``--finalize_from_partial``); `bake_with`
        (scores, start) replaces the gates as what the bake ranks by (``--method sensitivity``)."""
        run = self.run
        assert run is not None
        cfg = run.cfg
        trained = probs is None  # the live gates of this process (not a journal's or a knapsack's)
        if probs is None:
            # Bake at the last step's τ, also when a resumed run had no step left to set it.
            tau = tau_at(cfg.max_steps - 1, cfg.max_steps, cfg.tau_start, cfg.tau_end)
            with torch.no_grad():
                for mq in run.mixed.values():
                    mq.tau = tau
                probs = {n: mq.probs().detach().cpu() for n, mq in run.mixed.items()}
            gates = {n: mq.gates.detach().cpu().clone() for n, mq in run.mixed.items()}
        # Repair and fill rank by the gate logits (temperature-free), not by probabilities at τ_end;
        # --method sensitivity ranks by its table from the knapsack's layout (methods.py).
        if bake_with is None:
            bake_with = (gates, None)
        res = bake(run.plans, bake_with[0], run.budget, cfg.upgrades, start=bake_with[1])
        choices = [("gates", dict(res.choice))]
        polished = None
        if cfg.polish:
            polished = polish_baked(run.plans, run.sensitivity, res, run.budget, cfg.upgrades)
            choices.append(("gates+polish", dict(polished.choice)))
        if run.tp is not None:
            check_same_choice(res.choice, run.tp)
        by = {p.name: p for p in run.plans}
        types = {n: by[n].menu.types[k] for n, k in res.choice.items()}
        sizes = {n: by[n].sizes[k] for n, k in res.choice.items()}
        outcome = None
        if self.measures and trained:
            outcome = improve(run, choices, on_eval=self.on_search)
            types, sizes = outcome.types, outcome.sizes
            if run.tp is not None:  # every rank measured the same values: the same winner, checked
                check_same_choice(dict(types), run.tp)  # types: an off-menu reference may have won
        faults.hit("bake")
        tensors = tensor_choices(run, types, sizes, probs)
        final = history[-1].to_dict() if history else {}
        asg = Assignment(
            tensors=tensors, model=str(cfg.model), target_bytes=run.budget.target_bytes,
            **run.provenance,  # imatrix + sha256, base weights hash, libggml, menus (provenance.py)
            meta={
                "q8_0_bytes": run.budget.q8_bytes, "min_bytes": run.budget.min_bytes, "max_bytes": run.budget.max_bytes,
                "train_target_bytes": run.budget.train_target_bytes, "tolerance": run.budget.tolerance,
                "compression_ratio": cfg.compression_ratio, "target_bits": cfg.target_bits,
                "upgraded": res.upgraded, "repaired": res.repaired, "filled": res.filled, "final_step": final,
                "method": cfg.method, "polish_moves": polished.moves if polished else 0,
                "polish_gain": polished.gain if polished else 0.0,
            },
        )
        asg.meta["pinned"] = len(res.pinned)
        if cfg.target_size is not None:  # the whole file's bytes asked for (training/target_size.py)
            asg.meta["target_size"] = parse_size(cfg.target_size)
        if outcome is not None:
            asg.meta["guarantee"] = outcome.report()
        out = cfg.out_dir
        if not self.is_main:  # rank 0 writes; the others return the same (checked) result
            return TrainResult(asg, res, out / cfg.output_name, out / "assignment.json", out / "tensor-types.txt",
                               history, resumed_from)
        asg_path = asg.save(out / "assignment.json")
        tt_path = asg.save_tensor_types(out / "tensor-types.txt") if all(t.gguf_name for t in tensors.values()) else out / "tensor-types.txt"
        pt_path = fileio.torch_save(
            out / cfg.output_name,
            {
                "assignment_json": json.dumps(asg.to_dict()),
                "gates": gates,
                "config_json": json.dumps(cfg.to_dict()),
                "model": str(cfg.model),
                "metrics_json": json.dumps({"final": final, "baked_bytes": res.total_bytes, "target_bytes": run.budget.target_bytes}),
            },
        )
        return TrainResult(asg, res, pt_path, asg_path, tt_path, history, resumed_from)


def mixes_per_layer(run: RunSetup, router) -> bool:
    """Whether a step mixes each gated weight when its layer runs (and again when the checkpoint
    recomputes the layer in backward) instead of once per step in ``layers.cached()``.

    Under ``--gradient_checkpointing`` the step-long cache would hold every layer's mixture at
    once (the rank's whole model in the training dtype: 13.45 GB at 27B / TP-4), while the
    checkpointed layers need only their own; without the cache a layer's mixture is an ordinary
    intermediate, dropped by the checkpoint after the layer's forward and recomputed with it, so
    one layer's mixed weights live at a time. The gate gradients are the same (the recompute
    gives the same mixture; tests/test_mix_per_layer.py). A routed step keeps the cache (routing
    swaps the layers and draws per use)."""
    return bool(run.cfg.gradient_checkpointing and router is None
                and hasattr(run.student, "gradient_checkpointing_enable"))  # as prepare() enables it


def micro_backward(run: RunSetup, ids: torch.Tensor, router, acc_n: int, *, per_layer: bool | None = None):
    """(CE, KL) of one micro-batch, with its share of the loss backpropagated into the gates.
    `per_layer` (default: :func:`mixes_per_layer`) mixes each layer's weights when it runs instead
    of once per step."""
    cfg = run.cfg
    if per_layer is None:
        per_layer = mixes_per_layer(run, router)
    # Mixtures written into tensors kept across steps (layers.MixBuffers) where each is mixed once
    # per micro-batch and dead before the next: not per layer (the recompute mixes again while the
    # forward's mixture may still be held), not routed (routes swap the layers per use).
    buffers = run.mix_buffers if router is None else None
    with routing.routed(run.student, router):  # backward inside: checkpoint recomputes route too
        with contextlib.nullcontext() if per_layer else layers.cached(buffers):
            if run.tp is not None:
                ce_m, kl_m = tp_distill_terms(run.student, run.teacher, ids, run.tp,
                                              chunk_tokens=cfg.loss_chunk_size, teacher_device=run.teacher_device)
            else:
                ce_m, kl_m = distill_terms(run.student, run.teacher, ids, chunk_tokens=cfg.loss_chunk_size,
                                           teacher_device=run.teacher_device, router=router)
        ((ce_m + cfg.distill_weight * kl_m) / acc_n).backward()  # outside the cache, as it always was
    return ce_m, kl_m


def _devices(cfg: TrainConfig, tp) -> list[torch.device]:
    """The devices of this process: ``--device_map``'s list, or one device (a TP rank's own)."""
    if cfg.device_map:
        return [resolve_device(d) for d in parse_device_map(cfg.device_map)]
    spec = cfg.device
    if tp is not None and spec.startswith("cuda"):
        import os

        # Under torchrun --device names the kind (the recipe says cuda:0): each rank takes its own GPU.
        spec = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return [resolve_device(spec)]


def _reload_curvature(run, sens) -> None:
    """A tensor-parallel rank after rank 0: the curvature rank 0 stored, off-menu rungs included."""
    stored = load_stored(sens.path, sens.key) if sens.path is not None and sens.key is not None else None
    if stored is not None and stored[1] is not None:
        sens.curvature = run.curvature = stored[1]


class _main_first:
    """``with _main_first(tp):`` rank 0 runs the body first (filling a file or cache the others
    then read); without tensor parallelism it is a no-op."""

    def __init__(self, tp):
        self.tp = tp

    def __enter__(self):
        if self.tp is not None and not self.tp.is_main:
            self.tp.barrier()

    def __exit__(self, *exc):
        if self.tp is not None and self.tp.is_main and exc[0] is None:
            self.tp.barrier()
        return False


def _disable_dropout(model) -> None:
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0


def _check_writable(out_dir: Path) -> None:
    fileio.ensure_writable(out_dir)


def check_vocab(tokens: torch.Tensor, model, path: Path) -> None:
    """Token ids the model's embedding cannot look up mean the data was tokenized for another
    model: say so instead of an IndexError deep inside the first forward pass."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(emb, "num_embeddings", None)
    if rows is None or tokens.numel() == 0:
        return
    top = int(tokens.max())
    if top >= rows or int(tokens.min()) < 0:
        raise ConfigError(
            f"tokens file {path} holds token id {top}, but the model's vocabulary has {rows} entries: "
            "the data was tokenized for another model; rerun `voodoo data` with this model's tokenizer"
        )


def check_space(cfg: TrainConfig, plans) -> None:
    """Fail now, not hours later, if the candidate cache or the outputs cannot fit on disk."""
    cache_need = sum(sum(p.sizes) for p in plans)  # every candidate (cached ones counted too)
    n_gates = sum(len(p.sizes) for p in plans)
    out_need = (1 << 20) + 64 * n_gates  # journal (gates + Adam moments) + result .pt + JSON
    fileio.ensure_free_space(default_root(), cache_need, what="the candidate cache")
    fileio.ensure_free_space(cfg.out_dir, out_need, what="the journal and the outputs")
