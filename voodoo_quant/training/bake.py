"""Bake: from trained gates to an assignment that is on budget.

1. argmax of each tensor's gates;
2. ``--tensor_upgrades``: matching tensors move ±n rungs along their own menu (clamped);
3. repair, if the result is over ``target × (1 + tolerance)``: repeatedly move one tensor one
   rung down, choosing the move that gives up the least gate probability per byte saved
   (``(p_now − p_below) / bytes_saved``, ties broken by name) until the size is within budget;
4. fill, if the result is under ``target × (1 − tolerance)`` (an argmax taken before the gates
   have converged can land far below the budget it was trained for): the mirror image, one
   rung up at a time, cheapest probability cost per byte added first, never past the upper
   bound.
Both are deterministic and touch first the tensors whose gates cared least.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from ..budget import Budget
from ..errors import ConfigError
from ..menus import Upgrade, apply_upgrades


@dataclass
class BakeResult:
    choice: dict[str, int]  # tensor -> menu index
    argmax: dict[str, int]
    upgraded: int  # tensors moved by --tensor_upgrades
    repaired: int  # one-rung moves down (over budget)
    total_bytes: int
    filled: int = 0  # one-rung moves up (under budget)


def bake(
    plans: Sequence,  # TensorPlan: .name .menu.types .sizes
    probs: Mapping[str, torch.Tensor],
    budget: Budget,
    upgrades: Sequence[Upgrade] = (),
) -> BakeResult:
    by_name = {p.name: p for p in plans}
    arg = {n: int(torch.argmax(probs[n]).item()) for n in by_name}
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
            if k == 0:
                continue
            p = by_name[n]
            saved = p.sizes[k] - p.sizes[k - 1]
            if saved <= 0:
                continue
            pr = probs[n]
            cost = float(pr[k] - pr[k - 1]) / saved
            key = (cost, n)
            if best is None or key < best[0]:
                best = (key, n, saved)
        if best is None:
            raise ConfigError(
                f"cannot bring the assignment within budget: {total:,} bytes > {budget.upper_bytes:,} with every tensor on its cheapest rung"
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
            if k + 1 >= len(p.sizes):
                continue
            added = p.sizes[k + 1] - p.sizes[k]
            if added <= 0 or total + added > budget.upper_bytes:
                continue
            pr = probs[n]
            key = (float(pr[k] - pr[k + 1]) / added, n)
            if best is None or key < best[0]:
                best = (key, n, added)
        if best is None:
            break  # nothing fits under the upper bound: stay below, reported by the caller
        _, n, added = best
        choice[n] += 1
        total += added
        filled += 1
    return BakeResult(choice, arg, upgraded, repaired, total, filled)
