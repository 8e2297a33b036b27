"""Runs that are not a plain gate training: the sensitivity knapsack alone, a bake redone from a
journal, and the pieces of a warm start. Each ends in ``Trainer.finish`` so the outputs
(assignment.json, tensor-types.txt, the result .pt) are the same as a training run's."""

from __future__ import annotations

import logging
import resource
from pathlib import Path

import torch

from ..core.errors import ConfigError
from . import journal
from .bake import bake_and_polish
from .knapsack import greedy_layout
from .schedule import tau_at
from .sensitivity import warm_logits

log = logging.getLogger(__name__)


def knapsack_layout(run) -> dict[str, int]:
    """The greedy knapsack's layout at the training target (``--budget_reduction`` applies)."""
    if run.sensitivity is None:
        raise ConfigError("internal: the sensitivity table was not computed for this run")
    return greedy_layout(run.plans, run.sensitivity, run.budget.train_target_bytes)


def warm_start_logits(run) -> dict[str, torch.Tensor]:
    return warm_logits(run.plans, knapsack_layout(run), run.cfg.tau_start, run.cfg.warm_start_mass)


def one_hot_probs(plans, layout: dict[str, int]) -> dict[str, torch.Tensor]:
    out = {}
    for p in plans:
        v = torch.zeros(len(p.menu.types))
        v[layout[p.name]] = 1.0
        out[p.name] = v
    return out


def sensitivity_scores(run) -> dict[str, list[float]]:
    """What ``--method sensitivity``'s bake ranks by: −s (higher is better), from the knapsack's layout."""
    return {p.name: [-float(x) for x in run.sensitivity[p.name]] for p in run.plans}


def sensitivity_choice(run) -> dict[str, int]:
    """tensor -> menu index that ``--method sensitivity`` writes: the knapsack's layout at the
    training target, baked (upgrades pinned, repair and fill by the table) and polished as
    ``--polish`` says. The guarantee measures it as the one-shot knapsack (references.py)."""
    layout = knapsack_layout(run)
    res, _ = bake_and_polish(run.plans, sensitivity_scores(run), run.budget, run.cfg.upgrades,
                             table=run.sensitivity if run.cfg.polish else None, start=layout)
    return res.choice


def sensitivity_method(trainer):
    """``--method sensitivity``: the knapsack's layout, baked like trained gates (no training)."""
    run = trainer.run or trainer.prepare(build=False)
    layout = knapsack_layout(run)
    probs = one_hot_probs(run.plans, layout)
    gates = warm_logits(run.plans, layout, 1.0, run.cfg.warm_start_mass)  # saved as the result's gates
    return trainer.finish([], probs=probs, gates=gates, bake_with=(sensitivity_scores(run), layout))


def finalize_from_partial(trainer, path: str):
    """``--finalize_from_partial``: bake the journal's gates at the temperature of its last step."""
    run = trainer.run or trainer.prepare(build=False)
    cfg = run.cfg
    jpath = Path(path)
    if not jpath.exists():
        raise ConfigError(f"--finalize_from_partial: no journal at {jpath}")
    st = journal.load(jpath, expect_hash=cfg.result_hash(), expect_names={p.name for p in run.plans},
                      expect_compensation=journal.compensation_of(run.provenance.get("compensation")))
    tau = tau_at(max(0, st.step - 1), cfg.max_steps, cfg.tau_start, cfg.tau_end)
    gates = {n: g.detach().float().cpu() for n, g in st.gates.items()}
    probs = {n: torch.softmax(g / tau, dim=0) for n, g in gates.items()}
    history = journal.read_log(cfg.log_path, st.step)
    return trainer.finish(history, resumed_from=st.step, probs=probs, gates=gates)


# What writes the assignment, by --method and the journal flags: a run that trains nothing here.
# ``None`` (the default, ``--method gates``) is the gate training of Trainer.train.
RUNNERS = {"sensitivity": sensitivity_method}


def runner_for(cfg):
    """The function ``(trainer) -> TrainResult`` that does `cfg`'s run instead of training the
    gates, or None to train them: ``--method sensitivity``, ``--finalize_from_partial``."""
    if cfg.method in RUNNERS:
        return RUNNERS[cfg.method]
    if cfg.finalize_from_partial:
        return lambda trainer: finalize_from_partial(trainer, cfg.finalize_from_partial)
    return None


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated device memory (CUDA/ROCm), else the process's peak RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB
