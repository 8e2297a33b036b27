"""Rungs: every type a tensor may be served as after training, cheapest first.

The gates trained over each tensor's menu; the final search and the never-worse guarantee may
also serve a type off the menu, one a stock recipe or a uniform file gives that tensor. A
``Rungs`` holds a tensor's types, their exact GGUF bytes and a way to produce each one's weight:
menu types are the MixedQuant's own candidates, off-menu ones are dequantized from the candidate
cache's bytes (the same libggml-base quantizer and imatrix) each time they are used.

``serve`` makes every tensor's layer serve one rung exactly (the parametrization's override), so
the student is the file that assignment exports to; a rung is produced when its layer uses it
(:class:`RungSource`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from ..core import qtypes as qt
from ..selection.menus import rung_key
from ..student.layers import MixedQuant, row_reader


@dataclass
class Rungs:
    name: str
    mq: MixedQuant
    types: list[str]  # cheapest first (menu order, off-menu types inserted by bits per weight)
    sizes: list[int]
    extra: Callable[[str], torch.Tensor] | None = None  # off-menu type -> HF-layout weight, made when asked

    def index(self, qtype: str) -> int:
        return self.types.index(qt.get(qtype).name)

    def get(self, j: int) -> torch.Tensor:
        """Rung j's weight: a menu candidate (an eager view, or a lazy one dequantized now), or an
        off-menu type dequantized from its bytes now (never kept: the references' types would
        otherwise add dense copies of the model)."""
        t = self.types[j]
        if t in self.mq.menu:
            return self.mq.candidate(self.mq.menu.index(t))
        if self.extra is None:
            raise KeyError(f"{self.name}: no weights for off-menu type {t}")
        return self.extra(t).to(self.mq.dtype)

    def add(self, qtype: str, nbytes: int) -> int:
        """Insert an off-menu type (once) in bits order; returns its index."""
        q = qt.get(qtype)
        if q.name in self.types:
            return self.types.index(q.name)
        keys = [rung_key(qt.get(t)) for t in self.types]
        pos = sum(1 for k in keys if k < rung_key(q))
        self.types.insert(pos, q.name)
        self.sizes.insert(pos, int(nbytes))
        return pos


def menu_rungs(plans: Sequence, mixed: Mapping[str, MixedQuant]) -> dict[str, Rungs]:
    return {p.name: Rungs(p.name, mixed[p.name], list(p.menu.types), list(p.sizes)) for p in plans}


class RungSource:
    """Rungs `js` of one tensor as ``layers._Mix`` reads candidates: called with a position in
    `js`, it produces that rung's weight when asked (a lazy candidate is dequantized then and
    dropped after use, so a served student holds one dense weight at a time, not the model);
    ``row_reader`` reads rows of menu rungs where the candidates can be read by rows."""

    def __init__(self, rungs: Rungs, js: Sequence[int]):
        self.rungs, self.js = rungs, list(js)
        self.shape = rungs.mq.shape
        mq = rungs.mq
        rows = row_reader(mq.stacked if mq.stacked is not None else mq._get)
        menu = [mq.menu.index(rungs.types[j]) if rungs.types[j] in mq.menu else None for j in self.js]
        self.row_reader = None if rows is None or None in menu else (lambda i, lo, hi: rows(menu[i], lo, hi))

    def __call__(self, i: int) -> torch.Tensor:
        return self.rungs.get(self.js[i])


def serve(rungs: Mapping[str, Rungs], current: Mapping[str, int]) -> None:
    """Every tensor serves rung `current[name]` exactly (no mixing), produced on each use."""
    for n, r in rungs.items():
        r.mq.override = (None, RungSource(r, [current[n]]), 1)


def release(rungs: Mapping[str, Rungs]) -> None:
    for r in rungs.values():
        r.mq.override = None


def total_bytes(rungs: Mapping[str, Rungs], current: Mapping[str, int]) -> int:
    return sum(r.sizes[current[n]] for n, r in rungs.items())


def types_of(rungs: Mapping[str, Rungs], current: Mapping[str, int]) -> dict[str, str]:
    return {n: r.types[current[n]] for n, r in rungs.items()}
