"""A run's memory, checked before it loads anything (``--memory_check``).

A real ``voodoo train`` (hence ``voodoo quantize``, each size, and the Python API) plans its memory
as ``voodoo train --dry_run`` does (:func:`voodoo_quant.memory.dry_run.dry_run`: a skeleton on
``meta`` from the model's config, no weight read, no timing probe) before the Hessians, the
candidates or the training start, instead of finding out at the first step. When the plan does
not fit the device:

- ``auto`` turns on the settings that keep the result, if they make it fit. ``--lazy``: the same
  candidate bytes, compensation included (its gate gradients are summed in another float order than
  the eager CPU kernel's, which shows in a step's KL at the 7th digit: the settings count it, as the
  device, among those that change a result only that far, ``changes=OUTPUT``).
  ``--gradient_checkpointing`` only where it gives the same gates bit for bit: one CPU process, no
  routed steps, no gated weight shared by two modules (a tied embedding / LM head would sum its two
  gradients in another order, tests/test_mix_per_layer.py). The changed config is the one the run
  uses and records (the journal and the result's ``config_json``; neither setting is in the
  journal's hash, so a resume is not refused). It logs one line: what the plan needed, what it
  turns on, what that needs.
- When they do not make it fit, :class:`~voodoo_quant.core.errors.MemoryFitError` names the need,
  the device's size and the plan's advice (flags that change the result, such as a shorter
  ``--seq_len``, are advised, never applied).
- ``warn`` only logs that it does not fit; ``off`` plans nothing.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any

from ..core.errors import EnvironmentVarError, MemoryFitError
from ..core.units import GB
from ..memory.dry_run import dry_run
from ..memory.plan import MemoryPlan
from ..training.config import TrainConfig
from ..training.setup import tiny

log = logging.getLogger(__name__)

HEADROOM = 0.9  # MemoryPlan.fits(): allocator and context overhead


@dataclass
class MemoryCheck:
    """What the check decided: `cfg` is the config the run goes on with."""

    cfg: TrainConfig
    applied: dict[str, Any] = field(default_factory=dict)  # the settings auto turned on
    need: float | None = None  # the plan's device peak per rank, as given (bytes)
    applied_need: float | None = None  # with `applied`
    capacity: float | None = None  # bytes of one device
    message: str | None = None  # the line logged, if any


def checkpointing_changes_result(cfg: TrainConfig, plans, world: int) -> str | None:
    """Why ``--gradient_checkpointing`` might change this run's result (None: it gives the same
    gate gradients bit for bit, so the check may turn it on). Checked on the CPU in one process:
    each layer's mixture is the cached one, recomputed (tests/test_memory_check.py)."""
    if world > 1:
        return "under tensor parallelism it is not checked to keep the result"
    if cfg.device != "cpu" or cfg.device_map or (cfg.teacher_device and cfg.teacher_device != "cpu"):
        return f"on {cfg.device} it is not checked to keep the result"
    if cfg.ptqr or cfg.st_gumbel_fraction > 0:
        return "routed steps draw again in the recompute"
    shared = next((p.name for p in plans if len(p.modules) > 1), None)
    if shared is not None:
        return f"{shared} is gated on several modules (tied) and its gradients would be summed in another order"
    return None


def _neutral(cfg: TrainConfig, plans, world: int) -> tuple[list[tuple[str, dict]], str | None]:
    """The result-keeping changes this run does not have yet, and why checkpointing is not among them."""
    out = []
    if not cfg.lazy:
        out.append(("--lazy", {"lazy": True}))
    why = None
    if not cfg.gradient_checkpointing:
        why = checkpointing_changes_result(cfg, plans, world)
        if why is None:
            out.append(("--gradient_checkpointing", {"gradient_checkpointing": True}))
    return out, why


def gb_text(b: float) -> str:
    """Bytes as the check says them: GB, or MB under 0.1 GB (a tiny model's plan)."""
    return f"{b / GB:.2f} GB" if b >= 0.1 * GB else f"{b / 1e6:.2f} MB"


def check_memory(cfg: TrainConfig, world: int | None = None, *, announce: bool = True) -> MemoryCheck:
    """Plan `cfg`'s memory and act on it as ``cfg.memory_check`` says (module docstring). Returns
    the config the run goes on with; raises MemoryFitError when nothing that keeps the result fits.
    `announce`: log the decision (a tensor-parallel rank > 0 decides alike and says nothing)."""
    say = log.warning if announce else log.debug
    if cfg.memory_check == "off" or cfg.dry_run:
        return MemoryCheck(cfg)
    world = world or cfg.tensor_parallel
    planned = tiny(dataclasses.replace(cfg))  # as the trainer will run it (VOODOO_TINY_RECIPE)
    try:
        run = dry_run(planned, world)
    except EnvironmentVarError:  # a VOODOO_DEVICE_MEMORY_GB we cannot read: the user's to fix
        raise
    except Exception as e:  # noqa: BLE001 — a plan that cannot be made (a GGUF source, ...) must not stop a run
        say("memory check skipped: the run's memory cannot be planned (%s: %s)", type(e).__name__,
            str(e).splitlines()[0] if str(e) else "")
        return MemoryCheck(cfg)
    mem = run.memory
    out = MemoryCheck(cfg, need=mem.device_total, capacity=mem.capacity)
    if mem.capacity is None or mem.fits(HEADROOM):
        return out
    limit = HEADROOM * mem.capacity
    need = (f"memory plan: this run needs {gb_text(mem.device_total)} per {'rank' if world > 1 else 'device'}, "
            f"over the {gb_text(limit)} that fit ({HEADROOM:.0%} of {gb_text(mem.capacity)}; VOODOO_DEVICE_MEMORY_GB sets it)")
    advice = "; ".join(mem.advice) if mem.advice else "no flag change the plan knows fits"
    if cfg.memory_check == "warn":
        out.message = f"{need}; running as given (--memory_check warn); change: {advice}"
        say(out.message)
        return out
    options, why_not_ckpt = _neutral(cfg, run.plans, world)
    best: tuple[float, list[str], dict, MemoryPlan] | None = None
    tried = []
    for n in range(1, len(options) + 1):  # the fewest changes first, then the smallest need
        for combo in combinations(options, n):
            change = {k: v for _, c in combo for k, v in c.items()}
            plan = run.replan(change)
            flags = [f for f, _ in combo]
            tried.append((flags, plan.device_total))
            if plan.fits(HEADROOM) and (best is None or plan.device_total < best[0]):
                best = (plan.device_total, flags, change, plan)
        if best is not None:
            break
    if best is None:
        kept = (" with " + ", ".join(f"{' '.join(f)}: {gb_text(t)}" for f, t in tried) if tried
                else " (the settings that keep the result are already on)")
        why = f"; --gradient_checkpointing is not turned on for you: {why_not_ckpt}" if why_not_ckpt else ""
        raise MemoryFitError(f"{need}; the settings that keep the result do not make it fit{kept}{why}; "
                             f"change: {advice}; or pass --memory_check off to run anyway")
    total, flags, change, _ = best
    out.cfg = dataclasses.replace(cfg, **change)
    out.applied, out.applied_need = change, total
    out.message = (f"{need}; turning on {' '.join(flags)} (--memory_check auto; no setting of the result "
                   f"changes): {gb_text(total)}, fits")
    say(out.message)
    return out
