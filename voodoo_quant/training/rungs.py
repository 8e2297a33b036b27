"""Rungs: every type a tensor may be served as after training, cheapest first.

The gates trained over each tensor's menu; the final search and the never-worse guarantee may
also serve a type off the menu, one a stock recipe or a uniform file gives that tensor. A
``Rungs`` holds a tensor's types, their exact GGUF bytes and a way to produce each one's weight:
menu types are the MixedQuant's own candidates, off-menu ones are dequantized from the candidate
cache's bytes (the same libggml-base quantizer and imatrix) when first needed.

``serve`` makes every tensor's layer serve one rung exactly (the parametrization's override), so
the student is the file that assignment exports to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch

from .. import qtypes as qt
from ..layers import MixedQuant
from ..menus import rung_key


@dataclass
class Rungs:
    name: str
    mq: MixedQuant
    types: list[str]  # cheapest first (menu order, off-menu types inserted by bits per weight)
    sizes: list[int]
    extra: Callable[[str], torch.Tensor] | None = None  # off-menu type -> HF-layout weight
    _cache: dict[str, torch.Tensor] = field(default_factory=dict)

    def index(self, qtype: str) -> int:
        return self.types.index(qt.get(qtype).name)

    def get(self, j: int) -> torch.Tensor:
        t = self.types[j]
        if t in self.mq.menu:
            return self.mq.candidate(self.mq.menu.index(t))
        if t not in self._cache:
            if self.extra is None:
                raise KeyError(f"{self.name}: no weights for off-menu type {t}")
            self._cache[t] = self.extra(t).to(self.mq.dtype)
        return self._cache[t]

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


def serve(rungs: Mapping[str, Rungs], current: Mapping[str, int]) -> None:
    """Every tensor serves rung `current[name]` exactly (no mixing)."""
    for n, r in rungs.items():
        w = r.get(current[n])
        r.mq.override = (None, (lambda _k, w=w: w), 1)


def release(rungs: Mapping[str, Rungs]) -> None:
    for r in rungs.values():
        r.mq.override = None
        r._cache.clear()


def total_bytes(rungs: Mapping[str, Rungs], current: Mapping[str, int]) -> int:
    return sum(r.sizes[current[n]] for n, r in rungs.items())


def types_of(rungs: Mapping[str, Rungs], current: Mapping[str, int]) -> dict[str, str]:
    return {n: r.types[current[n]] for n, r in rungs.items()}
