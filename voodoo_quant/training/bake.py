"""Bake: from trained gates to an assignment that is on budget.

1. argmax of each tensor's gates;
2. ``--tensor_upgrades``: matching tensors move ±n rungs along their own menu (clamped);
3. repair, only if the result is over ``target × (1 + tolerance)``: repeatedly move one tensor
   one rung down, choosing the move that gives up the least gate probability per byte saved
   (``(p_now − p_below) / bytes_saved``, ties broken by name) until the size is within budget.
   Deterministic, and it touches first the tensors whose gates cared least.
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
    repaired: int  # one-rung repair moves
    total_bytes: int


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
    return BakeResult(choice, arg, upgraded, repaired, total)
