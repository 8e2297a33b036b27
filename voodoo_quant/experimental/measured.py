"""Measured sensitivity: every candidate's ΔKL, measured rather than predicted.

The Fisher table (``fisher.py``) predicts a candidate's ΔKL from a second-order expansion with a
per-position, diagonal Fisher. It drops the terms that couple positions (a value or output
projection's error reaches every later token through attention) and the ones that couple weights,
so it can misprice whole classes of tensors. ``--sensitivity_kind measured`` measures instead:
for each tensor and each rung of its menu, that one tensor serves the rung's exact dequantized
weights, every other tensor keeps its float weights, and the table's entry is the mean
KL(float model ‖ that model) over the calibration sequences.

Cost: one forward per (tensor, rung), shortened by ``HeldAside``'s replay of the float model's
layer outputs (a tensor of layer L recomputes layers L.. and the head). The float model is its own
teacher, and every weight is put back bit for bit after its rungs are measured. It needs the
model loaded in one process; a skeleton (``--lazy``, tensor parallelism) is refused.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch
import torch.nn as nn

from ..core.errors import ConfigError
from ..training.objective import HeldAside, layer_of


def _params(modules: Mapping[str, nn.Module], plan) -> list[torch.Tensor]:
    """The distinct weight tensors a plan's modules use (a tied embedding / LM head: one)."""
    out, seen = [], set()
    for m in plan.modules:
        w = modules[m].weight
        if id(w) not in seen:
            seen.add(id(w))
            out.append(w)
    return out


def _first_layer(plan) -> int:
    layers = [layer_of(m + ".weight") for m in plan.modules]
    return 0 if any(v is None for v in layers) else min(layers)


def measured_table(model: nn.Module, plans: Sequence, blobs_for: Callable, tokens: torch.Tensor, *,
                   device: torch.device | None = None, progress: bool = False) -> dict[str, list[float]]:
    """tensor -> [measured ΔKL per menu rung] on `tokens` ([n, seq]). `blobs_for(plan)` gives
    the rung bytes in menu order (the candidate cache's). The pass runs on `device` (default:
    where the model is); a model elsewhere is moved there for it and moved back after."""
    if getattr(model, "voodoo_reader", None) is not None:
        raise ConfigError("--sensitivity_kind measured needs the model loaded in one process "
                          "(not --lazy or --tensor_parallel); use --sensitivity_kind fisher")
    home = next(model.parameters()).device
    dev = torch.device(device) if device is not None else home
    modules = dict(model.named_modules())
    table: dict[str, list[float]] = {}
    bar = _Bar(len(plans), progress)
    try:
        model.to(dev)
        with torch.no_grad():
            held = HeldAside(model, model, tokens, device=dev)
            held.measure()
            held.commit()  # the float model's layer outputs: later measurements replay their prefix
            for p in plans:
                params = _params(modules, p)
                keep = [w.detach().clone() for w in params]
                row = []
                try:
                    for t, blob in zip(p.menu.types, blobs_for(p)):
                        wq = p.dequantize(blob, t).reshape(params[0].shape)
                        for w in params:
                            w.copy_(wq.to(device=w.device, dtype=w.dtype))
                        row.append(held.measure(from_layer=_first_layer(p)).kl)
                finally:
                    for w, k in zip(params, keep):
                        w.copy_(k)
                table[p.name] = row
                bar.advance()
    finally:
        bar.close()
        model.to(home)
    return table


class _Bar:
    """A rich progress bar over the tensors (nothing when `on` is false)."""

    def __init__(self, total: int, on: bool):
        self.p = None
        if on:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.p = Progress(TextColumn("measured sensitivity"), BarColumn(), MofNCompleteColumn(),
                              TimeRemainingColumn(), transient=True)
            self.p.start()
            self.task = self.p.add_task("tensors", total=total)

    def advance(self) -> None:
        if self.p is not None:
            self.p.advance(self.task)

    def close(self) -> None:
        if self.p is not None:
            self.p.stop()
