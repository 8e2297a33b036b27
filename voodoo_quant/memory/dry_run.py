"""The dry run of ``voodoo train --dry_run``: a run planned from the model's config alone (a skeleton
on ``meta``): its menus, budget and tensor-parallel split, the memory plan of :mod:`.plan` (with the
flag changes that would make it fit) and, on request, the stages' time of :mod:`.time_plan`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..arch import adapter_for
from ..core import envs
from ..core.errors import ConfigError
from ..core.units import GB
from ..distributed.parallel import plan_tp
from ..gguf import imatrix as im
from ..model.lazyload import text_skeleton
from ..student.build import converter_layouts, fixed_tensors, plan_model, selectable_weights
from ..training.target_size import run_budget
from .plan import MemoryPlan, plan_memory
from .time_plan import time_plan_for


@dataclass
class DryRun:
    """What ``voodoo train --dry_run`` prints: the menus and budget, and the memory plan."""

    cfg: Any
    plans: list
    budget: Any
    memory: MemoryPlan
    notes: list[str] = field(default_factory=list)
    time: Any = None  # time_plan.TimePlan, with `timing` (probed on this machine)
    replan: Callable[[dict], MemoryPlan] | None = None  # the memory plan of the run with these flag changes


def device_capacity(cfg) -> float | None:
    """Bytes of one device for the fit check: VOODOO_DEVICE_MEMORY_GB, else the visible GPU's,
    else 32 GB for ``--device cuda`` (the reference recipe's cards), else the host's RAM."""
    import os

    gb = envs.device_memory_gb()
    if gb is not None:
        return gb * GB
    if str(cfg.device).startswith("cuda"):
        if torch.cuda.is_available():
            return float(torch.cuda.get_device_properties(0).total_memory)
        return 32 * GB
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def dry_run(cfg, world: int | None = None, *, timing: bool = False) -> DryRun:
    """Plan a run from the model's config alone (a skeleton on ``meta``: no weight, no tokens
    file, no process group): menus, budget, the tensor-parallel split and the memory plan; with
    `timing`, the stages' wall time on this machine (a probe of seconds: memory/time_plan.py). The
    budget is the trainer's (``training/target_size.run_budget``); ``--target_size`` needs the
    weights' headers, to count the tensors the file holds beside the selectable ones."""

    world = world or cfg.tensor_parallel
    notes = []
    model = text_skeleton(cfg.model, cfg.text_model_class)
    adapter = adapter_for(model.config)
    has_weights = any(Path(cfg.model).glob("*.safetensors"))
    layout_for = converter_layouts(cfg.model) if has_weights else None
    if not has_weights:
        notes.append(f"{cfg.model} holds no weights: GGUF rows are taken as the HF rows (sizes may differ slightly)")
    names = imx = None
    if cfg.imatrix and Path(cfg.imatrix).is_file():
        imx = im.load(cfg.imatrix)
        names = set(imx.entries)
    elif cfg.imatrix:
        names = {adapter.gguf_name(n) for n in selectable_weights(model)}
        names |= {lay.gguf_name for n, (w, _) in selectable_weights(model).items()
                  if layout_for and (lay := layout_for(n, tuple(w.shape))) is not None}
        notes.append(f"--imatrix {cfg.imatrix} does not exist yet: planned as if it covered every tensor")
    plans = plan_model(model, adapter, cfg.menus, imatrix_names=names, layout_for=layout_for)
    covered = set(names or ())
    if cfg.target_size is not None and not has_weights:
        raise ConfigError(f"--target_size needs {cfg.model}'s weights (their headers: which tensors the file holds "
                          f"beside the selectable ones); plan from config.json alone with --compression_ratio "
                          f"or --target_bits")
    budget = run_budget(cfg, plans, fixed_tensors(plans, layout_for))  # as the trainer's (training/setup.py)
    capacity = device_capacity(cfg)

    def plan_for(c, w: int, replan=None) -> MemoryPlan:
        tp_plan = plan_tp(model, adapter, w, plans) if w > 1 else None
        return plan_memory(c, model, plans, adapter=adapter, tp_plan=tp_plan, world=w, capacity=capacity,
                           replan=replan, covered=covered, budget=budget)  # no replan changes the budget

    def replan(change: dict) -> MemoryPlan:
        change = dict(change)
        w = change.pop("__world", world)
        return plan_for(dataclasses.replace(cfg, **change), w)

    mem = plan_for(cfg, world, replan)
    run = DryRun(cfg, plans, budget, mem, notes, replan=replan)
    if timing:
        run.time, why = time_plan_for(cfg, model, plans, budget, covered, imx)
        notes += [f"no time prediction: {why}"] if why else []
    return run
