"""Bake: from trained gates to an assignment that is on budget.

1. argmax of each tensor's gates;
2. ``--tensor_upgrades``: matching tensors move ±n rungs along their own menu (clamped) and are
   *pinned* there: nothing below (nor polish, nor the search) moves them again;
3. repair, if the result is over ``target × (1 + tolerance)``: repeatedly move one unpinned tensor
   one rung down, choosing the move that gives up the least gate score per byte saved,
   ``(score_now − score_below) / bytes_saved`` (ties broken by name), until the size is within budget;
4. fill, if the result is under ``target × (1 − tolerance)`` (an argmax taken before the gates
   have converged can land far below the budget it was trained for): the mirror image, one
   rung up at a time, cheapest score cost per byte added first, never past the upper bound.

The score of a rung is what the run learned about it and must still carry information at the end
of training: the gate *logits* (temperature-free, i.e. log-probabilities at τ = 1 up to a
constant), not the probabilities at τ_end, where every argmax has p ≈ 1 and every cost would be
≈ 1/bytes (the largest tensors would move first whatever the gates said). ``--method sensitivity``
passes −s, its sensitivity table, as the scores and the knapsack's layout as the start (the
argmax of −s would be every tensor's richest rung), so its repair and fill cost what the table
says a rung is worth.

:func:`bake_and_polish` is the bake every run writes: this, then the knapsack polish
(``--polish``); the guarantee measures the one-shot knapsack through it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from ..core.errors import ConfigError
from ..selection.budget import Budget
from ..selection.menus import Upgrade, apply_upgrades, is_pinned
from .knapsack import polish


@dataclass
class BakeResult:
    choice: dict[str, int]  # tensor -> menu index
    argmax: dict[str, int]
    upgraded: int  # tensors moved by --tensor_upgrades
    repaired: int  # one-rung moves down (over budget)
    total_bytes: int
    filled: int = 0  # one-rung moves up (under budget)
    pinned: tuple[str, ...] = ()  # tensors matched by --tensor_upgrades (never moved after step 2)


def _as_list(v) -> list[float]:
    return [float(x) for x in (v.tolist() if isinstance(v, torch.Tensor) else v)]


def bake(
    plans: Sequence,  # TensorPlan: .name .menu.types .sizes
    scores: Mapping[str, Sequence[float] | torch.Tensor],
    budget: Budget,
    upgrades: Sequence[Upgrade] = (),
    start: Mapping[str, int] | None = None,
) -> BakeResult:
    """`scores[t][k]`: how much the run prefers rung k of tensor t (higher is better): the gate
    logits of a training run. The starting choice is `start` (tensor -> rung) when given, else the
    argmax of the scores."""
    by_name = {p.name: p for p in plans}
    sc = {n: _as_list(scores[n]) for n in by_name}
    if start is not None:
        arg = {n: int(start[n]) for n in by_name}
    else:
        arg = {n: max(range(len(v)), key=lambda k, v=v: (v[k], -k)) for n, v in sc.items()}
    pinned = {n for n in by_name if is_pinned(n, upgrades)}
    choice = {}
    upgraded = 0
    for n, p in by_name.items():
        choice[n] = apply_upgrades(n, p.menu.types, arg[n], upgrades)
        upgraded += choice[n] != arg[n]
    total = sum(by_name[n].sizes[k] for n, k in choice.items())
    repaired = 0
    while total > budget.upper_bytes:
        best = None
        for n, k in choice.items():
            if k == 0 or n in pinned:
                continue
            p = by_name[n]
            saved = p.sizes[k] - p.sizes[k - 1]
            if saved <= 0:
                continue
            key = ((sc[n][k] - sc[n][k - 1]) / saved, n)
            if best is None or key < best[0]:
                best = (key, n, saved)
        if best is None:
            what = f" ({len(pinned)} tensor(s) pinned by --tensor_upgrades)" if pinned else ""
            raise ConfigError(
                f"cannot bring the assignment within budget: {total:,} bytes > {budget.upper_bytes:,} with every "
                f"unpinned tensor on its cheapest rung{what}"
            )
        _, n, saved = best
        choice[n] -= 1
        total -= saved
        repaired += 1
    filled = 0
    lower = budget.target_bytes * (1.0 - budget.tolerance)
    while total < lower:
        best = None
        for n, k in choice.items():
            p = by_name[n]
            if n in pinned or k + 1 >= len(p.sizes):
                continue
            added = p.sizes[k + 1] - p.sizes[k]
            if added <= 0 or total + added > budget.upper_bytes:
                continue
            key = ((sc[n][k] - sc[n][k + 1]) / added, n)
            if best is None or key < best[0]:
                best = (key, n, added)
        if best is None:
            break  # nothing fits under the upper bound: stay below, reported by the caller
        _, n, added = best
        choice[n] += 1
        total += added
        filled += 1
    return BakeResult(choice, arg, upgraded, repaired, total, filled, tuple(sorted(pinned)))



def polish_baked(plans: Sequence, table: Mapping[str, Sequence[float]], res: BakeResult, budget: Budget,
                 upgrades: Sequence[Upgrade] = ()):
    """``knapsack.polish`` of a bake inside the dead zone: `res` takes the polished choice and
    bytes; returns the polish's result."""
    pol = polish(plans, table, res.choice, lower=budget.target_bytes * (1 - budget.tolerance),
                 upper=budget.upper_bytes, upgrades=upgrades)
    res.choice, res.total_bytes = pol.choice, pol.total_bytes
    return pol


def bake_and_polish(plans: Sequence, scores: Mapping[str, Sequence[float] | torch.Tensor], budget: Budget,
                    upgrades: Sequence[Upgrade] = (), *, table: Mapping[str, Sequence[float]] | None = None,
                    start: Mapping[str, int] | None = None):
    """:func:`bake`, then :func:`polish_baked` when `table` (the sensitivity table) is given.
    Returns (the bake's result, polished when polished; the polish's result or None)."""
    res = bake(plans, scores, budget, upgrades, start=start)
    return res, (polish_baked(plans, table, res, budget, upgrades) if table is not None else None)
