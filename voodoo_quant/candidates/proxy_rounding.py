"""A torch stand-in for libggml-base's rounding inside the compensation walk: the oracle of the
``"proxy"`` sweep (compensation_walk.py), which never calls libggml-base while it walks.

Every walk that asks libggml-base how a step rounds pays one quantization's work in the walk and
one more for the candidate's bytes, so it costs at least 2× a plain candidate. The proxy sweep
rounds each 32-column step in torch instead, with a cheap model of the type's quantizer; the
candidate's bytes are still ``ggml_quantize_chunk(W', imatrix)`` of the W' the walk leaves. Per
type (:data:`TYPES`):

- **Q8_0** (:func:`round_q8_0`): ``quantize_row_q8_0_ref`` itself (the imatrix is not read by
  it): ``d = amax/127`` stored as fp16, codes ``roundf(x/d)``. The values are the quantizer's to the
  bit, so the error the walk passes on is the file's and the walk needs no C call.
- **Q4_K, Q5_K** (:class:`KQuantScales`): when the walk reaches a superblock, each 32-value
  sub-block's scale and min are fitted in torch (``make_qkx3_quants``'s rule, the weighted
  least-squares scale and min of the codes rounded at a few trial scales, the min kept ≤ 0,
  with the quantizer's weights ``qw · sqrt(σ² + x²)``), then coded to 6 bits against fp16
  ``d = max scale/63`` and ``dmin = max min/63`` (the format's storage). Every step of the
  superblock is rounded to the nearest code at those scales, and W' holds the rounded values:
  values the format represents, with one sub-block's scale (and min) at the top code, so that
  libggml-base's fit of them finds them again.
- **IQ2_XXS** (:class:`HeldGridProxy`, :data:`GRID_MODE` ``"held"``): each step's groups of 8
  take their signs from the values (an odd count of minus signs: the one costing least is
  flipped, as the format stores an even count) and the grid entry nearest to the magnitudes in
  the quantizer's weighted norm at a few trial scales (one matrix product against the grid
  table, then an argmin), the scale coded against a ruler fixed when the walk reaches the
  superblock (``l = clamp(nint(s/(d/4) − 0.5), 0, 15)``, the largest sub-block at 15), the
  entries chosen again at the coded scale. An IQ2_XXS quantization is not a fixed point of the
  quantizer (its fit of stored values finds r/8 times their scale), so W' holds the values times
  8/r, which libggml-base's fit maps back to them. ``"predicted"`` (:class:`GridProxy`) instead
  predicts libggml-base's rounding of W' with its scale coded against the ruler of the
  superblock as it stands, W' keeping the updated weights (measured worse: its search is not
  libggml-base's neighbour-list search, docs/lab/2026-12-07-grid-search-in-torch.md, so the
  error passed on is not the file's; docs/lab/2026-12-07-proxy-sweep.md).
- **IQ3_S, IQ2_S, IQ1_S, IQ3_XXS, IQ2_XS** (:class:`proxy_grids.HeldLevelProxy`, the types of
  :data:`LEVELS`): as IQ2_XXS, but W' holds each value's level times the coded scale over stage 2's
  fudge factor, an exact fit for libggml-base's search whatever its weights (proxy_grids.py).

The module is torch only and follows its inputs' device.
"""

from __future__ import annotations

import numpy as np
import torch

from ..core import qtypes as qt
from ..core.errors import QuantizationInputError
from ..quants.grids import table
from . import grid_probe, proxy_grids

KQUANTS = {"Q4_K": 15, "Q5_K": 31}  # nmax of the codes
GRIDS = frozenset({"IQ2_XXS"})
# the grid types rounded by proxy_grids.HeldLevelProxy (of proxy_grids.SPECS): those measured to
# leave no more output error than the ruled walk (docs/lab/2026-12-07-proxy-grid-types.md); the
# others of SPECS are walked as "ruled" walks them
LEVELS = frozenset({"IQ3_S", "IQ2_S", "IQ1_S", "IQ3_XXS", "IQ2_XS"})
TYPES = frozenset({"Q8_0", *KQUANTS, *GRIDS, *LEVELS})
VERSION = "proxy/2"  # part of the sweep's cache digest: a changed rounding never reads old candidates
# the K-quant fit's trial inverse scales: (nmax + r) / (max − min) for these r (make_qkx3_quants
# tries 37 of them from −0.9 by 0.05; fewer cost less, measured in bench/compensation_objective.py)
K_TRIALS = (-0.9, -0.5, -0.2, 0.0, 0.25, 0.5, 0.85)
# the grid search's trial scales: the sub-block's largest magnitude over these levels (libggml's
# IQ2_XXS trials span about 5.9–7.5 levels from its make_qp_quants start)
GRID_TRIALS = (5.9, 6.4, 6.9, 7.4)
# how the ruler sees the superblock's sub-blocks not yet walked: "grid", each fitted on the levels
# of a grid search of the whole superblock done when the walk reaches it; "lattice", on the
# nearest level of each weight (no grid) at its own least-squares scale, redone every step
LATER = "grid"
# "held": the grid steps rounded to stored values that W' holds (HeldGridProxy); "predicted": the
# walk's prediction of how libggml-base rounds W' (GridProxy, W' keeps the updated weights)
GRID_MODE = "held"
# the trials of the search that fixes a held superblock's ruler when the walk reaches it
REACH_TRIALS = (6.6,)
# entries per group the trials choose among: the nearest to its values at the middle trial scale
# (0: all; measured against all in bench/compensation_objective.py)
CANDIDATES = 0
SEARCH_GROUPS = 2048  # groups of 8 searched at once (their distances to the 256 entries: 2 MB each for A and B)
# the K-quants' min fitted again at the sub-block's coded scale before it is coded (measured)
REFIT_MIN = True


def supports(qtype: str | qt.QType) -> bool:
    return qt.get(qtype).name in TYPES


def settings() -> str:
    """The proxy's settings, every one that changes what it rounds: part of the sweep's cache digest."""
    return (f"{VERSION}={','.join(sorted(TYPES))}:k{K_TRIALS}:{REFIT_MIN}:g{GRID_TRIALS}:{GRID_MODE}:{LATER}"
            f":{proxy_grids.settings()}")


def holds(qtype: str | qt.QType) -> bool:
    """Whether the walk's W' holds the proxy's values of a grid type (:func:`grid_proxy`'s ``held``)
    rather than the updated weights."""
    name = qt.get(qtype).name
    return name in LEVELS or (name in GRIDS and GRID_MODE == "held")


def grid_proxy(blk: torch.Tensor, q: str | qt.QType, v: torch.Tensor | None):
    """The proxy of one grid superblock `blk` (rows × 256) as the walk reaches it, with imatrix
    slice `v`: :class:`proxy_grids.HeldLevelProxy` for :data:`LEVELS`, IQ2_XXS's
    :class:`HeldGridProxy` or :class:`GridProxy` (:data:`GRID_MODE`)."""
    name = qt.get(q).name
    if name in LEVELS:
        return proxy_grids.HeldLevelProxy(blk, q, v)
    return (HeldGridProxy if GRID_MODE == "held" else GridProxy)(blk, q, v)


def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(torch.float32)


def _roundf(v: torch.Tensor) -> torch.Tensor:
    """C's ``roundf``: to nearest, halves away from zero (torch.round takes halves to even)."""
    r = torch.round(v)
    t = torch.trunc(v)
    return torch.where((v - t).abs() == 0.5, t + torch.sign(v), r)


def round_q8_0(x: torch.Tensor) -> torch.Tensor:
    """The values libggml-base's Q8_0 gives `x` (rows × 32k float32): per block of 32,
    ``fp16(d) · roundf(x · (1/d))`` with ``d = amax/127`` (``quantize_row_q8_0_ref``)."""
    rows, n = x.shape
    if n % 32:
        raise QuantizationInputError(f"Q8_0 blocks of 32 do not tile {n} columns")
    b = x.reshape(rows, n // 32, 32)
    d = b.abs().amax(2, keepdim=True) / 127.0
    inv = torch.where(d != 0, 1.0 / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(d))
    return (_fp16(d) * _roundf(b * inv)).reshape(rows, n)


def kquant_weights(x: torch.Tensor, v: torch.Tensor | None) -> torch.Tensor:
    """The weight ``quantize_row_q4_K_impl`` / ``q5_K_impl`` gives each value of superblocks x
    (rows × 256): ``qw · sqrt(σ² + x²)`` with σ² = 2 · mean x², or ``sqrt(σ²) + |x|`` without an
    imatrix."""
    s2 = 2.0 * x.square().mean(1, keepdim=True)
    if v is None:
        return s2.sqrt() + x.abs()
    return v.unsqueeze(0) * (s2 + x * x).sqrt()


class KQuantScales:
    """A Q4_K/Q5_K superblock's 6-bit coded scales and mins, fitted in torch from `blk` (rows ×
    256, the superblock as the walk reaches it) with imatrix slice `v` (256 values or None), and
    the rounding of any of its columns to the nearest code at them (:meth:`round`)."""

    def __init__(self, blk: torch.Tensor, q: str | qt.QType, v: torch.Tensor | None):
        name = qt.get(q).name
        if name not in KQUANTS:
            raise QuantizationInputError(f"no K-quant proxy for {name}")
        rows, width = blk.shape
        if width != 256:
            raise QuantizationInputError(f"a {name} superblock is 256 wide, got {width}")
        self.nmax = nmax = KQUANTS[name]
        x = blk.to(torch.float32)
        w = kquant_weights(x, v).reshape(rows, 8, 1, 32)
        xs = x.reshape(rows, 8, 1, 32)
        lo = torch.clamp_max(xs.amin(3, keepdim=True), 0.0)
        hi = xs.amax(3, keepdim=True)
        span = hi - lo
        flat = span <= 0
        span = torch.where(flat, torch.ones_like(span), span)
        r = torch.tensor(K_TRIALS, dtype=torch.float32, device=x.device).reshape(1, 1, -1, 1)
        L = torch.clamp(torch.round((nmax + r) / span * (xs - lo)), 0, nmax)  # rows × 8 × trials × 32
        sw, sx = w.sum(3), (w * xs).sum(3)
        sl, sl2, sxl = (w * L).sum(3), (w * L * L).sum(3), (w * xs * L).sum(3)
        D = sw * sl2 - sl * sl
        ok = D > 0
        Ds = torch.where(ok, D, torch.ones_like(D))
        scale = (sw * sxl - sx * sl) / Ds
        mn = (sl2 * sx - sl * sxl) / Ds
        pos = mn > 0  # the format subtracts a min ≥ 0: refit the scale alone
        scale = torch.where(pos, sxl / torch.where(sl2 > 0, sl2, torch.ones_like(sl2)), scale)
        mn = torch.where(pos | ~ok, torch.zeros_like(mn), mn)
        scale = torch.where(ok, scale, torch.zeros_like(scale))
        err = (w * (scale.unsqueeze(3) * L + mn.unsqueeze(3) - xs).square()).sum(3)
        best = err.argmin(2, keepdim=True)
        s = torch.clamp_min(scale.gather(2, best).squeeze(2), 0.0)  # rows × 8
        m = torch.clamp_min(-mn.gather(2, best).squeeze(2), 0.0)
        s = torch.where(flat.squeeze(3).squeeze(2), torch.zeros_like(s), s)
        m = torch.where(flat.squeeze(3).squeeze(2), torch.clamp_min(-xs.amin(3).squeeze(2), 0.0), m)
        sw = w.sum(3).squeeze(2)  # rows × 8: each sub-block's weight in the scales' fit
        self.d_sub = self._code(s, sw)  # rows × 8: d·sc
        if REFIT_MIN:  # the best min at the coded scale: codes rounded at it, min = Σw(d·L − x)/Σw
            d = self.d_sub.unsqueeze(2)
            x3, w3 = xs.squeeze(2), w.squeeze(2)
            live = d > 0
            ds = torch.where(live, d, torch.ones_like(d))
            L = torch.clamp(torch.round((x3 + m.unsqueeze(2)) / ds), 0, nmax)
            fit = ((w3 * (d * L - x3)).sum(2) / torch.where(sw > 0, sw, torch.ones_like(sw)))
            m = torch.where(live.squeeze(2) & (sw > 0), torch.clamp_min(fit, 0.0), m)
        self.m_sub = self._code(m, sw)  # dmin·mn

    @staticmethod
    def _code(s: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
        """s (rows × 8, ≥ 0) coded as the format stores it: fp16 d and 6-bit codes l, the value
        ``fp16(d) · l`` (the dequantizer's product). d is the weighted (`sw`) least-squares fit
        of s on the codes of the trial ``1/d = (63 + k/10)/max s`` (k = −4..4) whose codes fit
        best (``make_qp_quants``'s rule, without its code-by-code refinement), so the largest
        s has code 63 and libggml-base's fit of the coded values finds the same d."""
        mx = s.amax(1, keepdim=True)
        safe = torch.where(mx > 0, mx, torch.ones_like(mx))
        k = torch.arange(-4, 5, dtype=s.dtype, device=s.device).reshape(1, 1, -1) / 10.0
        inv = (63.0 + k) / safe.unsqueeze(2)  # rows × 1 × trials
        L = torch.clamp(torch.round(s.unsqueeze(2) * inv), 0, 63)  # rows × 8 × trials
        e = (sw.unsqueeze(2) * (s.unsqueeze(2) - L / inv).square()).sum(1)  # rows × trials
        L = L.gather(2, e.argmin(1).reshape(-1, 1, 1).expand(-1, s.shape[1], 1)).squeeze(2)
        den = (sw * L * L).sum(1, keepdim=True)
        d = torch.where(den > 0, (sw * s * L).sum(1, keepdim=True) / torch.where(den > 0, den, torch.ones_like(den)),
                        torch.zeros_like(den))
        d16 = _fp16(torch.where(mx > 0, d, torch.zeros_like(d)))
        return d16 * L

    def round(self, x: torch.Tensor, c0: int, c1: int) -> torch.Tensor:
        """The values columns c0:c1 of the superblock (x: rows × (c1 − c0), 32-aligned) take at
        the coded scales: ``d·sc · q − dmin·mn`` with q the nearest code in 0..nmax."""
        j0, j1 = c0 // 32, (c1 + 31) // 32
        d = self.d_sub[:, j0:j1].repeat_interleave(32, 1)[:, :c1 - c0]
        m = self.m_sub[:, j0:j1].repeat_interleave(32, 1)[:, :c1 - c0]
        live = d > 0
        code = torch.clamp(torch.round((x + m) / torch.where(live, d, torch.ones_like(d))), 0, self.nmax)
        return torch.where(live, d * code - m, -m)


def _grid(name: str, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, levels) of grid type `name` (entries × 8): the dequantizer's magnitudes and the
    search's odd levels (grid_probe.levels)."""
    g = table({"IQ2_XXS": "iq2xxs_grid"}[name], device)
    return g, grid_probe.levels(g, qt.get(name)).to(torch.float32)


class GridProxy:
    """One IQ2_XXS superblock (rows × 256) walked 32 columns at a time, rounded in torch.

    Made when the walk reaches the superblock; :meth:`round` gives a step's values from the
    superblock as it stands then. The step's grid entries and signs come from :func:`search`,
    its scale s is their weighted least-squares fit, and s is coded against the ruler
    ``max s / 31`` over the superblock's sub-blocks: those walked as fitted at their step, the
    step's, and the later ones fitted on the current values (:data:`LATER`)."""

    def __init__(self, blk: torch.Tensor, q: str | qt.QType, v: torch.Tensor | None):
        self._bind(q, v, blk.device)
        rows = blk.shape[0]
        self.s = torch.zeros(rows, blk.shape[1] // self.g, dtype=torch.float32, device=blk.device)
        self.first = None
        if LATER == "grid":  # one search of the whole superblock: the first step's, and the others' levels
            x = blk.to(torch.float32)
            wt = self.weights(x)
            self.first = self.search(x, wt)
            self.later_levels = self.first[1]

    def _bind(self, q: str | qt.QType, v: torch.Tensor | None, device) -> None:
        """The type's ruler rule, the importance vector and the grid, on `device`."""
        self.q = qt.get(q)
        if self.q.name not in GRIDS:
            raise QuantizationInputError(f"no grid proxy for {self.q.name}")
        self.div, self.lmax, self.g, _ = grid_probe.RULES[self.q.name]
        self.v = v
        self.codes, self.levels = _grid(self.q.name, device)

    def weights(self, blk: torch.Tensor) -> torch.Tensor:
        """The search's weight of each value of the superblock `blk` (rows × 256):
        ``qw · sqrt(σ² + x²)`` with σ² its mean square (grid_probe.search_weights), or x²
        without an imatrix."""
        if self.v is None:
            return blk * blk
        s2 = grid_probe.SIGMA2_SCALE[self.q.name] * blk.square().mean(1, keepdim=True)
        return self.v.unsqueeze(0) * (s2 + blk * blk).sqrt()

    def search(self, x: torch.Tensor, wt: torch.Tensor, basis: torch.Tensor | None = None,
               at: torch.Tensor | None = None, then=None, trials: tuple = ()):
        """Per 32-value sub-block of x (rows × 32k) with weights wt: (signed dequantizer codes,
        signed levels, s per sub-block (rows × k)). The grid entry of each group of 8 minimizes
        Σ wt (s·b − |x|)² with b the entry in `basis` (default: the search's levels; the
        dequantizer's codes give s in the dequantizer's units) at each trial scale; the trial
        whose fit explains most (largest (Σ wt·|x|·b)² / Σ wt·b²) is kept, and the entries are
        chosen once more at its fitted scale and fitted again (the order of libggml-base's
        search). With `at` (rows × k) the entries are chosen at that scale alone, and s is it;
        with `then`, a function of (the best trial's fitted s, the rows' slice) giving each
        sub-block's scale, the entries are chosen once more at that scale, and s is it.
        `trials`: the trial scales' levels for the largest magnitude (default :data:`GRID_TRIALS`).
        Done :data:`SEARCH_GROUPS` groups at a time, so that each chunk's distances to the grid
        stay in cache through its trials."""
        rows, n = x.shape
        step = max(1, SEARCH_GROUPS * 8 // n)
        if rows > step:
            parts = [self._search(x[r:r + step], wt[r:r + step], basis, None if at is None else at[r:r + step],
                                  then, trials, slice(r, r + step)) for r in range(0, rows, step)]
            return tuple(torch.cat(p) for p in zip(*parts))
        return self._search(x, wt, basis, at, then, trials, slice(0, rows))

    def _search(self, x, wt, basis, at, then, trials, rows_slice):
        rows, n = x.shape
        xg = x.reshape(-1, 8)
        wg = wt.reshape(-1, 8)
        neg = xg < 0
        mag = xg.abs()
        odd = (neg.sum(1) % 2) == 1
        flip = torch.nn.functional.one_hot((wg * xg * xg).argmin(1), 8).bool() & odd.unsqueeze(1)
        mag = torch.where(flip, -mag, mag)
        neg = neg ^ flip
        lev = self.levels if basis is None else basis
        A = wg @ (lev * lev).T  # Σ w·b² per (group, entry)
        Bm = (wg * mag) @ lev.T  # Σ w·|x|·b
        per = self.g // 8  # groups per sub-block
        unit = float(lev.amax() / self.levels.amax())  # the basis' largest over the levels' largest
        sub = mag.reshape(-1, per * 8).amax(1)
        cand = None
        if CANDIDATES and CANDIDATES < A.shape[1]:  # each group's nearest entries at the middle trial
            mid = sub / (float(np.median(trials or GRID_TRIALS)) * unit)
            t = (2.0 / torch.where(mid > 0, mid, torch.ones_like(mid))).repeat_interleave(per).unsqueeze(1)
            cand = torch.addcmul(A, Bm, t, value=-1.0).topk(CANDIDATES, 1, largest=False, sorted=False).indices
            A, Bm = A.gather(1, cand), Bm.gather(1, cand)

        def pick(s):
            t = (2.0 / torch.where(s > 0, s, torch.ones_like(s))).repeat_interleave(per).unsqueeze(1)
            idx = torch.addcmul(A, Bm, t, value=-1.0).argmin(1)
            a = A.gather(1, idx.unsqueeze(1)).reshape(-1, per).sum(1)
            b = Bm.gather(1, idx.unsqueeze(1)).reshape(-1, per).sum(1)
            return (idx if cand is None else cand.gather(1, idx.unsqueeze(1)).squeeze(1)), a, b

        if at is not None:
            idx, _, _ = pick(at.reshape(-1))
            s = at.reshape(-1)
        else:
            best_score = torch.full_like(sub, -1.0)
            best_s = torch.zeros_like(sub)
            for r in trials or GRID_TRIALS:
                _, a, b = pick(sub / (r * unit))
                score = torch.where(a > 0, b * b / torch.where(a > 0, a, torch.ones_like(a)), torch.zeros_like(a))
                take = score > best_score
                best_score = torch.where(take, score, best_score)
                best_s = torch.where(take, b / torch.where(a > 0, a, torch.ones_like(a)), best_s)
            if then is not None:
                s = then(torch.clamp_min(best_s, 0.0).reshape(rows, -1), rows_slice).reshape(-1)
                idx, _, _ = pick(s)
            else:
                idx, a, b = pick(best_s)
                s = torch.where((a > 0) & (sub > 0), b / torch.where(a > 0, a, torch.ones_like(a)), torch.zeros_like(a))
        sign = torch.where(neg, -1.0, 1.0)
        code = (self.codes[idx] * sign).reshape(rows, n)
        levels = (self.levels[idx] * sign).reshape(rows, n)
        return code, levels, torch.clamp_min(s, 0.0).reshape(rows, -1)

    def _later(self, x: torch.Tensor, wt: torch.Tensor, c1: int) -> torch.Tensor:
        """s of the sub-blocks after c1 as the superblock stands (x, wt: its columns c1:)."""
        if x.shape[1] == 0:
            return x[:, :0]
        if LATER == "grid":
            lev = self.later_levels[:, c1:]
        else:  # each weight's nearest odd level (1, 3, 5) at the least-squares scale of its largest at 5
            a = x.abs().reshape(x.shape[0], -1, self.g)
            s0 = a.amax(2, keepdim=True) / 5.0
            lev = (2 * torch.clamp(torch.round((a / torch.where(s0 > 0, s0, torch.ones_like(s0)) - 1) / 2), 0, 2) + 1)
            lev = (lev * torch.sign(x).reshape(lev.shape)).reshape(x.shape)
        return grid_probe.fit(x, lev, wt, self.g)

    def round(self, c0: int, blk: torch.Tensor) -> torch.Tensor:
        """The values of columns c0:c0+32 of `blk`, the superblock as it stands (rows × 32,
        float32): ``fp16(d)·(0.5 + l)·0.25 · code`` with ``d = max s/31`` and
        ``l = clamp(nint((s/d − 1)/2), 0, 15)`` (the dequantizer's product, left to right)."""
        c1 = c0 + 32
        x = blk.to(torch.float32)
        wt = self.weights(x)
        if c0 == 0 and self.first is not None:
            code, _, s_now = self.first[0][:, :32], None, self.first[2][:, :1]
        else:
            code, _, s_now = self.search(x[:, c0:c1], wt[:, c0:c1])
        j0 = c0 // self.g
        later = self._later(x[:, c1:], wt[:, c1:], c1)
        m = torch.cat([self.s[:, :j0], s_now, later], 1).amax(1, keepdim=True)
        self.s[:, j0:j0 + 1] = s_now
        d = m / self.div
        inv = torch.where(d > 0, 1.0 / torch.where(d > 0, d, torch.ones_like(d)), torch.zeros_like(d))
        l = torch.clamp(torch.round(0.5 * (inv * s_now - 1)), 0, self.lmax)
        db = _fp16(d) * (0.5 + l) * 0.25
        return (db * code).to(torch.float32)


def as_vector(v, device) -> torch.Tensor | None:
    """An imatrix slice (numpy or torch, or None) as a float32 tensor on `device`."""
    if v is None:
        return None
    return torch.as_tensor(np.asarray(v, dtype=np.float32) if not isinstance(v, torch.Tensor) else v,
                           dtype=torch.float32, device=device)


class HeldGridProxy(GridProxy):
    """One IQ2_XXS superblock walked 32 columns at a time, each step rounded in torch to values
    the format stores, which libggml-base's quantization of W' gives back (W' holds them).

    When the walk reaches the superblock, a search of all its sub-blocks (in the dequantizer's
    units) fixes the ruler: fp16 ``d`` with the largest sub-block's scale at the top code,
    ``d · (0.5 + 15) · 0.25``. Each step's entries and scale are then searched, the scale coded
    ``l = clamp(nint(s/(d/4) − 0.5), 0, 15)`` (the largest sub-block's step: l = 15), and the
    entries chosen again at the coded scale; the step's values are
    ``fp16(d)·(0.5 + l)·0.25 · code`` (:meth:`round`, what the file should hold).

    An IQ2_XXS quantization is not a fixed point of libggml-base's quantizer: it fits each
    sub-block's scale on the levels (1, 3, 5) while the stored magnitudes are 8, 25, 43, so the
    scale it finds for stored values is theirs times ``r/8`` with ``r = Σ w·c·level / Σ w·level²``
    (w its search weights), and it would set a ruler r/8 higher. W' therefore holds each step's
    values times ``8/r`` (:attr:`held`): the fit then finds ``fp16(d)·(2l + 1)``, the ruler ``d``
    and the codes ``l``, and the values are the step's."""

    def __init__(self, blk: torch.Tensor, q: str | qt.QType, v: torch.Tensor | None):
        self._bind(q, v, blk.device)
        x = blk.to(torch.float32)
        _, _, s = self.search(x, self.weights(x), self.codes.abs(), trials=REACH_TRIALS)  # rows × 8, dequantizer units
        self.top = s.argmax(1, keepdim=True)
        self.d16 = _fp16(s.gather(1, self.top) / ((0.5 + self.lmax) * 0.25))  # rows × 1
        self.held = None

    def round(self, c0: int, blk: torch.Tensor) -> torch.Tensor:
        """The values of columns c0:c0+32 of `blk` (the superblock as it stands: columns before
        c0 as held) that the file should hold; :attr:`held` is what W' holds for them."""
        c1 = c0 + 32
        j = c0 // self.g
        x = blk.to(torch.float32)
        wt = self.weights(x)
        basis = self.codes.abs()

        def coded(s, sl):  # s's code against the ruler (the largest sub-block's: the top code), as a scale
            d16 = self.d16[sl]
            unit = d16 * 0.25  # the scale of l + 0.5
            l = torch.clamp(torch.round(s / torch.where(unit > 0, unit, torch.ones_like(unit)) - 0.5), 0, self.lmax)
            l = torch.where(self.top[sl] == j, torch.full_like(l, self.lmax), l)
            return d16 * (0.5 + l) * 0.25  # the dequantizer's product, left to right

        code, lev, db = self.search(x[:, c0:c1], wt[:, c0:c1], basis, then=coded)
        vals = (db * code).to(torch.float32)
        held = vals
        rest = x.square().sum(1, keepdim=True) - x[:, c0:c1].square().sum(1, keepdim=True)
        for _ in range(2):  # the fit's weights are the held values' own: settle them
            if self.v is None:
                w = held * held
            else:
                s2 = grid_probe.SIGMA2_SCALE[self.q.name] * (rest + held.square().sum(1, keepdim=True)) / x.shape[1]
                w = self.v[c0:c1].unsqueeze(0) * (s2 + held * held).sqrt()
            num = (w * code.abs() * lev.abs()).sum(1, keepdim=True)
            den = (w * lev * lev).sum(1, keepdim=True)
            r = torch.where((num > 0) & (den > 0), num / torch.where(den > 0, den, torch.ones_like(den)),
                            torch.full_like(num, 8.0))
            held = vals * (8.0 / r)
        self.held = held
        return vals
