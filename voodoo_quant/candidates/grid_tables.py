"""The lattice tables and float arithmetic of libggml-base's grid search, in torch: the pieces
:mod:`.grid_search` builds each grid type's quantizer from.

A grid IQ type (IQ1_S, IQ2_XXS, IQ2_S, IQ3_S) stores each group of 8 (IQ3: 4) weights as one
entry of a grid: a point of the lattice of ``nl`` levels per weight (IQ2, IQ1: 3; IQ3: 8).
libggml-base's search (``ggml-quants.c``) rounds a group's values to the nearest lattice point,
looks it up in ``kmap`` (``iq2xs_init_impl`` / ``iq3xs_init_impl``), and where that point is not on
the grid it scans the point's *neighbour list*: the grid entries at the ``nwant`` smallest
distinct integer distances from it, in the order (distance, index). :class:`Lattice` rebuilds
those tables from the grid (read out of libggml-base by :mod:`voodoo_quant.quants.grids`) with the
same rule, and :func:`best_neighbours` does the scan for every group at once, with the first
smallest distance winning as in ``iq2_find_best_neighbour`` (its strict ``<``).

Bit-exactness with the C code rests on doing the same float32 operations in the same order: the
build compiles ``ggml-quants.c`` at ``-O3`` without ``-ffast-math`` or FMA (the Release
build's flags), so every ``a*b + c`` is two roundings and every sum is left to right.
:func:`seqsum` adds in that order, and :func:`nearest_int` is the C function's bit trick
(round half to even, and its garbage beyond 2^22 too); :func:`sqrtf` is correctly rounded.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from ..quants.grids import numpy_table

# type → (grid table, levels per weight, weights per group, nwant: distinct distances in a
# neighbour list) — ggml-quants.c iq2xs_init_impl (nwant: IQ1 3, IQ2_S 1, else 2), iq3xs_init_impl
# (grid 512: 3)
_LATTICES = {
    "IQ2_XXS": ("iq2xxs_grid", 3, 8, 2),
    "IQ2_XS": ("iq2xs_grid", 3, 8, 2),
    "IQ2_S": ("iq2s_grid", 3, 8, 1),
    "IQ1_S": ("iq1s_grid", 3, 8, 3),
    "IQ3_S": ("iq3s_grid", 8, 4, 3),
    "IQ3_XXS": ("iq3xxs_grid", 8, 4, 2),  # the held-level proxy's (proxy_grids.py): kmap only
}


# a measured variant (bench/grid_search_agreement.py --exhaustive): the nearest grid entry over the
# whole grid instead of the neighbour list's, as a plain nearest-point search would choose it
EXHAUSTIVE = False


def nearest_int(v: torch.Tensor) -> torch.Tensor:
    """ggml-quants.c ``nearest_int``: ``(bits(v + 12582912.f) & 0x7fffff) − 0x400000`` (int32)."""
    t = (v.to(torch.float32) + 12582912.0).view(torch.int32)
    return (t & 0x007FFFFF) - 0x00400000


def sqrtf(v: torch.Tensor) -> torch.Tensor:
    """C's ``sqrtf``: the correctly rounded float32 square root. torch's CPU float32 sqrt is a
    vectorized approximation that is off by one ulp for some values (measured: 3 of 16), so the root
    is taken in float64 and rounded once (exact: a double has more than 2·24 + 2 bits)."""
    return torch.sqrt(v.to(torch.float64)).to(torch.float32)


def seqsum(t: torch.Tensor) -> torch.Tensor:
    """Σ over the last dimension, added left to right in t's dtype (C's ``s += ...`` loop)."""
    acc = t[..., 0].clone()
    for i in range(1, t.shape[-1]):
        acc = acc + t[..., i]
    return acc


@dataclass(frozen=True)
class Lattice:
    """One grid type's lattice tables (CPU, int64): ``levels`` (entries × dim, each 0..nl−1),
    ``kmap`` (lattice code → grid entry, −1 off the grid; code = Σ level_i · nl^i), and each
    off-grid code's neighbour list as ``start``/``length`` into ``flat``."""

    nl: int
    dim: int
    levels: torch.Tensor
    kmap: torch.Tensor
    start: torch.Tensor
    length: torch.Tensor
    flat: torch.Tensor

    @property
    def offsets(self) -> torch.Tensor:
        """(entries, dim): where each weight's cost of the entry's level sits in a group's
        (dim · nl) cost row: i · nl + level_i."""
        return self.levels + self.nl * torch.arange(self.dim, device=self.levels.device)

    def to(self, device) -> Lattice:
        return Lattice(self.nl, self.dim, *(t.to(device) for t in
                                            (self.levels, self.kmap, self.start, self.length, self.flat)))

    def code(self, lev: torch.Tensor) -> torch.Tensor:
        """Lattice codes of (…, dim) levels."""
        w = self.nl ** torch.arange(self.dim, device=lev.device, dtype=torch.int64)
        return (lev.to(torch.int64) * w).sum(-1)


def _grid_levels(name: str) -> np.ndarray:
    tab, nl, _, _ = _LATTICES[name]
    g = np.rint(numpy_table(tab)).astype(np.int64)
    if name == "IQ1_S":
        return g + 1  # grid values −1, 0, 1 (the search's x_p/x_m index 0, 1, 2)
    if name == "IQ3_S":
        return (g - 1) // 2  # grid values 2l + 1
    if name == "IQ3_XXS":
        return np.searchsorted(np.array([4, 12, 20, 28, 36, 44, 52, 62]), g)  # the dequantizer's 4·(2l + 1), 62 for 15
    return np.searchsorted(np.array([8, 25, 43]), g)  # IQ2: the dequantizer stores 8, 25, 43 for 2l + 1


@lru_cache(maxsize=None)
def _lattice(name: str) -> Lattice:
    _, nl, dim, nwant = _LATTICES[name]
    lev = _grid_levels(name)
    if lev.min() < 0 or lev.max() >= nl:
        raise ValueError(f"{name}: grid levels outside 0..{nl - 1}")
    size = nl ** dim
    w = nl ** np.arange(dim)
    kmap = np.full(size, -1, dtype=np.int64)
    kmap[lev @ w] = np.arange(len(lev))
    pts = (np.arange(size)[:, None] // w) % nl  # every lattice point, by code
    P, G = 2 * pts + 1, 2 * lev + 1  # the positions iq*_init_impl measures distances between
    length = np.zeros(size, dtype=np.int64)
    flat = []
    Gf = G.astype(np.float64)
    g2 = (Gf * Gf).sum(1)[None, :]
    for c0 in range(0, size, 512):
        p = P[c0:c0 + 512].astype(np.float64)  # small integers: every product and sum exact
        d2 = np.rint((p * p).sum(1, keepdims=True) + g2 - 2 * p @ Gf.T).astype(np.int64)  # (chunk, entries)
        key = np.sort(d2 * len(G) + np.arange(len(G)), axis=1)  # by distance, then index (iq2_compare_func)
        order, sd = key % len(G), key // len(G)
        rank = np.concatenate([np.zeros((len(sd), 1), np.int64), np.cumsum(np.diff(sd, axis=1) > 0, axis=1)], 1)
        keep = (rank < nwant) & (kmap[c0:c0 + 512] < 0)[:, None]  # on-grid points list nothing
        length[c0:c0 + 512] = keep.sum(1)
        flat.append(order[keep])  # row by row, each row in its sorted order
    start = np.cumsum(length) - length
    return Lattice(nl, dim, torch.from_numpy(lev), torch.from_numpy(kmap), torch.from_numpy(start),
                   torch.from_numpy(length), torch.from_numpy(np.concatenate(flat)))


@lru_cache(maxsize=None)
def _lattice_on(name: str, device: str, exhaustive: bool) -> Lattice:
    lat = _lattice(name)
    if exhaustive:  # every off-grid code's list: the whole grid, in index order
        G, off = lat.levels.shape[0], lat.kmap < 0
        lat = Lattice(lat.nl, lat.dim, lat.levels, lat.kmap, torch.zeros_like(lat.start),
                      torch.where(off, G, 0), torch.arange(G))
    return lat.to(device)


def lattice(name: str, device: torch.device | str = "cpu") -> Lattice:
    """The lattice tables of grid type `name` on `device` (built once per process: ~1 s for IQ1_S);
    with :data:`EXHAUSTIVE`, an off-grid group searches the whole grid instead of its neighbours."""
    return _lattice_on(name, str(torch.device(device)), bool(EXHAUSTIVE))


def best_neighbours(lat: Lattice, code: torch.Tensor, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                    values: torch.Tensor) -> torch.Tensor:
    """The grid entry ``iq*_find_best_neighbour`` picks for each group whose lattice `code` is off
    the grid: the first of its neighbour list with the least ``Σ_i w_i (scale · q_i − x_i)²``, q_i the
    value of the entry's level at weight i, summed left to right.

    `code` (groups,), `x` and `w` (groups, dim), `scale` (groups,), `values` (nl,) or (groups, nl):
    the value of each level. Returns (groups,) int64 entries (every code must be off the grid).

    The C loop, run for all groups at once: the groups sorted by list length (longest first), the
    k-th neighbour of the groups that have one is scored at step k and replaces the best so far
    where strictly smaller. Each group's (weight, level) costs are computed once, as C computes
    them (``weight*diff*diff`` with ``diff = scale*q - x``), and an entry's distance is the sum of
    its weights' costs, gathered and added left to right."""
    n = code.shape[0]
    dev = code.device
    if n == 0:
        return torch.zeros(0, dtype=torch.int64, device=dev)
    nl, dim = lat.nl, lat.dim
    q = values if values.dim() == 2 else values.unsqueeze(0)
    diff = scale[:, None, None] * q[:, None, :] - x[:, :, None]  # (groups, dim, nl): scale*q - xval
    cost = ((w[:, :, None] * diff) * diff).reshape(n, dim * nl)  # weight*diff*diff, left to right
    lens, order = torch.sort(lat.length[code], descending=True)
    cost = cost[order]
    start = lat.start[code[order]]
    best = torch.full((n,), float("inf"), device=dev)
    win = torch.zeros(n, dtype=torch.int64, device=dev)
    offs = lat.offsets
    counts = torch.searchsorted(-lens, -torch.arange(1, int(lens[0]) + 1, device=dev), right=True).tolist()
    for k, m in enumerate(counts):  # m: the groups with a k-th neighbour (a prefix, by the sort)
        cand = lat.flat.index_select(0, start[:m] + k)
        c = torch.gather(cost[:m], 1, offs.index_select(0, cand))  # (m, dim) costs of the entry
        d2 = c[:, 0]
        for i in range(1, dim):
            d2 = d2 + c[:, i]
        b, wm = best[:m], win[:m]
        better = d2 < b
        torch.where(better, d2, b, out=b)
        torch.where(better, cand, wm, out=wm)
    out = torch.empty_like(win)
    out[order] = win
    return out
