"""libggml-base's grid IQ quantizers (IQ2_XXS, IQ2_S, IQ3_S, IQ1_S) in torch, vectorized over every
sub-block of a matrix: a candidate rounding oracle for the compensation walk (compensation_walk.py), where
the walk needs to know how libggml-base would round a superblock as it stands.

Each function follows its ``quantize_row_*_impl`` in ``ggml-quants.c`` step by step, with the same
float32 operations in the same order (:mod:`.grid_tables`; docs/facts.md), so the bytes it packs
are libggml-base's. Measured (``bench/grid_search_agreement.py``): every superblock's bytes
identical on Gaussian matrices and on rows of the 1.5B benchmark model's q_proj and down_proj,
with random and calibration imatrix vectors; ``tests/test_grid_search.py`` checks the bytes. It is
not wired into any sweep: on one CPU thread it costs 7–13× libggml-base's own quantization (the
neighbour scan, two thirds of it, is the same candidate distances the C code computes, done by
gathers), so no CPU walk is cheaper with it. Per superblock of 256:

1. σ² = c · Σx²/256 (c = 1 for IQ2_XXS, else 2), each value weighted ``qw · sqrt(σ² + x²)``;
2. per sub-block, signs are split off (IQ2_XXS: an even number of minus signs per 8, the cheapest
   one flipped), and a loop over trial scales rounds the magnitudes to the lattice, looks the
   groups up on the grid (the neighbour lists where off it), and keeps the trial whose weighted
   least-squares scale explains the most (``sumqx² / sumq2``); the winning levels are refitted
   (IQ2_XXS: from ``make_qp_quants``'s starting scale; IQ1_S instead searches the two cut points of
   the sorted values exhaustively, for both ±1/8 shifts);
3. the superblock stores ``d = max s / 31`` (IQ1: 15; times the type's fudge factor), each
   sub-block ``l = clamp(nint((s/d − 1)/2))``.

The result is the block bytes (:func:`quantize`), which the bit-exact torch dequantizer
(:mod:`voodoo_quant.quants`) turns into values. A candidate's bytes are never these: they are
always libggml-base's quantization of the final matrix.
"""

from __future__ import annotations

import numpy as np
import torch

from ..core import qtypes as qt
from ..core.errors import QuantizationInputError
from ..quants import dequantize
from . import grid_iq1, grid_packing
from .grid_tables import Lattice, best_neighbours, lattice, nearest_int, seqsum, sqrtf

QK = 256
TYPES = ("IQ2_XXS", "IQ2_S", "IQ3_S", "IQ1_S")
CHUNK = 2048  # superblocks searched at once (IQ1_S's cut scores: ~36 KB per sub-block at a time)
_F32 = torch.float32


def f32(v) -> float:
    """A C float literal or product (``0.1f``, ``is*0.1f``) as the Python float of its float32 value:
    a Python scalar meets a float32 tensor in float32, so it must already be the float32 value."""
    return float(np.float32(v))


def rdiv(a: float, t: torch.Tensor) -> torch.Tensor:
    """C's ``a / t`` for a float `a`: torch computes ``scalar / tensor`` as ``reciprocal(t) · a``,
    two roundings (measured: 27 % of quotients off by an ulp), so `a` is made a tensor first."""
    return torch.full_like(t, a) / t


def _sigma2(xs: torch.Tensor, twice: bool) -> torch.Tensor:
    """σ² of each superblock (S × 256): ``sumx2/QK_K``, or ``2*sumx2/QK_K``, summed left to right."""
    s = seqsum(xs * xs)
    return (2 * s if twice else s) / QK


def _fit(w: torch.Tensor, x: torch.Tensor, q: torch.Tensor):
    """``sumqx, sumq2`` over the last dimension, left to right: Σ w·x·q, Σ w·q·q."""
    return seqsum((w * x) * q), seqsum((w * q) * q)


def _round(lat: Lattice, xval: torch.Tensor, waux: torch.Tensor, idv: torch.Tensor, scale: torch.Tensor,
           kmaxq: int, todo: torch.Tensor | None = None):
    """One pass of a trial: each group (N × groups × dim) rounded to ``clamp(nint((id·x − 1)/2))``,
    looked up on the grid, and the off-grid ones (of `todo`, when given) given their best
    neighbour at `scale` (per sub-block). Returns (entry, levels, on_grid)."""
    l = torch.clamp(nearest_int(0.5 * (idv[:, None, None] * xval - 1)), 0, kmaxq - 1)
    code = lat.code(l)
    e = lat.kmap[code]
    on = e >= 0
    off = ~on if todo is None else ~on & todo
    if bool(off.any()):
        sc = scale[:, None].expand(on.shape)[off]
        vals = 2 * torch.arange(lat.nl, device=xval.device, dtype=_F32) + 1
        e = e.clone()
        e[off] = best_neighbours(lat, code[off], xval[off], waux[off], sc, vals)
    lev = torch.where(on.unsqueeze(-1), l.to(torch.int64), lat.levels[e.clamp_min(0)])
    return e, lev, on


def _trial_scales(lat, xval, weight, waux, start, ids, kmaxq, track=False):
    """The trial loop: for each ``id`` of `ids` (per sub-block, N × trials), round (with the
    neighbour scan at ``1/id``), fit, and keep the trial with the largest ``sumqx²/sumq2`` as C does
    (``sumqx*sumqx > best*sumq2``, the first of equals). Returns (scale, levels, on_grid)."""
    N, g, dim = xval.shape
    scale = start.clone()
    best = torch.zeros(N, dtype=_F32, device=xval.device)
    L = torch.zeros(N, g, dim, dtype=torch.int64, device=xval.device)
    on_best = torch.ones(N, g, dtype=torch.bool, device=xval.device) if track else None
    xf, wf = xval.reshape(N, -1), weight.reshape(N, -1)
    for t in range(ids.shape[1]):
        idv = ids[:, t]
        _, lev, on = _round(lat, xval, waux, idv, rdiv(1, idv), kmaxq)
        sumqx, sumq2 = _fit(wf, xf, (2 * lev + 1).to(_F32).reshape(N, -1))
        take = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        scale = torch.where(take, sumqx / sumq2, scale)
        best = torch.where(take, scale * sumqx, best)
        L = torch.where(take[:, None, None], lev, L)
        if track:
            on_best = torch.where(take[:, None], on, on_best)
    return scale, L, on_best


def _make_qp_quants(x: torch.Tensor, w: torch.Tensor, nmax: int) -> torch.Tensor:
    """ggml-quants.c ``make_qp_quants`` for each row of x (N × n) with weights w: the scale it
    returns. Its levels are stored in a uint8_t: a negative one wraps to 256 + l and is read back
    so (IQ2_XXS hands it one negative value where a sign was flipped)."""
    mx = torch.clamp_min(x.amax(1), 0)
    safe = torch.where(mx > 0, mx, torch.ones_like(mx))
    iscale = rdiv(nmax, safe)
    Lw = (nearest_int(iscale[:, None] * x) % 256).to(_F32)
    sc = rdiv(1, iscale)
    diff = x - sc[:, None] * Lw
    best = seqsum((w * diff) * diff)
    for s in (-4, -3, -2, -1, 1, 2, 3, 4):
        isc = rdiv(f32(f32(f32(0.1) * s) + nmax), safe)
        l = torch.clamp_max(nearest_int(isc[:, None] * x), nmax).to(_F32)
        diff = x - rdiv(1, isc)[:, None] * l
        mse = seqsum((w * diff) * diff)
        better = mse < best
        best = torch.where(better, mse, best)
        iscale = torch.where(better, isc, iscale)
    l = torch.clamp_max(nearest_int(iscale[:, None] * x), nmax)
    L = (l % 256).to(_F32)
    lf = l.to(_F32)
    sumlx, suml2 = seqsum((w * x) * lf), seqsum((w * lf) * lf)
    wx = w * x
    for _ in range(5):
        changed = torch.zeros_like(mx, dtype=torch.bool)
        for i in range(x.shape[1]):
            Li, wi, wxi = L[:, i], w[:, i], wx[:, i]
            slx = sumlx - wxi * Li
            sl2 = suml2 - (wi * Li) * Li
            ok = (slx > 0) & (sl2 > 0)
            new = torch.clamp_max(nearest_int((x[:, i] * sl2) / torch.where(ok, slx, torch.ones_like(slx))), nmax)
            nf = new.to(_F32)
            ok = ok & (nf != Li)
            slx = slx + wxi * nf
            sl2 = sl2 + (wi * nf) * nf
            ok = ok & ((slx * slx) * suml2 > (sumlx * sumlx) * sl2)
            L[:, i] = torch.where(ok, (new % 256).to(_F32), Li)
            sumlx = torch.where(ok, slx, sumlx)
            suml2 = torch.where(ok, sl2, suml2)
            changed |= ok
        if not bool(changed.any()):
            break
    out = torch.where(suml2 > 0, sumlx / torch.where(suml2 > 0, suml2, torch.ones_like(suml2)), torch.zeros_like(suml2))
    return torch.where(mx < 1e-15, torch.zeros_like(out), out)


def _search_iq2_xxs(xs: torch.Tensor, qw: torch.Tensor):
    """quantize_row_iq2_xxs_impl on superblocks xs (S × 256) with weights qw (S × 256): per
    sub-block (S·8) the scale s, the grid entries (× 4) and the 7-bit sign codes (× 4)."""
    lat = lattice("IQ2_XXS", xs.device)
    S = xs.shape[0]
    sigma2 = _sigma2(xs, False)
    weight = qw * sqrtf(sigma2[:, None] + xs * xs)
    x = xs.reshape(-1, 4, 8)
    weight = weight.reshape(-1, 4, 8)
    waux = sqrtf(weight)
    neg = x < 0
    xval = torch.where(neg, -x, x)
    odd = (neg.sum(-1) % 2) == 1  # an odd count of minus signs: flip the one costing least
    imin = ((weight * x) * x).argmin(-1)
    flip = torch.nn.functional.one_hot(imin, 8).bool() & odd[..., None]
    xval = torch.where(flip, -xval, xval)
    bits = neg ^ flip
    signs = (bits.to(torch.int64) << torch.arange(8, device=xs.device)).sum(-1) & 127
    N = x.shape[0]
    xf, wf = xval.reshape(N, 32), weight.reshape(N, 32)
    mx = xf.amax(1)
    dead = mx < 1e-15
    scale = _make_qp_quants(xf, wf, 4)
    eff = scale * 3
    dead = dead | (eff <= 0)
    safe = torch.where(dead, torch.ones_like(eff), eff)
    ids = torch.stack([rdiv(f32(5 + f32(s * f32(0.1))), safe) for s in range(-6, 7)], 1)
    scale, _, _ = _trial_scales(lat, xval, weight, waux, scale, ids, 3)
    pos = scale > 0
    safe = torch.where(pos, scale, torch.ones_like(scale))
    e, lev, _ = _round(lat, xval, waux, rdiv(1, safe), scale, 3)
    sumqx, sumq2 = _fit(wf, xf, (2 * lev + 1).to(_F32).reshape(N, 32))
    scale = torch.where(pos & (sumq2 > 0), sumqx / torch.where(sumq2 > 0, sumq2, torch.ones_like(sumq2)), scale)
    negs = scale < 0  # "should never happen": C flips the scale and the signs
    scale = torch.where(negs, -scale, scale)
    signs = torch.where(negs[:, None], (~signs) & 127, signs)
    scale = torch.where(dead, torch.zeros_like(scale), scale)
    e = torch.where(dead[:, None], torch.zeros_like(e), e)
    signs = torch.where(dead[:, None], torch.zeros_like(signs), signs)
    return scale.reshape(S, 8), e.reshape(S, 8, 4), signs.reshape(S, 8, 4)


def _search_free_signs(xs: torch.Tensor, qw: torch.Tensor | None, name: str):
    """quantize_row_iq2_s_impl / quantize_row_iq3_s_impl (a stored sign per weight): per sub-block
    the scale s, the grid entries and the sign bytes (one per 8 weights)."""
    iq3 = name == "IQ3_S"
    bs, kmaxq, step, eps = (32, 8, 0.2, 0.0) if iq3 else (16, 3, 0.1, 1e-8)
    lat = lattice(name, xs.device)
    S = xs.shape[0]
    sigma2 = _sigma2(xs, True)
    if qw is not None:
        weight = qw * sqrtf(sigma2[:, None] + xs * xs)
    else:
        weight = (0.25 * sigma2[:, None] + xs * xs) if not iq3 else xs * xs
    dim = lat.dim
    x = xs.reshape(-1, bs)
    N = x.shape[0]
    weight = weight.reshape(N, bs)
    waux = sqrtf(weight)
    neg = x < 0
    xval = torch.where(neg, -x, x)
    signs = (neg.reshape(N, bs // 8, 8).to(torch.int64) << torch.arange(8, device=xs.device)).sum(-1)
    mx = xval.amax(1)
    dead = (mx == 0) if iq3 else (mx < eps)
    safe = torch.where(dead, torch.ones_like(mx), mx)
    start = safe / (2 * kmaxq - 1)
    ids = torch.stack([rdiv(f32(2 * kmaxq - 1 + f32(s * f32(step))), safe) for s in range(-9, 10)], 1)
    xg, wg = xval.reshape(N, bs // dim, dim), waux.reshape(N, bs // dim, dim)
    scale, L, on = _trial_scales(lat, xg, weight, wg, start, ids, kmaxq, track=True)
    redo = (~on).any(1) & (scale > 0)
    if bool(redo.any()):
        r = redo.nonzero().squeeze(1)
        sr = scale[r]
        todo = None if iq3 else ~on[r]  # IQ2_S walks only the groups off the grid; IQ3_S all of them
        _, lev, _ = _round(lat, xg[r], wg[r], rdiv(1, sr), sr, kmaxq, todo)
        if todo is not None:
            lev = torch.where(todo[..., None], lev, L[r])
        L = L.clone()
        L[r] = lev
        sumqx, sumq2 = _fit(weight[r], xval[r], (2 * lev + 1).to(_F32).reshape(len(r), bs))
        scale = scale.clone()
        scale[r] = torch.where(sumq2 > 0, sumqx / torch.where(sumq2 > 0, sumq2, torch.ones_like(sumq2)), sr)
    e = lat.kmap[lat.code(L)]
    if bool((e < 0).any()):
        raise QuantizationInputError(f"{name}: a group's levels are off the grid (the search diverged from ggml's)")
    negs = scale < 0
    scale = torch.where(negs, -scale, scale)
    signs = torch.where(negs[:, None], (~signs) & 255, signs)
    scale = torch.where(dead, torch.zeros_like(scale), scale)
    e = torch.where(dead[:, None], torch.zeros_like(e), e)
    signs = torch.where(dead[:, None], torch.zeros_like(signs), signs)
    return scale.reshape(S, QK // bs), e.reshape(S, QK // bs, bs // dim), signs.reshape(S, QK // bs, bs // 8)


def _check(matrix, q: qt.QType, imatrix):
    if q.name not in TYPES:
        raise QuantizationInputError(f"no torch grid search for {q.name}; it has {', '.join(TYPES)}")
    x = torch.as_tensor(matrix)
    if x.dim() != 2 or x.dtype != _F32:
        raise QuantizationInputError(f"{q.name} grid search takes a 2-D float32 matrix, got {tuple(x.shape)} {x.dtype}")
    if x.shape[1] % QK:
        raise QuantizationInputError(f"{q.name} blocks of {QK} do not tile rows of {x.shape[1]}")
    if not bool(torch.isfinite(x).all()):
        raise QuantizationInputError(f"{q.name} grid search: the matrix has non-finite values")
    if imatrix is None and q.ggml_needs_imatrix:
        raise QuantizationInputError(f"{q.name} needs an imatrix")
    v = None
    if imatrix is not None:
        v = torch.as_tensor(np.asarray(imatrix, dtype=np.float32) if not isinstance(imatrix, torch.Tensor) else imatrix,
                            device=x.device).to(_F32)
        if v.shape != (x.shape[1],):
            raise QuantizationInputError(f"{q.name}: imatrix of {tuple(v.shape)} for rows of {x.shape[1]}")
    return x, v


def search(matrix, qtype: str | qt.QType, imatrix=None):
    """The grid search of every superblock of `matrix` (rows × n float32, torch or numpy, CPU or
    CUDA), with the imatrix vector `imatrix` (n values): a :class:`grid_packing.Search` holding
    each sub-block's scale ``s`` and its codes, as libggml-base chooses them."""
    q = qt.get(qtype)
    x, v = _check(matrix, q, imatrix)
    rows, n = x.shape
    xs = x.reshape(-1, QK)
    qw = None if v is None else v.reshape(1, -1, QK).expand(rows, -1, -1).reshape(-1, QK)
    parts = []
    for c0 in range(0, xs.shape[0], CHUNK):  # the search's intermediates are a few hundred bytes per weight
        xc, qc = xs[c0:c0 + CHUNK], None if qw is None else qw[c0:c0 + CHUNK]
        if q.name == "IQ2_XXS":
            parts.append(_search_iq2_xxs(xc, qc) + (None,))
        elif q.name == "IQ1_S":
            s_, e_, sh = grid_iq1.search_iq1_s(xc, qc)
            parts.append((s_, e_, None, sh))
        else:
            parts.append(_search_free_signs(xc, qc, q.name) + (None,))
    s, e, sg, shift = (None if p[0] is None else torch.cat(p) for p in zip(*parts))
    return grid_packing.Search(q.name, rows, n, s, e, sg, shift)


def quantize(matrix, qtype: str | qt.QType, imatrix=None) -> torch.Tensor:
    """The block bytes (uint8 tensor, on the matrix's device) libggml-base writes for `matrix`."""
    return grid_packing.pack(search(matrix, qtype, imatrix))


def values(matrix, qtype: str | qt.QType, imatrix=None) -> torch.Tensor:
    """The dequantized values (rows × n float32) of :func:`quantize`'s bytes."""
    x = torch.as_tensor(matrix)
    return dequantize(quantize(x, qtype, imatrix), qtype, tuple(x.shape), name="grid search")
