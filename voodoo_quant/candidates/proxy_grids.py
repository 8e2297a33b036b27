"""The "proxy" sweep's held-level rounding of the grid types IQ3_S, IQ2_S, IQ1_S, IQ3_XXS and IQ2_XS:
a torch stand-in for libggml-base's quantizer of one superblock walked 32 columns at a time, whose
rounded values libggml-base's quantization of W' gives back (proxy_rounding.py has the others).

No grid type's quantization is a fixed point of libggml-base's quantizer: requantizing its own
dequantized output (same imatrix) changed 100 % of 32-blocks for every grid type (synthetic
256 × 1536, docs/lab/2026-12-07-proxy-grid-types.md). Stage 2 of ``quantize_row_*_impl``
(``ggml-quants.c``) stores ``d = fp16(max s / DIV · F)`` with a fudge factor F (IQ3_S 1.033,
IQ2_S 0.9875, IQ1_S 1.125, IQ3_XXS 1.0125, IQ2_XS 1) and codes each sub-block's scale
``l = nint((s/(max s/DIV) − 1)/2)``, s the sub-block's weighted least-squares fit on the search's
levels q (IQ3_S: the grid values 1..15; IQ2_S, IQ2_XS: 1, 3, 5 where the dequantizer stores 8, 25,
43; IQ3_XXS: 1..15 where it stores 4..62; IQ1_S: g ± 1/8, as stored). So its fit of stored values
finds F (IQ2, IQ3_XXS: and the ratio of stored magnitudes to levels) times their scale: the ruler moves.
W' holds instead (:attr:`HeldLevelProxy.held`) each value's *level* times ``fp32(d·(2l + 1)) / F``:
an exact fit on the levels whatever the search's weights (unlike IQ2_XXS's 8/r, proxy_rounding.py,
it does not depend on the superblock's σ²), which gives back ``s = fp32(d·(2l + 1)) / F``, the top
sub-block (at the top code) the ruler d, every other its l, and the dequantizer the walk's values.
Measured on libggml-base's own output held so: IQ1_S 100 % of 32-blocks given back, IQ3_XXS 99.4 %,
IQ3_S 97.6 %, IQ2_S 89.5 %, IQ2_XS 82.3 %; the misses are sub-blocks the quantizer's trial scales
cannot reach: they put a sub-block's largest value at level 13.2–16.8 (IQ3_S), 12–18 (IQ3_XXS) or
4.1–5.9 (IQ2_S, IQ2_XS), so a sub-block held with no value at level 13 (IQ3_S), 11 (IQ3_XXS) or 5
(IQ2) is searched again, and where it is the top one the whole superblock's ruler moves. The proxy
never leaves such a sub-block (:data:`REACH`): where its choice would, the group whose change to an
entry reaching that level costs least is changed. (IQ2_XXS's trials start from make_qp_quants' fit
instead; held levels came back for 68 % of its walk's blocks: it keeps its own proxy.)

When the walk reaches a superblock, each sub-block's scale is fitted on its values' nearest levels
(no grid), and the ruler d (fp16) puts the largest at the top code; that sub-block is coded at the
top code whatever the walk does to it. Per step (:meth:`HeldLevelProxy.round`) the candidate codes
of each sub-block are those within :data:`WINDOW` of its fitted scale's (IQ1_S: with either shift),
ranked by their error with every value at its nearest level (a lower bound of the error on the
grid); the best :data:`EXACT` are searched on the grid, each only where its bound is below the best
found, and the least error wins. On the grid, a group's entry at a scale is the nearest in the
quantizer's weighted norm, exactly: each value's nearest level makes a lattice point, the answer
where it is on the grid; the other groups are searched over the whole grid (one matrix product
against the table, then an argmin). Torch only; follows its inputs' device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core import qtypes as qt
from ..core.errors import QuantizationInputError
from ..quants.grids import table
from . import grid_probe
from .grid_tables import lattice


@dataclass(frozen=True)
class Spec:
    """One grid type as the held proxy sees it. A value is ``db · code · sign`` with
    ``db = fp32(d · (2l + 1)) · kappa`` (the dequantizer's product: IQ2_S ``d·(0.5 + l)·0.25``),
    code the grid entry's at the weight (IQ1_S: ``g + δ``, signed)."""

    table: str  # the dequantizer's grid (quants/grids.py)
    values: tuple  # the code of each lattice level (grid_tables.Lattice.levels indexes them)
    kappa: float
    fudge: float  # stage 2: d = fp16(max s / DIV · fudge)
    reach: float  # every sub-block holds a code at least this large, or the quantizer moves it (0: none)
    signs: str  # "free", "parity" (an even count of minus signs per 8) or "shift" (IQ1_S: ±1/8 per sub-block)


SPECS = {
    "IQ3_S": Spec("iq3s_grid", (1.0, 3.0, 5.0, 7.0, 9.0, 11.0, 13.0, 15.0), 1.0, 1.033, 13.0, "free"),
    "IQ2_S": Spec("iq2s_grid", (8.0, 25.0, 43.0), 0.125, 0.9875, 43.0, "free"),
    "IQ1_S": Spec("iq1s_grid", (-1.0, 0.0, 1.0), 1.0, 1.125, 0.0, "shift"),
    "IQ3_XXS": Spec("iq3xxs_grid", (4.0, 12.0, 20.0, 28.0, 36.0, 44.0, 52.0, 62.0), 0.25, 1.0125, 44.0, "parity"),
    "IQ2_XS": Spec("iq2xs_grid", (8.0, 25.0, 43.0), 0.125, 1.0, 43.0, "parity"),
}
DELTA = 0.125  # IQ1S_DELTA (ggml-common.h)
# the types whose superblock bytes HeldLevelProxy.written writes (ggml-common.h's block_iq3_xxs)
WRITES = frozenset({"IQ3_XXS"})
# the fits of a sub-block's scale on its values' nearest levels (no grid) at trial scales: the
# sub-block's largest magnitude at these fractions of the largest code, the fit explaining most
# kept; TRIALS for a step's candidate codes, REACH_TRIALS for the ruler (measured:
# docs/lab/2026-12-07-proxy-grid-types.md)
TRIALS = {"IQ3_S": (0.9, 1.0, 1.1), "IQ2_S": (0.85, 1.0, 1.15), "IQ1_S": (1.8, 2.4), "IQ3_XXS": (0.9, 1.0, 1.1),
          "IQ2_XS": (0.85, 1.0, 1.15)}
REACH_TRIALS = {"IQ3_S": (1.0,), "IQ2_S": (1.0,), "IQ1_S": (2.2,), "IQ3_XXS": (1.0,), "IQ2_XS": (1.0,)}
EXACT = {"IQ3_S": 2, "IQ2_S": 2, "IQ1_S": 1, "IQ3_XXS": 2, "IQ2_XS": 2}  # candidate codes searched on the grid
WINDOW = {"IQ3_S": 2, "IQ2_S": 2, "IQ1_S": 1, "IQ3_XXS": 2, "IQ2_XS": 2}  # candidate codes: the fitted scale's ± WINDOW
REACH = True  # keep every sub-block within reach of the quantizer's trials (module docstring)
CHUNK = 4096  # off-grid groups searched over the whole grid at once (their distances: 32 MB for IQ1_S)


def settings() -> str:
    """Everything that changes what these proxies round: part of the sweep's cache digest."""
    return (f"levels/1={','.join(sorted(SPECS))}:t{sorted(TRIALS.items())}:r{sorted(REACH_TRIALS.items())}"
            f":x{sorted(EXACT.items())}:w{sorted(WINDOW.items())}:{REACH}")


def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(torch.float32)


def _safe(s: torch.Tensor) -> torch.Tensor:
    return torch.where(s > 0, s, torch.ones_like(s))


class _Grid:
    """A type's grid on a device: its codes (entries × dim), each entry's largest |code|, its
    lattice (kmap: lattice point → entry) and the code of each level."""

    def __init__(self, name: str, device):
        spec = SPECS[name]
        self.codes = table(spec.table, device)
        self.dim = self.codes.shape[1]
        self.top = self.codes.abs().amax(1)
        self.lat = lattice(name, device)
        self.values = torch.tensor(spec.values, dtype=torch.float32, device=device)
        self.mids = (self.values[1:] + self.values[:-1]) * 0.5

    def level(self, r: torch.Tensor, delta: float = 0.0) -> torch.Tensor:
        """The index of each value's nearest level, `r` in units of the scale (codes + δ)."""
        return torch.bucketize(r - delta, self.mids)

    def nearest(self, y: torch.Tensor, w: torch.Tensor, s: torch.Tensor, delta: float = 0.0,
                allowed: torch.Tensor | None = None) -> torch.Tensor:
        """Per group (y, w: groups × dim; s: groups) the entry minimizing Σ w (s·(code + δ) − y)²:
        the nearest lattice point where it is on the grid, else the whole grid's nearest; with
        `allowed` (entries, bool) the nearest of those entries."""
        if allowed is not None:
            return self._exhaustive(y, w, s, delta, allowed)
        code = self.lat.code(self.level(y / _safe(s).unsqueeze(1), delta))
        e = self.lat.kmap[code]
        off = (e < 0) & (s > 0)
        e = torch.where(s > 0, e, torch.zeros_like(e))
        if bool(off.any()):
            i = off.nonzero().squeeze(1)
            e[i] = self._exhaustive(y[i], w[i], s[i], delta, None)
        return e

    def _exhaustive(self, y, w, s, delta, allowed):
        c = self.codes + delta
        basis = torch.cat([c * c, c], 1).T  # 2·dim × entries
        out = torch.empty(y.shape[0], dtype=torch.int64, device=y.device)
        for a in range(0, y.shape[0], CHUNK):
            yy, ww, ss = y[a:a + CHUNK], w[a:a + CHUNK], s[a:a + CHUNK]
            t = (-2.0 / _safe(ss)).unsqueeze(1)
            # Σ w·c² − (2/s)·Σ w·y·c = (Σ w (s·c − y)² − Σ w y²) / s²: one product per chunk
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


class HeldLevelProxy:
    """One superblock (rows × 256) of a type of :data:`SPECS` walked 32 columns at a time: each
    step rounded in torch to values the format stores (:meth:`round`), and :attr:`held`, what W'
    holds for them so that libggml-base's quantization of W' gives them back (module docstring).
    Made when the walk reaches the superblock, which fixes the ruler (:attr:`d16`, rows × 1) and
    the sub-block coded at the top code (:attr:`top`)."""

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
        self.per = self.g // self.grid.dim  # groups per sub-block
        x = blk.to(torch.float32)
        y, w, _ = self._groups(x, self.weights(x))
        s, _ = self._fit(y, w, REACH_TRIALS[self.q.name])
        s = s.reshape(rows, -1)
        self.top = s.argmax(1, keepdim=True)
        self.d16 = _fp16(s.gather(1, self.top) / (self.spec.kappa * (2 * self.lmax + 1)))
        self.held = self.code = None
        self._steps: dict[int, tuple] = {}  # c0 -> (l, entries, minus signs) of that step (written())

    def weights(self, blk: torch.Tensor) -> torch.Tensor:
        """libggml-base's search weight of each value of the superblock `blk` (rows × 256):
        ``qw · sqrt(σ² + x²)`` with σ² its mean square times grid_probe.SIGMA2_SCALE; without an
        imatrix x² (IQ2_S: σ²/4 + x²)."""
        s2 = grid_probe.SIGMA2_SCALE[self.q.name] * blk.square().mean(1, keepdim=True)
        if self.v is not None:
            return self.v.unsqueeze(0) * (s2 + blk * blk).sqrt()
        return 0.25 * s2 + blk * blk if self.q.name == "IQ2_S" else blk * blk

    def _groups(self, x: torch.Tensor, wt: torch.Tensor):
        """(y, w, sign), each groups × dim: the values of x (rows × 32k) as the search sees them,
        y their magnitudes (IQ1_S: the values, sign 1) and sign what the format stores. With parity
        signs, a group of 8 with an odd count of minus signs flips its cheapest (least w·x²), whose
        magnitude the search then sees negative (ggml-quants.c's rule)."""
        dim = self.grid.dim
        if self.spec.signs == "shift":
            return x.reshape(-1, dim), wt.reshape(-1, dim), torch.ones_like(x).reshape(-1, dim)
        y, sign = x.abs(), torch.where(x < 0, -1.0, 1.0)
        if self.spec.signs == "parity":
            x8, w8 = x.reshape(-1, 8), wt.reshape(-1, 8)
            odd = ((x8 < 0).sum(1) % 2) == 1
            flip = torch.nn.functional.one_hot((w8 * x8 * x8).argmin(1), 8).bool() & odd.unsqueeze(1)
            flip = flip.reshape(x.shape)
            y, sign = torch.where(flip, -y, y), torch.where(flip, -sign, sign)
        return y.reshape(-1, dim), wt.reshape(-1, dim), sign.reshape(-1, dim)

    def _lattice(self, y, w, s, delta):
        """(Σ w·v·y, Σ w·v²) per sub-block with every value at its nearest level v at the scales s
        (sub-blocks × K): each sub-blocks × K."""
        yy = y.reshape(-1, self.g, 1)
        r = yy / _safe(s).unsqueeze(1)
        v = self.grid.values[self.grid.level(r, delta)] + delta
        wv = w.reshape(-1, self.g, 1) * v
        return (wv * yy).sum(1), (wv * v).sum(1)

    def _fit(self, y, w, trials):
        """(s, delta) per sub-block: the least-squares scale of its values' nearest levels at the
        trial whose fit explains most (largest (Σ w·v·y)² / Σ w·v²), and IQ1_S's shift."""
        big = y.abs().reshape(-1, self.g).amax(1, keepdim=True)
        shifts = (DELTA, -DELTA) if self.spec.signs == "shift" else (0.0,)
        f = torch.tensor(trials, dtype=torch.float32, device=y.device)
        fits = [self._lattice(y, w, big / (f * float((self.grid.values + dl).abs().max())), dl) for dl in shifts]
        b = torch.cat([p[0] for p in fits], 1)
        a = torch.cat([p[1] for p in fits], 1)
        score = torch.where((a > 0) & (b > 0), b * b / _safe(a), torch.full_like(a, -1.0))
        k = score.argmax(1, keepdim=True)
        s = torch.where(score.gather(1, k) > 0, b.gather(1, k) / _safe(a.gather(1, k)), torch.zeros_like(big))
        delta = torch.tensor(shifts, device=y.device)[k.squeeze(1) // len(trials)]
        return s.squeeze(1), delta

    def _choose(self, y, w, s, l_top):
        """(l, delta, entries): per sub-block (rows · subs) the code whose coded scale has the least
        error on the grid, its shift, and the groups' entries there. The candidates, the codes
        within :data:`WINDOW` of the fitted scale `s`'s (`l_top`: the top sub-block, which takes
        the top code), are ranked by their lattice error (every value at its nearest level), a lower
        bound of the grid's; the best :data:`EXACT` are searched on the grid in that order, each
        where its bound is below the best grid error so far."""
        per, subs = self.per, s.shape[0]
        unit = self.d16.repeat_interleave(subs // self.d16.shape[0], 0).squeeze(1)
        l0 = torch.round((s / _safe(unit * self.spec.kappa) - 1) * 0.5)
        win = WINDOW[self.q.name]
        off = torch.arange(-win, win + 1, device=s.device, dtype=torch.float32)
        ls = torch.clamp(l0.unsqueeze(1) + off, 0, self.lmax)  # subs × K
        ls = torch.where(l_top.unsqueeze(1), torch.full_like(ls, self.lmax), ls)
        dup = torch.cat([torch.zeros_like(ls[:, :1], dtype=torch.bool), ls[:, 1:] == ls[:, :-1]], 1)
        db = unit.unsqueeze(1) * (2 * ls + 1) * self.spec.kappa
        shifts = (DELTA, -DELTA) if self.spec.signs == "shift" else (0.0,)
        errs = []
        for dl in shifts:  # Σ w (db·v − y)² = db²·a − 2·db·b + Σ w y²
            b, a = self._lattice(y, w, db, dl)
            errs.append(torch.where(dup, float("inf"), db * db * a - 2 * db * b))
        errs = torch.stack(errs, 2).reshape(subs, -1)  # (code, shift), the shift fastest
        bound, order = errs.topk(min(EXACT[self.q.name], errs.shape[1]), 1, largest=False)
        best_err = torch.full((subs,), float("inf"), device=s.device)
        best_l, best_d = torch.zeros_like(best_err), torch.zeros_like(best_err)
        best_e = torch.zeros(y.shape[0], dtype=torch.int64, device=y.device)
        steps = torch.arange(per, device=y.device)
        sh = torch.tensor(shifts, device=s.device)
        for i in range(bound.shape[1]):
            todo = (bound[:, i] < best_err).nonzero().squeeze(1)
            if not len(todo):
                break
            c = order[todo, i]
            l = ls[todo].gather(1, (c // len(shifts)).unsqueeze(1)).squeeze(1)
            gi = (todo.unsqueeze(1) * per + steps).reshape(-1)
            e, err = self._at(y[gi], w[gi], unit[todo] * (2 * l + 1) * self.spec.kappa, sh[c % len(shifts)])
            take = err < best_err[todo]
            t = todo[take]
            best_err[t], best_l[t], best_d[t] = err[take], l[take], sh[c % len(shifts)][take]
            best_e[(t.unsqueeze(1) * per + steps).reshape(-1)] = e.reshape(-1, per)[take].reshape(-1)
        return best_l, best_d, best_e

    def _at(self, y, w, db, dl):
        """The groups' entries at scale db with shift dl (both per sub-block), every sub-block
        within reach, and each sub-block's error Σ w (db·c − y)² (relative to Σ w y²)."""
        per = self.per
        s, dg = db.repeat_interleave(per), dl.repeat_interleave(per)
        if self.spec.signs == "shift":  # each group at its sub-block's shift
            e = torch.empty(y.shape[0], dtype=torch.int64, device=y.device)
            for sel, d in ((dg > 0, DELTA), (dg <= 0, -DELTA)):
                i = sel.nonzero().squeeze(1)
                if len(i):
                    e[i] = self.grid.nearest(y[i], w[i], s[i], d)
        else:
            e = self.grid.nearest(y, w, s)
            if REACH and self.spec.reach:
                e = self._reach(e, y, w, s)
        c = self.grid.codes[e] + dg.unsqueeze(1)
        err = (w * c * (s.unsqueeze(1) * c - 2 * y)).sum(1) * s
        return e, err.reshape(-1, per).sum(1)

    def _reach(self, e, y, w, s):
        """Entries `e` (groups) with every sub-block holding a code ≥ the spec's reach: in a
        sub-block without one, the group whose best such entry costs least more takes it."""
        per = self.per
        top = self.grid.top[e].reshape(-1, per)
        bad = (top < self.spec.reach).all(1) & (s.reshape(-1, per)[:, 0] > 0)
        if not bool(bad.any()):
            return e
        gi = (bad.nonzero().squeeze(1).unsqueeze(1) * per + torch.arange(per, device=e.device)).reshape(-1)
        alt = self.grid.nearest(y[gi], w[gi], s[gi], allowed=self.grid.top >= self.spec.reach)

        def cost(ee):
            return (w[gi] * (s[gi].unsqueeze(1) * self.grid.codes[ee] - y[gi]).square()).sum(1)

        k = (cost(alt) - cost(e[gi])).reshape(-1, per).argmin(1, keepdim=True)
        e = e.clone()
        e[gi.reshape(-1, per).gather(1, k).squeeze(1)] = alt.reshape(-1, per).gather(1, k).squeeze(1)
        return e

    def round(self, c0: int, blk: torch.Tensor) -> torch.Tensor:
        """The values of columns c0:c0+32 of `blk` (the superblock as it stands: columns before c0
        as held) that the file should hold, ``fp32(d·(2l + 1))·kappa · code · sign``; :attr:`held`
        is what W' holds for them, ``fp32(d·(2l + 1)) / F · level · sign``, :attr:`code` the
        dequantizer's signed codes (IQ1_S: g + δ)."""
        c1 = c0 + 32
        rows = blk.shape[0]
        x = blk.to(torch.float32)
        wt = self.weights(x)
        y, w, sign = self._groups(x[:, c0:c1], wt[:, c0:c1])
        subs = (c1 - c0) // self.g
        s, _ = self._fit(y, w, TRIALS[self.q.name])
        j = torch.arange(c0 // self.g, c1 // self.g, device=x.device).unsqueeze(0)
        l, dl, e = self._choose(y, w, s, (self.top == j).reshape(-1))
        d2l = self.d16 * (2 * l.reshape(rows, subs) + 1)  # fp32(d·(2l + 1)): the dequantizer's product
        code = self.grid.codes[e] + dl.repeat_interleave(self.per).unsqueeze(1)  # IQ1_S: g + δ
        code = (code * sign).reshape(rows, subs, self.g)
        vals = ((d2l * self.spec.kappa).unsqueeze(2) * code).reshape(rows, -1)
        level = grid_probe.levels(code, self.q)  # the quantizer's levels (IQ1_S, IQ3_S: the codes)
        self.held = ((d2l / self.spec.fudge).unsqueeze(2) * level).reshape(rows, -1)
        self.code = code.reshape(rows, -1)
        self._steps[c0] = (l.reshape(rows, subs), e.reshape(rows, -1), (sign < 0).reshape(rows, -1))
        return vals

    def written(self) -> bytes:
        """The superblock's bytes in the format, from what :meth:`round` chose at every step
        (IQ3_XXS only: :data:`WRITES`): dequantized, each value is the step's rounding to the bit."""
        if self.q.name not in WRITES:
            raise QuantizationInputError(f"no byte writer for {self.q.name}'s held levels")
        if sorted(self._steps) != list(range(0, 256, 32)):
            raise QuantizationInputError("the superblock's steps were not all rounded")
        rows = self.d16.shape[0]
        dev = self.d16.device
        out = torch.zeros(rows, self.q.type_size, dtype=torch.uint8, device=dev)
        bits = self.d16.reshape(rows).to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
        out[:, 0], out[:, 1] = (bits & 0xFF).to(torch.uint8), (bits >> 8).to(torch.uint8)
        shift8 = torch.arange(8, device=dev)
        shift7 = torch.arange(0, 28, 7, device=dev)
        for ib, c0 in enumerate(range(0, 256, 32)):
            l, e, neg = self._steps[c0]
            out[:, 2 + 8 * ib:10 + 8 * ib] = e.to(torch.uint8)  # a grid index per 4 weights
            mask = (neg.reshape(rows, 4, 8).to(torch.int64) << shift8).sum(2) & 127  # ksigns: the 8th is parity
            aux = (mask << shift7).sum(1) | (l.reshape(rows).to(torch.int64) << 28)
            for k in range(4):
                out[:, 66 + 4 * ib + k] = ((aux >> (8 * k)) & 0xFF).to(torch.uint8)
        return out.cpu().numpy().tobytes()
