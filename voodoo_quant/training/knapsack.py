"""Greedy knapsacks over the sensitivity table: a layout on budget, and a polish of a baked one.

``greedy_layout`` (warm start and ``--method sensitivity``): every tensor starts on its cheapest
rung; each tensor's rungs are reduced to the lower convex hull of (bytes, s), so its upgrades
come in decreasing sensitivity-saved-per-byte; all upgrades of all tensors are taken in that
order while they fit under the cap (a step that does not fit ends its tensor's chain, and the
walk goes on with the others, filling the remaining bytes). This is the classic greedy for the
multiple-choice knapsack; minimizing Σ_t s(t, q_t) is its objective.

``polish`` (``--polish``): after the argmax, upgrades, repair and fill, one-rung moves per
tensor ranked by measured benefit per byte: first single upgrades that fit under the upper
bound, then swaps (one tensor up, another down) with a net gain, every move keeping the total
inside the dead zone ``[target·(1−tol), target·(1+tol)]`` (or above where the bake started, if
it started below). Tensors matched by ``--tensor_upgrades`` keep the rung the rule gave them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from ..selection.menus import Upgrade, is_pinned


def _hull(sizes: Sequence[int], s: Sequence[float]) -> list[int]:
    """Rung indices on the lower convex hull of (bytes, s), cheapest first, s strictly falling."""
    order = sorted(range(len(sizes)), key=lambda k: (sizes[k], s[k]))
    pts: list[int] = []
    for k in order:
        if pts and sizes[k] == sizes[pts[-1]]:
            continue  # same bytes, no better (sorted by s second)
        if pts and s[k] >= s[pts[-1]]:
            continue  # more bytes, no gain: dominated
        while len(pts) >= 2:
            a, b = pts[-2], pts[-1]
            # drop b if it lies on or above the segment a→k (a worse rate than going straight to k)
            if (s[a] - s[b]) * (sizes[k] - sizes[a]) <= (s[a] - s[k]) * (sizes[b] - sizes[a]):
                pts.pop()
            else:
                break
        pts.append(k)
    return pts


def greedy_layout(plans: Sequence, table: Mapping[str, Sequence[float]], cap_bytes: int) -> dict[str, int]:
    """tensor -> rung minimizing Σ s under `cap_bytes` (greedy multiple-choice knapsack)."""
    choice: dict[str, int] = {}
    steps = []  # (gain per byte, name, from rung, to rung, bytes added)
    total = 0
    for p in plans:
        hull = _hull(p.sizes, table[p.name])
        choice[p.name] = hull[0]
        total += p.sizes[hull[0]]
        s = table[p.name]
        for a, b in zip(hull, hull[1:]):
            add = p.sizes[b] - p.sizes[a]
            steps.append(((s[a] - s[b]) / add, p.name, a, b, add))
    steps.sort(key=lambda x: (-x[0], x[1], x[2]))
    blocked: set[str] = set()
    by = {p.name: p for p in plans}
    for _, name, a, b, add in steps:
        if name in blocked or choice[name] != a:
            continue
        if total + add > cap_bytes:
            blocked.add(name)
            continue
        choice[name] = b
        total += add
    assert total == sum(by[n].sizes[k] for n, k in choice.items())
    return choice


@dataclass
class PolishResult:
    choice: dict[str, int]
    moves: int  # rung changes applied (a swap counts two)
    gain: float  # Σ s before − after
    total_bytes: int


def polish(
    plans: Sequence, table: Mapping[str, Sequence[float]], choice: Mapping[str, int], *,
    lower: float, upper: float, upgrades: Sequence[Upgrade] = (), max_moves: int | None = None,
) -> PolishResult:
    by = {p.name: p for p in plans}
    cur = dict(choice)
    frozen = {n for n in by if is_pinned(n, upgrades)}
    total = sum(by[n].sizes[k] for n, k in cur.items())
    lo = min(lower, total)  # never end lower than the bake, never leave the zone once inside
    hi = upper
    start_s = sum(table[n][k] for n, k in cur.items())
    moves = 0
    limit = max_moves if max_moves is not None else 8 * len(by) + 16

    def ups():
        out = []
        for n, k in cur.items():
            p = by[n]
            if n in frozen or k + 1 >= len(p.sizes):
                continue
            add, gain = p.sizes[k + 1] - p.sizes[k], table[n][k] - table[n][k + 1]
            if gain > 0 and add > 0:
                out.append((gain / add, n, add, gain))
        out.sort(key=lambda x: (-x[0], x[1]))
        return out

    def downs():
        out = []
        for n, k in cur.items():
            p = by[n]
            if n in frozen or k == 0:
                continue
            saved, loss = p.sizes[k] - p.sizes[k - 1], table[n][k - 1] - table[n][k]
            if saved > 0:
                out.append((loss / saved, n, saved, loss))
        out.sort(key=lambda x: (x[0], x[1]))
        return out

    while moves < limit:
        up_moves = ups()
        single = next((u for u in up_moves if total + u[2] <= hi), None)
        if single is not None:
            cur[single[1]] += 1
            total += single[2]
            moves += 1
            continue
        best = None  # (net gain, up, down)
        down_moves = downs()
        for u in up_moves[:32]:
            for d in down_moves:
                if d[1] == u[1]:
                    continue
                new_total = total + u[2] - d[2]
                net = u[3] - d[3]
                if net > 0 and lo <= new_total <= hi and (best is None or net > best[0]):
                    best = (net, u, d)
        if best is None:
            break
        _, u, d = best
        cur[u[1]] += 1
        cur[d[1]] -= 1
        total += u[2] - d[2]
        moves += 2
    end_s = sum(table[n][k] for n, k in cur.items())
    return PolishResult(cur, moves, start_s - end_s, total)
