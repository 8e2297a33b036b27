"""libggml-base's IQ1_S search (``quantize_row_iq1_s_impl``, ``ggml-quants.c``) in torch, every
sub-block at once: a part of :mod:`.grid_search`.

Each 32-value sub-block takes three levels {−1, 0, 1} + δ with δ = ±1/8 (IQ1S_DELTA). The C code
sorts the values (glibc's qsort: a stable merge sort at this size), forms prefix sums of w·x and w
over them, and tries every pair of cut points i1 ≤ i2 for both signs of δ, keeping the cut whose
weighted least-squares scale explains the most (``sumqx² / sumq2``, the first of equals). Here all
1122 candidates are scored at once; the C code's running comparison (``sumqx*sumqx >
best*sumq2``) is replayed exactly only over the candidates within :data:`NEAR` of the best, the
only ones it can tell apart differently. Then each group of 8 is looked up on the grid, the
off-grid ones given their best neighbour (``iq1_find_best_neighbour2``: unweighted by sqrt, the
signed values against ``scale · (level − 1 + δ)``), and the scale refitted when any group moved.
"""

from __future__ import annotations

import torch

from .grid_tables import best_neighbours, lattice, seqsum, sqrtf

DELTA = 0.125  # IQ1S_DELTA (ggml-common.h)
NEAR = 1e-4  # relative: candidates this close to the best score are compared as the C code does
_F32 = torch.float32


def _cuts(n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(i1, i2) of every candidate in the C loop's order: i1 outer, i2 = i1..n inner."""
    i1 = torch.cat([torch.full((n + 1 - a,), a, dtype=torch.int64) for a in range(n + 1)])
    i2 = torch.cat([torch.arange(a, n + 1, dtype=torch.int64) for a in range(n + 1)])
    return i1.to(device), i2.to(device)


def _parts(t, i1, i2, n):
    """The three spans' sums of every cut (N × cuts each) from prefix sums t (N × n+1)."""
    at1, at2 = t.index_select(1, i1), t.index_select(1, i2)
    return at1 - t[:, :1], at2 - at1, t[:, n:n + 1] - at2


def _score(px, pw, xs):
    """sumqx, sumq2 of every cut for level values xs, with the C code's float ops."""
    (a, b, c), (u, v, w) = px, pw
    sumqx = (a * xs[0] + b * xs[1]) + c * xs[2]
    return sumqx, ((u * xs[0]) * xs[0] + (v * xs[1]) * xs[1]) + (w * xs[2]) * xs[2]


def _replay(qx: torch.Tensor, q2: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """The C loop's running choice over the candidates `cand` (N × K bool) of each row, in column
    order: accept where ``sumq2 > 0 && sumqx*sumqx > best*sumq2``, then best = (sumqx/sumq2)·sumqx.
    Returns the last accepted column (−1 where none)."""
    N, K = qx.shape
    best = torch.full((N,), -torch.finfo(_F32).max, dtype=_F32, device=qx.device)
    pick = torch.full((N,), -1, dtype=torch.int64, device=qx.device)
    cols = cand.any(0).nonzero().squeeze(1).tolist()
    for c in cols:
        a, b = qx[:, c], q2[:, c]
        ok = cand[:, c] & (b > 0) & (a * a > best * b)
        s = a / torch.where(b > 0, b, torch.ones_like(b))
        best = torch.where(ok, s * a, best)
        pick = torch.where(ok, torch.full_like(pick, c), pick)
    return pick


def search_iq1_s(xs: torch.Tensor, qw: torch.Tensor):
    """quantize_row_iq1_s_impl on superblocks xs (S × 256) with weights qw: per sub-block (S × 8)
    the scale s, the grid entries (S × 8 × 4) and the shift (True: δ = −1/8)."""
    dev = xs.device
    lat = lattice("IQ1_S", dev)
    S, n = xs.shape[0], 32
    sigma2 = (2 * seqsum(xs * xs)) / 256
    weight = (qw * sqrtf(sigma2[:, None] + xs * xs)).reshape(-1, n)
    x = xs.reshape(-1, n)
    N = x.shape[0]
    dead = x.abs().amax(1) < 1e-12
    xsort, order = torch.sort(x, dim=1, stable=True)
    wsort = torch.gather(weight, 1, order)
    sx = torch.zeros(N, n + 1, dtype=_F32, device=dev)
    sw = torch.zeros(N, n + 1, dtype=_F32, device=dev)
    for j in range(n):  # the prefix sums, left to right
        sx[:, j + 1] = sx[:, j] + wsort[:, j] * xsort[:, j]
        sw[:, j + 1] = sw[:, j] + wsort[:, j]
    i1, i2 = _cuts(n, dev)
    xp, xm = (-1 + DELTA, DELTA, 1 + DELTA), (-1 - DELTA, -DELTA, 1 - DELTA)
    px, pw = _parts(sx, i1, i2, n), _parts(sw, i1, i2, n)
    qp, q2p = _score(px, pw, xp)
    qm, q2m = _score(px, pw, xm)
    qx = torch.stack([qp, qm], 2).reshape(N, -1)  # the C order: for each cut, +δ then −δ
    q2 = torch.stack([q2p, q2m], 2).reshape(N, -1)
    valid = q2 > 0
    v = torch.where(valid, (qx / torch.where(valid, q2, torch.ones_like(q2))) * qx, torch.full_like(qx, -float("inf")))
    top = v.amax(1, keepdim=True)
    near = valid & (v >= top - NEAR * top.abs())
    pick = v.argmax(1)
    amb = near.sum(1) > 1
    if bool(amb.any()):
        r = amb.nonzero().squeeze(1)
        got = _replay(qx[r], q2[r], near[r])
        pick[r] = torch.where(got >= 0, got, pick[r])
    dead = dead | ~valid.any(1)
    sumqx = qx.gather(1, pick[:, None]).squeeze(1)
    sumq2 = q2.gather(1, pick[:, None]).squeeze(1)
    scale = sumqx / torch.where(sumq2 > 0, sumq2, torch.ones_like(sumq2))
    cut = pick // 2
    neg_shift = (pick % 2) == 1
    pos = torch.arange(n, device=dev)
    lsort = (pos >= i1[cut][:, None]).to(torch.int64) + (pos >= i2[cut][:, None]).to(torch.int64)
    L = torch.empty_like(lsort).scatter_(1, order, lsort)  # back to the values' order
    flip = scale < 0
    L = torch.where(flip[:, None], 2 - L, L)
    scale = torch.where(flip, -scale, scale)
    neg_shift = neg_shift ^ flip
    delta = torch.where(neg_shift, -DELTA, DELTA).to(_F32)
    vals = torch.stack([-1 + delta, delta, 1 + delta], 1)  # (N, 3): x_p or x_m
    L = L.reshape(N, 4, 8)
    code = lat.code(L)
    e = lat.kmap[code]
    off = e < 0
    if bool(off.any()):
        g = off.nonzero()
        e = e.clone()
        e[off] = best_neighbours(lat, code[off], x.reshape(N, 4, 8)[off], weight.reshape(N, 4, 8)[off],
                                 scale[g[:, 0]], vals[g[:, 0]])
        moved = off.any(1)
        lev = lat.levels[e].reshape(N, n)
        q = torch.gather(vals, 1, lev)
        sqx, sq2 = seqsum((weight * q) * x), seqsum((weight * q) * q)
        ok = moved & (sqx > 0) & (sq2 > 0)
        scale = torch.where(ok, sqx / torch.where(ok, sq2, torch.ones_like(sq2)), scale)
    scale = torch.where(dead, torch.zeros_like(scale), scale)
    e = torch.where(dead[:, None], torch.zeros_like(e), e)
    neg_shift = neg_shift & ~dead
    return scale.reshape(S, 8), e.reshape(S, 8, 4), neg_shift.reshape(S, 8)
