"""Rounding one 32-column step of a grid IQ superblock (IQ1–IQ3) from a probe: the oracle of the
compensation walk's packed steps (compensation_walk.py).

libggml-base quantizes a grid superblock of 256 weights in two stages (``ggml-quants.c``,
``quantize_row_iq*_impl``):

1. every sub-block (16 or 32 weights, :data:`RULES`) picks its grid points, signs (and IQ1's
   shift) and its scale ``s`` by a weighted search over its own values alone, each value
   weighted ``qw · sqrt(σ² + x²)`` (``qw`` the imatrix, σ² = :data:`SIGMA2_SCALE` × the
   superblock's mean square; without an imatrix ``x²``, or IQ2_S's ``σ²/4 + x²``); ``s`` is the
   weighted least-squares fit of the values on the chosen levels;
2. the superblock's ruler ``d = max s / DIV`` is stored, and each sub-block's scale is coded
   against it: ``l = clamp(nint((DIV · s / max s − 1) / 2), 0, LMAX)``, the value being
   ``K · (2l + 1) · code`` with ``K`` the superblock's ruler in the dequantizer's units.

So a step's grid choice depends on its superblock only through σ², and its scale only through the
superblock's largest ``s``. A *probe* lays the step's columns of 8 rows side by side as one
256-wide superblock, so one libggml-base call on rows × 32 weights does stage 1 for the step of
every row, instead of rows × 256. :func:`probe_rounding` hands libggml-base the probe with each
position's weight chosen so that qw · sqrt(σ²_probe + x²) is the weight the value's own row
superblock would give it (``weights="row"``; the search depends on the weights only up to a factor
per sub-block), and the grid choice is then the row's own (measured: the same pattern in every
16-value group but 0–1 %; ``"probe"``, the imatrix slice repeated, differs in 2–5 %).
:class:`SuperblockRuler` then does stage 2 as the row's superblock would: it quantizes the whole
superblock once, when the walk reaches it, and codes each later step's scale against the
largest ``s`` of the superblock as it stands (the steps walked, the one rounded, and the later
ones fitted on the levels of that first quantization).
"""

from __future__ import annotations

import numpy as np
import torch

from ..core import qtypes as qt
from ..quants import decompose

# σ² = SIGMA2_SCALE · Σx² / 256 in each grid type's search (ggml-quants.c quantize_row_*_impl)
SIGMA2_SCALE = {"IQ2_XXS": 1.0, "IQ2_XS": 1.0, "IQ2_S": 2.0, "IQ3_XXS": 2.0, "IQ3_S": 2.0, "IQ1_S": 2.0, "IQ1_M": 2.0}
# stage 2 of each grid type: (DIV, LMAX, weights per scale, the dequantizer's grid unit: a stored
# magnitude c is the search's level 2·round((c/unit − 1)/2) + 1; None: the code is the level).
# Checked against libggml-base's bytes (tests/test_grid_probe.py). IQ1_M then refits its ruler over
# the whole superblock (its K is not proportional to max s), so the walk does not rule it.
RULES = {"IQ2_XXS": (31, 15, 32, 8), "IQ2_XS": (31, 15, 16, 8), "IQ2_S": (31, 15, 16, 8),
         "IQ3_XXS": (31, 15, 32, 4), "IQ3_S": (31, 15, 32, None), "IQ1_S": (15, 7, 32, None),
         "IQ1_M": (15, 7, 16, None)}
WEIGHT_MODES = ("probe", "row")
DT = torch.float32  # the ruler's arithmetic, as the walk's (float64 took 1.07x the time; the two differ where a near tie falls the other way)


def search_weights(x: torch.Tensor, ms: torch.Tensor, q: qt.QType, v) -> torch.Tensor:
    """The weight libggml-base's search gives each value of `x` (rows × w) in a row
    superblock of mean square `ms` (rows,), with imatrix slice `v` (w values, or None)."""
    s2 = SIGMA2_SCALE[q.name] * ms.to(x.dtype).unsqueeze(1)
    if v is not None:
        return torch.as_tensor(np.asarray(v), dtype=x.dtype).unsqueeze(0) * (s2 + x * x).sqrt()
    return 0.25 * s2 + x * x if q.name == "IQ2_S" else x * x


def row_weights(probe: np.ndarray, row_ms: np.ndarray, q: qt.QType, v, per: int, w: int) -> np.ndarray:
    """One quantization weight per position of `probe` (superblocks × 256, `per` rows' `w`
    columns each) such that libggml-base's weight there, qw · sqrt(σ²_probe + x²), equals the
    weight the value's own row superblock (mean square `row_ms`) gives it. Float64, returned
    float32, flattened: the probe goes to libggml-base as one row."""
    x = probe.astype(np.float64)
    ms = np.repeat(row_ms.astype(np.float64).reshape(-1, per), w, axis=1).reshape(-1)
    want = search_weights(torch.from_numpy(x.reshape(-1, w)), torch.from_numpy(ms.reshape(-1, w)[:, 0]), q,
                          v).numpy().reshape(x.shape)
    den = np.sqrt(SIGMA2_SCALE[q.name] * (x * x).mean(axis=1, keepdims=True) + x * x)
    qw = np.where(den > 0, want / np.where(den > 0, den, 1.0), 0.0)
    return np.ascontiguousarray(qw.reshape(-1), dtype=np.float32)


def probe_rounding(x: torch.Tensor, q: qt.QType, v, lib, B: int, row_ms: torch.Tensor | None = None,
                   weights: str = "probe", *, codes: bool = False):
    """libggml-base's rounding of `x` (rows × 32, float32) when the 32 columns of B/32 rows are
    laid side by side as one B-wide row (rows padded with zeros): the dequantized values, or with
    `codes` also the dequantizer's codes (rows × 32). With ``weights="row"`` and `row_ms` (each
    row's superblock mean square, in x's units) every position gets the weight its row's own
    superblock would give it (:func:`row_weights`; needs an imatrix or IQ2_S/IQ3/IQ1_M's own
    rule); else the imatrix slice is repeated. The walk hands it each row divided by the RMS of
    its superblock and scales the result back: rows of different norms would otherwise share one
    ruler, and the small rows' scales would be coded far more coarsely than in their own
    superblock (measured: 1.06–1.11× the per-step walk's error with rows spread by
    exp(N(0, 0.5–1)))."""
    rows, w = x.shape
    per = B // w
    pad = (-rows) % per
    blk = x if not pad else torch.cat([x, torch.zeros(pad, w, dtype=x.dtype)])
    probe = np.ascontiguousarray(blk.numpy().reshape(-1, B))
    if weights == "row" and row_ms is not None and q.name in RULES:
        ms = row_ms if not pad else torch.cat([row_ms, torch.zeros(pad, dtype=row_ms.dtype)])
        probe = probe.reshape(1, -1)
        vv = row_weights(probe.reshape(-1, B), ms.numpy(), q, v, per, w)
    else:
        vv = None if v is None else np.ascontiguousarray(np.tile(v, per))
    data = lib.quantize(probe, q, vv, name="compensation", workers=1)
    vals = torch.from_numpy(lib.dequantize(data, q, probe.shape, name="compensation").reshape(-1, w)[:rows])
    if not codes:
        return vals
    a = decompose(torch.frombuffer(bytearray(data), dtype=torch.uint8), q, probe.shape, name="compensation")
    return vals, a.code.float().reshape(-1, w)[:rows]


def levels(code: torch.Tensor, q: qt.QType) -> torch.Tensor:
    """The search's levels of the dequantizer's codes: the values whose weighted
    least-squares fit is a sub-block's scale ``s``."""
    unit = RULES[q.name][3]
    c = code.to(DT)
    return c if unit is None else c.sign() * (2 * torch.round((c.abs() / unit - 1) / 2) + 1)


def fit(x: torch.Tensor, lev: torch.Tensor, wt: torch.Tensor, g: int) -> torch.Tensor:
    """Each `g`-value group's scale s = Σ w·x·level / Σ w·level² (rows × groups; 0 where the
    group is empty)."""
    rows = x.shape[0]
    x, lev, wt = (t.reshape(rows, -1, g) for t in (x, lev, wt))
    den = (wt * lev * lev).sum(2)
    return torch.where(den > 0, (wt * x * lev).sum(2) / torch.where(den > 0, den, torch.ones_like(den)),
                       torch.zeros_like(den))


class SuperblockRuler:
    """The file's scales for one grid superblock (rows × 256) walked a step at a time.

    Made when the walk reaches the superblock: libggml-base quantizes it as it stands
    (:attr:`first`, the first step's rounding, is that quantization's), and the ruler keeps each
    group's levels and the superblock's ``K / max s``. :meth:`round` gives a later step's values
    from the probe's codes of that step: its groups' ``s`` fitted on the probe's levels, coded
    against the largest ``s`` of the superblock (groups walked: as fitted at their step; the
    step's; later groups: the current values fitted on the first quantization's levels)."""

    def __init__(self, blk: torch.Tensor, q: qt.QType, v, lib):
        rows, B = blk.shape
        self.q, self.v = q, None if v is None else np.asarray(v, dtype=np.float64)
        self.div, self.lmax, self.g, _ = RULES[q.name]
        data = lib.quantize(np.ascontiguousarray(blk.numpy()), q, None if v is None else np.asarray(v, np.float32),
                            name="compensation", workers=1)
        a = decompose(torch.frombuffer(bytearray(data), dtype=torch.uint8), q, (rows, B), name="compensation")
        code = a.code.float().reshape(rows, B)
        self.first = (a.scale.unsqueeze(-1) * a.code.float()).reshape(rows, B)
        self.levels = levels(code, q)
        x = blk.to(DT)
        self.s = fit(x, self.levels, search_weights(x, x.square().mean(1), q, v), self.g)  # rows × groups
        m = self.s.amax(1)
        l = self._code(self.s, m.unsqueeze(1))
        stored = a.scale.to(DT).reshape(rows, -1)  # per dequantizer sub-block
        per = stored.shape[1] // self.s.shape[1]
        K = stored[:, ::per] / (2 * l + 1)  # the same for every group of a row (the check in the tests)
        top = self.s.argmax(1, keepdim=True)
        self.k_per_s = torch.where(m > 0, K.gather(1, top).squeeze(1) / torch.where(m > 0, m, torch.ones_like(m)),
                                   torch.zeros_like(m))  # K / max s: K follows the ruler

    def _code(self, s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        safe = torch.where(m > 0, m, torch.ones_like(m))
        return torch.clamp(torch.round(0.5 * (self.div * s / safe - 1)), 0, self.lmax)

    def round(self, c0: int, blk: torch.Tensor, probe_code: torch.Tensor, probe_vals: torch.Tensor) -> torch.Tensor:
        """The values of columns c0:c0+32 (float32, rows × 32) of `blk`, the superblock as it
        stands, given the probe's codes and values of those columns."""
        c1 = c0 + probe_code.shape[1]
        ms = blk.to(DT).square().mean(1)
        x = blk[:, c0:].to(DT)  # the step and the columns after it
        wt = search_weights(x, ms, self.q, None if self.v is None else self.v[c0:])
        j0, j1, w = c0 // self.g, c1 // self.g, c1 - c0
        s_now = fit(x[:, :w], levels(probe_code, self.q), wt[:, :w], self.g)
        later = fit(x[:, w:], self.levels[:, c1:], wt[:, w:], self.g) if w < x.shape[1] else s_now[:, :0]
        m = torch.cat([self.s[:, :j0], s_now, later], 1).amax(1, keepdim=True)
        l = self._code(s_now, m)
        K = self.k_per_s.unsqueeze(1) * m  # rows × 1
        vals = (K * (2 * l + 1)).repeat_interleave(self.g, 1) * probe_code.to(DT)
        self.s[:, j0:j1] = s_now
        # a row whose superblock quantized to zero has no ruler: the probe's own values
        return torch.where((self.k_per_s > 0).unsqueeze(1), vals, probe_vals.to(DT)).to(torch.float32)
