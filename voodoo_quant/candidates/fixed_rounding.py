"""Rounding columns of a quantized superblock again with its scales held fixed: the sweep's oracle
for the 256-weight superblock types (compensation_walk.py, ``sweep="fixed"``).

Error compensation walks a superblock 32 columns at a time and needs, at each step, how the
quantizer would round the step's columns as they stand after the previous steps' updates. Asking
libggml-base again for the whole superblock at every step costs eight quantizations per
superblock; instead the superblock is quantized once (by libggml-base, from the values it has when
the walk reaches it) and each later step's columns are rounded in torch to the codes the type can
store, with the sub-block scales and offsets that quantization chose (read back through the
bit-exact dequant kernels' :class:`~voodoo_quant.quants.affine.Affine` form):

- integer codes (K-quants): the nearest code in the type's range (``quantize_row_q*_K_ref``:
  ``nearest_int`` then clamped);
- a 16-value codebook (IQ4_XS): the nearest value;
- grids of 4 or 8 magnitudes (IQ2_*, IQ3_*): per group, signs from the values and the grid entry
  nearest to the magnitudes, weighted by the imatrix; where the type stores an even number of
  minus signs per 8 (IQ2_XXS, IQ2_XS, IQ3_XXS: ``ksigns``), the sign costing least is flipped
  when the count is odd, as ``quantize_row_iq2_xxs_impl`` does;
- IQ1_S / IQ1_M: the grid entry (values −1, 0, 1) nearest to the values minus the sub-block's
  delta (±1/8), weighted by the imatrix.

For the types :mod:`~voodoo_quant.quants.recode` writes (the K-quants and IQ4_XS), the codes a
walk rounds to are kept (:meth:`FixedScales.round` with ``keep``) and :meth:`FixedScales.written`
returns the quantization's bytes with them in place: the candidate's bytes, whose values are the
walk's rounding to the bit. For the grid types the codes are only the walk's estimate.
"""

from __future__ import annotations

import numpy as np
import torch

from ..core import qtypes as qt
from ..quants import decompose, recode
from ..quants.grids import table

# code range of the integer-coded superblock types (ggml-quants.c, quantize_row_q*_K_ref)
_INT = {"Q2_K": (0, 3), "Q3_K": (-4, 3), "Q4_K": (0, 15), "Q5_K": (0, 31), "Q6_K": (-32, 31)}
# the types the "fixed" sweep rounds this way (compensation_walk.py). The grid types' rounding below is
# kept and tested but not used by the sweep: libggml-base does not quantize their rounded values
# back to themselves (it chooses its scales again), and the file's layer error was 8–36 % above
# the per-step sweep's (docs/lab/2026-12-05-fast-compensation.md)
SWEEP_TYPES = frozenset({*_INT, "IQ4_XS"})
_VALUES = {"IQ4_XS": "kvalues_iq4nl"}
# grid table, group length, sign rule: "free" (a stored bit per weight), "even" (ksigns: an even
# count of minus signs per 8), "delta" (IQ1: signed grid, a ±1/8 shift per sub-block)
_GRID = {
    "IQ2_XXS": ("iq2xxs_grid", 8, "even"), "IQ2_XS": ("iq2xs_grid", 8, "even"), "IQ2_S": ("iq2s_grid", 8, "free"),
    "IQ3_XXS": ("iq3xxs_grid", 4, "even"), "IQ3_S": ("iq3s_grid", 4, "free"),
    "IQ1_S": ("iq1s_grid", 8, "delta"), "IQ1_M": ("iq1s_grid", 8, "delta"),
}
_CHUNK = 1 << 22  # grid search: distances computed for at most this many (group × entry) pairs at once


def supports(qtype: str | qt.QType) -> bool:
    """Whether the type has a fixed-scale rounding here (every 256-superblock type but TQ1_0/TQ2_0
    and MXFP4's 32-blocks; the sweep uses it for :data:`SWEEP_TYPES`)."""
    n = qt.get(qtype).name
    return n in _INT or n in _VALUES or n in _GRID


class FixedScales:
    """The per-weight scales and offsets of `data`, libggml-base's bytes of a (rows × width)
    float32 matrix in `qtype` (width a multiple of the block), and the rounding to the type's codes
    with them held fixed."""

    def __init__(self, data: bytes, qtype: str | qt.QType, rows: int, width: int,
                 imatrix: np.ndarray | None = None, *, device: torch.device | str = "cpu"):
        q = qt.get(qtype)
        if not supports(q):
            raise KeyError(f"no fixed-scale rounding for {q.name}")
        self.q, self.rows, self.width = q, int(rows), int(width)
        packed = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        a = decompose(packed, q, (self.rows, self.width), name="compensation")
        code = a.code.float()
        self.scale = a.scale.unsqueeze(-1).expand(code.shape).reshape(self.rows, self.width)
        self.offset = None if a.offset is None else a.offset.unsqueeze(-1).expand(code.shape).reshape(self.rows, self.width)
        code = code.reshape(self.rows, self.width)
        self._data = data
        self.codes = code.to(torch.int16)  # the quantization's codes, then what round(keep=True) chose
        self.delta = None
        if q.name in _GRID and _GRID[q.name][2] == "delta":
            g = code / 8.0  # IQ1: code = 8 · (grid + delta), grid integer, delta = ±1/8 (quants/iquants.py)
            self.delta = g - torch.round(g)
        self.weight = None if imatrix is None else torch.as_tensor(np.asarray(imatrix, dtype=np.float32), device=device)

    def round(self, x: torch.Tensor, c0: int, c1: int, *, keep: bool = False) -> torch.Tensor:
        """The values columns c0:c1 of `x` (rows × (c1 − c0), float32) would take: scale · code
        (+ offset), with the code the type can store nearest to them. With `keep`, those codes
        replace the quantization's in :attr:`codes` (where the sub-block's scale is not zero)."""
        s = self.scale[:, c0:c1]
        o = None if self.offset is None else self.offset[:, c0:c1]
        live = s != 0
        y = (x if o is None else x - o) / torch.where(live, s, torch.ones_like(s))
        name = self.q.name
        if name in _INT:
            lo, hi = _INT[name]
            code = torch.clamp(torch.round(y), lo, hi)
        elif name in _VALUES:
            code = _nearest_value(y, _table(_VALUES[name], y.device))
        else:
            w = None if self.weight is None else self.weight[c0:c1]
            code = self._grid(y, c0, c1, w)
        if keep:
            self.codes[:, c0:c1] = torch.where(live, code.to(torch.int16), self.codes[:, c0:c1])
        out = s * code
        if o is not None:
            out = out + o
        return torch.where(live, out, torch.zeros_like(out) if o is None else o)

    def written(self) -> bytes:
        """The quantization's bytes with :attr:`codes` written into them (recode.py): dequantized,
        every column :meth:`round` kept holds its rounding to the bit, every other the
        quantization's own value."""
        blocks = torch.frombuffer(bytearray(self._data), dtype=torch.uint8).view(-1, self.q.type_size)
        return recode.recode(blocks, self.q, self.codes.reshape(blocks.shape[0], -1)).numpy().tobytes()

    def _grid(self, y: torch.Tensor, c0: int, c1: int, w: torch.Tensor | None) -> torch.Tensor:
        table, glen, signs = _GRID[self.q.name]
        grid = _table(table, y.device)  # (entries, glen)
        rows, cols = y.shape
        if signs == "delta":
            d = self.delta[:, c0:c1]
            mag = y / 8.0 - d  # the grid value wanted, before the shift
        else:
            mag = y.abs()
        groups = mag.reshape(rows, cols // glen, glen)
        wg = torch.ones(cols // glen, glen, device=y.device) if w is None else w.reshape(cols // glen, glen)
        idx = _nearest_entries(groups, wg, grid)  # (rows, cols/glen)
        g = grid[idx].reshape(rows, cols)
        if signs == "delta":
            return 8.0 * (g + self.delta[:, c0:c1])
        neg = y < 0
        if signs == "even":  # an odd count of minus signs per 8: flip the one costing least
            n8 = neg.reshape(rows, cols // 8, 8)
            odd = (n8.sum(-1) % 2) == 1
            w8 = torch.ones(cols // 8, 8, device=y.device) if w is None else w.reshape(cols // 8, 8)
            cost = w8 * mag.reshape(rows, cols // 8, 8) * g.reshape(rows, cols // 8, 8)
            flip = torch.nn.functional.one_hot(cost.argmin(-1), 8).bool() & odd.unsqueeze(-1)
            neg = (n8 ^ flip).reshape(rows, cols)
        return torch.where(neg, -g, g)


def _table(name: str, device) -> torch.Tensor:
    return table(name, device)


def _nearest_value(y: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    v, _ = torch.sort(values)
    mid = (v[1:] + v[:-1]) / 2
    return v[torch.bucketize(y.contiguous(), mid)]


def _nearest_entries(groups: torch.Tensor, w: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """argmin_e Σ_j w_j (groups_j − grid_ej)² per group: (rows, m, glen) → (rows, m) entry indices,
    as |grid|²_w − 2 ⟨w·groups, grid⟩ (the groups' own norm is the same for every entry)."""
    rows, m, glen = groups.shape
    entries = grid.shape[0]
    g2 = w @ (grid * grid).T  # (m, entries)
    out = torch.empty(rows, m, dtype=torch.long, device=groups.device)
    step = max(1, _CHUNK // max(1, m * entries))
    for r0 in range(0, rows, step):
        wy = groups[r0:r0 + step] * w  # (r, m, glen)
        cost = g2 - 2.0 * torch.einsum("rmg,eg->rme", wy, grid)
        out[r0:r0 + step] = cost.argmin(-1)
    return out
