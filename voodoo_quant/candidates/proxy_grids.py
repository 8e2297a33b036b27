"""The "proxy" sweep's held-level rounding of the grid types IQ3_S, IQ2_S and IQ1_S: a torch
stand-in for libggml-base's quantizer of one superblock, walked 32 columns at a time, whose rounded
values libggml-base's quantization of W' gives back (proxy_rounding.py has the other types).

No grid type's quantization is a fixed point of libggml-base's quantizer: requantizing its own
dequantized output (same imatrix) changed 100 % of 32-blocks for every grid type (synthetic
256 × 1536, docs/lab/2026-12-07-proxy-grid-types.md). Stage 2 of ``quantize_row_*_impl``
(``ggml-quants.c``) stores ``d = fp16(max s / DIV · F)`` with a fudge factor F (IQ3_S 1.033,
IQ2_S 0.9875, IQ1_S 1.125) and codes each sub-block's scale ``l = nint((s/(max s/DIV) − 1)/2)``,
where s is the sub-block's weighted least-squares fit on the search's levels q (IQ3_S: the grid
values 1..15; IQ2_S: 1, 3, 5 while the dequantizer stores 8, 25, 43; IQ1_S: g ± 1/8). So the
quantizer's fit of stored values finds F (and for IQ2_S the ratio of stored magnitudes to levels)
times their scale, and the ruler moves. What W' holds instead (:attr:`HeldLevelProxy.held`) is
each value's *level* times ``fp32(d · (2l + 1)) / F``: an exact fit on the levels, whatever the
search's weights (so it does not depend on the superblock's σ², unlike IQ2_XXS's 8/r of
proxy_rounding.py); the fit gives back ``s = fp32(d·(2l+1)) / F``, the top sub-block (l at its
largest) the ruler ``d``, every other sub-block its ``l``, and the dequantizer the values the walk
rounded. Measured on libggml-base's own output held so: IQ1_S 100 % of 32-blocks given back, IQ3_S
97.6 %, IQ2_S 89.5 %, where every miss was a sub-block the quantizer's trial scales cannot reach:
its trials put a sub-block's largest value at level 13.2–16.8 (IQ3_S) or 4.1–5.9 (IQ2_S), so a
sub-block held with no value at level 13 or 15 (IQ3_S) or 5 (IQ2_S) is searched again, and where it
is the top one the whole superblock's ruler moves. The proxy's rounding never leaves such a
sub-block (:data:`REACH`): where its choice would, the group whose change to a top-level entry costs
least is changed.

Per step (:meth:`HeldLevelProxy.round`): each sub-block's grid entries (and IQ1_S's shift) are the
nearest in the quantizer's weighted norm at a few trial scales (:data:`TRIALS`; IQ1_S both shifts),
the best trial's fitted scale is coded against the ruler fixed when the walk reached the superblock
(the largest sub-block then at the top code), and the entries are chosen again at the coded scale.
The nearest entry at a scale is exact (:data:`SEARCH` ``"nearest"``): each value's nearest level is
a lattice point, the answer where it is on the grid, and the off-grid groups are searched over the
whole grid (one matrix product against the table, then an argmin); ``"neighbours"`` scans
libggml-base's neighbour lists instead (grid_tables.py). Torch only; follows its inputs' device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core import qtypes as qt
from ..core.errors import QuantizationInputError
from ..quants.grids import table
from . import grid_probe
from .grid_tables import best_neighbours, lattice


@dataclass(frozen=True)
class Spec:
    """One grid type as the held proxy sees it. A value is ``db · code`` with
    ``db = fp32(d · (2l + 1)) · kappa`` (the dequantizer's product: IQ2_S ``d·(0.5 + l)·0.25``),
    code the grid entry's value at the weight (signed; IQ1_S ``g + δ``)."""

    table: str  # the grid (quants/grids.py): magnitudes (IQ2_S 8/25/43, IQ3_S 1..15) or IQ1_S's −1/0/1
    values: tuple  # the dequantizer's code of each lattice level (grid_tables.Lattice.levels indexes them)
    kappa: float
    fudge: float  # stage 2's factor: d = fp16(max s / DIV · fudge)
    reach: float  # a sub-block must hold a code at least this large (0: any), or the quantizer moves it
    shift: bool = False  # IQ1_S: signed entries plus a shift ±1/8 per sub-block; else free signs


SPECS = {
    "IQ3_S": Spec("iq3s_grid", (1.0, 3.0, 5.0, 7.0, 9.0, 11.0, 13.0, 15.0), 1.0, 1.033, 13.0),
    "IQ2_S": Spec("iq2s_grid", (8.0, 25.0, 43.0), 0.125, 0.9875, 43.0),
    "IQ1_S": Spec("iq1s_grid", (-1.0, 0.0, 1.0), 1.0, 1.125, 0.0, shift=True),
}
DELTA = 0.125  # IQ1S_DELTA (ggml-common.h)
# the trial scales of a step's search: the sub-block's largest magnitude at this fraction of the
# largest code (libggml-base's trials span 0.88–1.12 for IQ3_S and 0.82–1.18 for IQ2_S). Measured
# (bench/compensation_objective.py and docs/lab/2026-12-07-proxy-grid-types.md)
TRIALS = {"IQ3_S": (0.9, 1.0, 1.1), "IQ2_S": (0.85, 1.0, 1.15), "IQ1_S": (0.6, 0.8, 1.0)}
# the trial of the search that fixes the ruler when the walk reaches the superblock
REACH_TRIALS = {"IQ3_S": (1.0,), "IQ2_S": (1.0,), "IQ1_S": (0.8,)}
# the ruler's top code as a multiple of the largest sub-block's fitted scale when the walk reaches
# the superblock: room for the sub-blocks the walk's updates make larger (measured)
HEADROOM = {"IQ3_S": 1.0, "IQ2_S": 1.0, "IQ1_S": 1.0}
# RULE_FIT: the ruler the candidate of GAMMAS × the largest sub-block's scale that a quadratic
# model of each sub-block's error in its coded scale (a·(ŝ − s)², from the fit) finds best, per row
RULE_FIT = False
GAMMAS = (0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0, 1.05)
# the fit that fixes the ruler when the walk reaches a superblock: "grid", of its nearest grid
# entries; "lattice", of each value's nearest level (no grid: cheaper)
RULER = "lattice"
SEARCH = "nearest"  # "nearest": the whole grid's nearest entry; "neighbours": libggml-base's lists
# the coded scales searched on the grid per sub-block (0: the best trial's fit coded, the
# entries chosen again at it): the EXACT best of the codes within WINDOW of the lattice fit's,
# ranked by their error with each value at its nearest level (no grid)
EXACT = {"IQ3_S": 2, "IQ2_S": 2, "IQ1_S": 1}
WINDOW = 2
REACH = True  # keep every sub-block within reach of the quantizer's trials (module docstring)
CHUNK = 4096  # off-grid groups searched over the whole grid at once (their distances: 32 MB for IQ1_S)


def settings() -> str:
    """Everything that changes what these proxies round: part of the sweep's cache digest."""
    return (f"levels/1:t{sorted(TRIALS.items())}:r{sorted(REACH_TRIALS.items())}:{SEARCH}:{REACH}"
            f":x{sorted(EXACT.items())}:{WINDOW}:{RULER}:h{sorted(HEADROOM.items())}")


def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(torch.float32)


class _Grid:
    """A type's grid on a device: codes (entries × dim), each entry's largest |code|, the lattice."""

    def __init__(self, name: str, device):
        spec = SPECS[name]
        self.codes = table(spec.table, device)
        self.dim = self.codes.shape[1]
        self.top = self.codes.abs().amax(1)
        self.lat = lattice(name, device)
        self.values = torch.tensor(spec.values, dtype=torch.float32, device=device)

    def nearest(self, y: torch.Tensor, w: torch.Tensor, s: torch.Tensor, delta: float = 0.0,
                allowed: torch.Tensor | None = None) -> torch.Tensor:
        """Per group (rows of y, w: groups × dim; s: groups) the entry minimizing
        Σ w (s·(code + δ) − y)²: the nearest lattice point where it is on the grid, else the
        whole grid's (:data:`SEARCH` ``"nearest"``) or the neighbour list's best. With `allowed`
        (entries, bool) only those entries, searched over the whole grid."""
        if allowed is not None:
            return self._exhaustive(y, w, s, delta, allowed)
        vals = self.values + delta
        if len(self.values) == 3 and delta:  # IQ1_S: levels −1, 0, 1 (+δ), one apart
            lev = torch.clamp(torch.round(y / _safe(s).unsqueeze(1) - delta), -1, 1) + 1
        elif len(self.values) == 3:  # IQ2: 8, 25, 43 (not evenly spaced)
            r = y / _safe(s).unsqueeze(1)
            lev = (r > 16.5).to(torch.float32) + (r > 34.0).to(torch.float32)
        else:  # IQ3_S: the odd levels 1..15
            lev = torch.clamp(torch.round((y / _safe(s).unsqueeze(1) - 1) * 0.5), 0, len(self.values) - 1)
        code = self.lat.code(lev)
        e = self.lat.kmap[code]
        off = (e < 0) & (s > 0)
        e = torch.where(s > 0, e, torch.zeros_like(e))
        if bool(off.any()):
            i = off.nonzero().squeeze(1)
            if SEARCH == "neighbours":
                e[i] = best_neighbours(self.lat, code[i], y[i], w[i], s[i], vals)
            else:
                e[i] = self._exhaustive(y[i], w[i], s[i], delta, None)
        return e

    def _exhaustive(self, y, w, s, delta, allowed):
        c = self.codes + delta
        basis = torch.cat([c * c, c], 1).T  # 2·dim × entries
        out = torch.empty(y.shape[0], dtype=torch.int64, device=y.device)
        for a in range(0, y.shape[0], CHUNK):
            yy, ww, ss = y[a:a + CHUNK], w[a:a + CHUNK], s[a:a + CHUNK]
            t = (-2.0 / _safe(ss)).unsqueeze(1)
            # Σ w·c² − (2/s)·Σ w·y·c = (Σ w (s·c − y)² − Σ w y²) / s², one product per chunk
            d = torch.cat([ww, ww * yy * t], 1) @ basis
            if allowed is not None:
                d = torch.where(allowed.unsqueeze(0), d, torch.full_like(d, float("inf")))
            out[a:a + CHUNK] = d.argmin(1)
        return out


_GRIDS: dict = {}


def _grid(name: str, device) -> _Grid:
    key = (name, str(torch.device(device)))
    if key not in _GRIDS:
        _GRIDS[key] = _Grid(name, device)
    return _GRIDS[key]


def _safe(s: torch.Tensor) -> torch.Tensor:
    return torch.where(s > 0, s, torch.ones_like(s))


def supported(qtype: str | qt.QType) -> bool:
    return qt.get(qtype).name in SPECS


class HeldLevelProxy:
    """One superblock (rows × 256) of IQ3_S, IQ2_S or IQ1_S walked 32 columns at a time: each
    step rounded in torch to values the format stores (:meth:`round`), and :attr:`held`, what W'
    holds for them so that libggml-base's quantization of W' gives them back (module docstring).

    Made when the walk reaches the superblock: a one-trial search of all its sub-blocks fixes the
    ruler ``d`` (fp16), the largest sub-block's fitted scale at the top code."""

    def __init__(self, blk: torch.Tensor, q: str | qt.QType, v: torch.Tensor | None):
        self.q = qt.get(q)
        if self.q.name not in SPECS:
            raise QuantizationInputError(f"no held-level proxy for {self.q.name}")
        rows, width = blk.shape
        if width != 256:
            raise QuantizationInputError(f"a {self.q.name} superblock is 256 wide, got {width}")
        self.spec = SPECS[self.q.name]
        self.div, self.lmax, self.g, _ = grid_probe.RULES[self.q.name]
        self.v = v
        self.grid = _grid(self.q.name, blk.device)
        x = blk.to(torch.float32)
        s, _, a = self._fit(x, self.weights(x), REACH_TRIALS[self.q.name], grid=RULER == "grid")  # rows × sub-blocks
        self.top = s.argmax(1, keepdim=True)
        top_s = s.gather(1, self.top)
        gam = torch.tensor(GAMMAS if RULE_FIT else (HEADROOM[self.q.name],), device=x.device)
        d = _fp16(top_s * gam / (self.spec.kappa * (2 * self.lmax + 1)))  # rows × candidates
        if len(gam) > 1:  # each sub-block's error ≈ a·(ŝ − s)², ŝ its coded scale (the top one's at the top code)
            unit = (d * self.spec.kappa).unsqueeze(1)  # rows × 1 × candidates
            l = torch.clamp(torch.round((s.unsqueeze(2) / _safe(unit) - 1) * 0.5), 0, self.lmax)
            err = (a.unsqueeze(2) * (unit * (2 * l + 1) - s.unsqueeze(2)).square()).sum(1)
            d = d.gather(1, err.argmin(1, keepdim=True))
        self.d16 = d  # rows × 1
        self.held = None

    def weights(self, blk: torch.Tensor) -> torch.Tensor:
        """libggml-base's search weight of each value of the superblock `blk` (rows × 256):
        ``qw · sqrt(σ² + x²)`` with σ² = 2 · its mean square; without an imatrix x² (IQ2_S:
        σ²/4 + x²)."""
        s2 = grid_probe.SIGMA2_SCALE[self.q.name] * blk.square().mean(1, keepdim=True)
        if self.v is not None:
            return self.v.unsqueeze(0) * (s2 + blk * blk).sqrt()
        return 0.25 * s2 + blk * blk if self.q.name == "IQ2_S" else blk * blk

    def _groups(self, x: torch.Tensor, wt: torch.Tensor):
        """(y, w, sign): the groups of 8 (IQ3_S: 4) of x and wt, y the magnitudes (IQ1_S: the
        signed values, sign 1)."""
        dim = self.grid.dim
        y, w = x.reshape(-1, dim), wt.reshape(-1, dim)
        if self.spec.shift:
            return y, w, torch.ones_like(y)
        return y.abs(), w, torch.where(y < 0, -1.0, 1.0)

    def _pick(self, y, w, s_sub, delta, per):
        """Entries at scale s_sub (per sub-block), with (Σ w·c·y, Σ w·c²) per sub-block."""
        s = s_sub.reshape(-1).repeat_interleave(per)
        e = self.grid.nearest(y, w, s, delta)
        c = self.grid.codes[e] + delta
        b = (w * c * y).sum(1).reshape(-1, per).sum(1)
        a = (w * c * c).sum(1).reshape(-1, per).sum(1)
        return e, b, a

    def _lattice_fit(self, y, w, s_sub, delta, per):
        """(Σ w·v·y, Σ w·v²) per sub-block with every value at its nearest level v at s_sub (no grid)."""
        yy = y.reshape(-1, per * self.grid.dim)
        ww = w.reshape(-1, per * self.grid.dim)
        r = yy / _safe(s_sub).unsqueeze(1)
        vals = self.grid.values
        if self.spec.shift:
            v = torch.clamp(torch.round(r - delta), -1, 1) + delta
        elif len(vals) == 3:
            v = torch.where(r > 34.0, 43.0, torch.where(r > 16.5, 25.0, 8.0))
        else:
            v = 2 * torch.clamp(torch.round((r - 1) * 0.5), 0, len(vals) - 1) + 1
        return (ww * v * yy).sum(1), (ww * v * v).sum(1)

    def _fit(self, x: torch.Tensor, wt: torch.Tensor, trials: tuple, grid: bool = True):
        """(s, delta): per sub-block of x (rows × 32k) the weighted least-squares scale of its
        nearest entries at the trial whose fit explains most (largest (Σ w·c·y)² / Σ w·c²), and
        IQ1_S's shift (± :data:`DELTA`; 0 for the other types), each rows × sub-blocks."""
        rows = x.shape[0]
        y, w, _ = self._groups(x, wt)
        per = self.g // self.grid.dim
        big = y.abs().reshape(-1, per * self.grid.dim).amax(1)
        best = torch.full_like(big, -1.0)
        best_s, best_d, best_a = torch.zeros_like(big), torch.zeros_like(big), torch.zeros_like(big)
        for delta in ((DELTA, -DELTA) if self.spec.shift else (0.0,)):
            top = float((self.grid.values + delta).abs().max())
            for f in trials:
                if grid:
                    _, b, a = self._pick(y, w, big / (f * top), delta, per)
                else:
                    b, a = self._lattice_fit(y, w, big / (f * top), delta, per)
                ok = a > 0
                score = torch.where(ok, b * b / _safe(a), torch.zeros_like(a))
                take = (score > best) & (b > 0)
                best = torch.where(take, score, best)
                best_s = torch.where(take, b / _safe(a), best_s)
                best_d = torch.where(take, torch.full_like(best_d, delta), best_d)
                best_a = torch.where(take, a, best_a)
        return best_s.reshape(rows, -1), best_d.reshape(rows, -1), best_a.reshape(rows, -1)

    def _lattice_err(self, y, w, db, delta, per):
        """The error Σ w (db·v − y)² of each sub-block (rows·subs) with every value at its nearest
        level v (no grid), at each of its candidate scales db (rows·subs × K)."""
        vals = self.grid.values + delta
        k = db.shape[1]
        yy = y.reshape(-1, per * self.grid.dim, 1)
        ww = w.reshape(-1, per * self.grid.dim, 1)
        s = db.unsqueeze(1)  # subs × 1 × K
        r = yy / _safe(s)
        if self.spec.shift:
            v = torch.clamp(torch.round(r - delta), -1, 1) + delta
        elif len(vals) == 3:
            v = torch.where(r > 34.0, 43.0, torch.where(r > 16.5, 25.0, 8.0))
        else:
            v = 2 * torch.clamp(torch.round((r - 1) * 0.5), 0, len(vals) - 1) + 1
        return (ww * (s * v - yy).square()).sum(1).reshape(-1, k)

    def _choose(self, y, w, s, l_top, per):
        """(l, delta, entries) per sub-block (rows × subs; per group): the code whose coded scale
        has the least error on the grid. The candidates, the codes within :data:`WINDOW` of the
        fitted scale `s`'s (rows × subs; IQ1_S with both shifts; `l_top`, the top sub-block: the top
        code only), are ranked by the error with each value at its nearest level (no grid), a lower
        bound of the grid's; the best :data:`EXACT` are searched on the grid in that order, each
        only in the sub-blocks where its bound is below the best grid error so far."""
        rows, subs = s.shape
        unit = self.d16 * self.spec.kappa
        l0 = torch.round((s / _safe(unit) - 1) * 0.5)
        off = torch.arange(-WINDOW, WINDOW + 1, device=s.device, dtype=torch.float32)
        ls = torch.clamp(l0.unsqueeze(2) + off, 0, self.lmax)  # rows × subs × K
        ls = torch.where(l_top.unsqueeze(2), torch.full_like(ls, self.lmax), ls).reshape(rows * subs, -1)
        dup = torch.cat([torch.zeros_like(ls[:, :1], dtype=torch.bool), ls[:, 1:] == ls[:, :-1]], 1)
        d_sub = self.d16.reshape(-1).repeat_interleave(subs)
        db = (d_sub.unsqueeze(1) * (2 * ls + 1)) * self.spec.kappa
        shifts = (DELTA, -DELTA) if self.spec.shift else (0.0,)
        errs = torch.stack([torch.where(dup, float("inf"), self._lattice_err(y, w, db, dl, per)) for dl in shifts], 2)
        errs = errs.reshape(rows * subs, -1)  # (l, shift) flattened, shift fastest
        n = min(EXACT[self.q.name], errs.shape[1])
        bound, order = errs.topk(n, 1, largest=False)  # ascending
        best_err = torch.full_like(bound[:, 0], float("inf"))
        best_l = torch.zeros_like(best_err)
        best_d = torch.zeros_like(best_err)
        best_e = torch.zeros(y.shape[0], dtype=torch.int64, device=y.device)
        steps = torch.arange(per, device=y.device)
        for i in range(n):
            todo = (bound[:, i] < best_err).nonzero().squeeze(1)  # sub-blocks where candidate i may win
            if not len(todo):
                break
            c = order[todo, i]
            l = ls[todo].gather(1, (c // len(shifts)).unsqueeze(1)).squeeze(1)
            dl = torch.tensor(shifts, device=s.device)[c % len(shifts)]
            gi = (todo.unsqueeze(1) * per + steps).reshape(-1)
            e, err = self._at(y[gi], w[gi], d_sub[todo] * (2 * l + 1) * self.spec.kappa, dl, per)
            take = err < best_err[todo]
            t = todo[take]
            best_err[t], best_l[t], best_d[t] = err[take], l[take], dl[take]
            tg = (t.unsqueeze(1) * per + steps).reshape(-1)
            best_e[tg] = e.reshape(-1, per)[take].reshape(-1)
        return best_l.reshape(rows, subs), best_d, best_e

    def _at(self, y, w, db, dl, per):
        """Entries at scale db with shift dl (both per sub-block), within reach, and each sub-block's
        error Σ w (db·c − y)²."""
        s = db.repeat_interleave(per)
        dg = dl.repeat_interleave(per)
        if self.spec.shift:  # each group searched at its own sub-block's shift
            e = torch.empty(y.shape[0], dtype=torch.int64, device=y.device)
            for sel, d in ((dg > 0, DELTA), (dg <= 0, -DELTA)):
                i = sel.nonzero().squeeze(1)
                if len(i):
                    e[i] = self.grid.nearest(y[i], w[i], s[i], d)
        else:
            e = self.grid.nearest(y, w, s, 0.0)
            if REACH and self.spec.reach:
                e = self._reach(e, y, w, s, per)
        c = self.grid.codes[e] + dg.unsqueeze(1)
        err = (w * (s.unsqueeze(1) * c - y).square()).sum(1).reshape(-1, per).sum(1)
        return e, err

    def round(self, c0: int, blk: torch.Tensor) -> torch.Tensor:
        """The values of columns c0:c0+32 of `blk` (the superblock as it stands: columns before c0
        as held) that the file should hold; :attr:`held` is what W' holds for them."""
        c1 = c0 + 32
        rows = blk.shape[0]
        x = blk.to(torch.float32)
        wt = self.weights(x)
        xs, ws = x[:, c0:c1], wt[:, c0:c1]
        y, w, sign = self._groups(xs, ws)
        per = self.g // self.grid.dim
        j = torch.arange(c0 // self.g, c1 // self.g, device=x.device).unsqueeze(0)
        top = self.top == j  # rows × subs
        if EXACT.get(self.q.name, 0):
            s, _, _ = self._fit(xs, ws, TRIALS[self.q.name], grid=False)
            l, dl, e = self._choose(y, w, s, top, per)
            d2l = self.d16 * (2 * l + 1)
            db = d2l * self.spec.kappa
            delta = dl.repeat_interleave(per).unsqueeze(1) if self.spec.shift else 0.0
        else:
            s, _, _ = self._fit(xs, ws, TRIALS[self.q.name])  # rows × sub-blocks of the step
            unit = self.d16 * self.spec.kappa
            l = torch.clamp(torch.round((s / _safe(unit) - 1) * 0.5), 0, self.lmax)
            l = torch.where(top, torch.full_like(l, self.lmax), l)
            d2l = self.d16 * (2 * l + 1)  # fp32(d·(2l + 1)): the dequantizer's product
            db = d2l * self.spec.kappa
            if self.spec.shift:  # both shifts at the coded scale, the one with the smaller error kept
                ep, errp = self._at(y, w, db.reshape(-1), torch.full_like(db.reshape(-1), DELTA), per)
                em, errm = self._at(y, w, db.reshape(-1), torch.full_like(db.reshape(-1), -DELTA), per)
                neg = (errm < errp).repeat_interleave(per)
                e = torch.where(neg, em, ep)
                delta = torch.where(neg, -DELTA, DELTA).unsqueeze(1)
            else:
                e, _ = self._at(y, w, db.reshape(-1), torch.zeros_like(db.reshape(-1)), per)
                delta = 0.0
        code = self.grid.codes[e] + delta  # groups × dim, the dequantizer's code (IQ1_S: g + δ)
        code = (code * sign).reshape(rows, -1, self.g)
        vals = (db.unsqueeze(2) * code).reshape(rows, -1)
        level = code if self.q.name != "IQ2_S" else torch.sign(code) * (2 * torch.round((code.abs() / 8 - 1) * 0.5) + 1)
        self.held = ((d2l / self.spec.fudge).unsqueeze(2) * level).reshape(rows, -1)
        return vals

    def _reach(self, e, y, w, s, per):
        """Entries `e` (groups) with every sub-block holding a code ≥ the spec's reach: in a
        sub-block without one, the group whose best such entry costs least more takes it."""
        top = self.grid.top[e].reshape(-1, per)
        bad = (top < self.spec.reach).all(1) & (s.reshape(-1, per)[:, 0] > 0)
        if not bool(bad.any()):
            return e
        gi = (bad.nonzero().squeeze(1).unsqueeze(1) * per + torch.arange(per, device=e.device)).reshape(-1)
        ok = self.grid.top >= self.spec.reach
        alt = self.grid.nearest(y[gi], w[gi], s[gi], 0.0, allowed=ok)
        cost = lambda ee: (w[gi] * (s[gi].unsqueeze(1) * self.grid.codes[ee] - y[gi]).square()).sum(1)  # noqa: E731
        extra = (cost(alt) - cost(e[gi])).reshape(-1, per)
        k = extra.argmin(1)
        pick = gi.reshape(-1, per).gather(1, k.unsqueeze(1)).squeeze(1)
        e = e.clone()
        e[pick] = alt.reshape(-1, per).gather(1, k.unsqueeze(1)).squeeze(1)
        return e
