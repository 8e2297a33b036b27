"""Eager candidates kept as their int8 codes and sub-block scales: ``CompactCandidates``.

A tensor's K candidates as a float32 stack cost 4·K bytes per weight, and the soft mixture reads
the whole stack twice a training step. Every quantized ggml type dequantizes as ``scale · code
(+ offset)`` per sub-block of 8–32 weights (:mod:`voodoo_quant.quants.affine`), with codes that
fit in int8, so the same candidates take about 1.3 bytes per weight: the codes, and one float32
scale (and offset) per sub-block, in the HF tensor's element order. :mod:`voodoo_quant.candidates.mixkernel`
expands and mixes them in cache.

Exactness is checked, not assumed: :meth:`CompactCandidates.build` expands every candidate and
compares it bit for bit with libggml-base's ``to_float`` in the HF layout (what a float32 stack
would hold); a tensor whose candidates do not all reproduce (a float type in its menu, a layout
that splits sub-blocks, a missing compiler) keeps its float32 stack. The mixture is the sequential
float32 sum of the ``--lazy`` path, bit for bit.
"""

from __future__ import annotations

import copy
import ctypes
import functools
from typing import Sequence

import numpy as np
import torch

from .. import quants
from ..core import envs
from ..core import qtypes as qt
from ..quants.random_blocks import random_blocks
from . import mixkernel


def _sub_block_order(layout, rows: int, n_per_row: int, sub: int) -> torch.Tensor | None:
    """For each sub-block of `sub` weights of the HF tensor (flat order), the index of the GGUF
    sub-block it is; None when the layout does not move whole aligned sub-blocks."""
    n = rows * n_per_row
    if getattr(layout, "is_identity", False):  # most tensors (the embedding first): nothing to index
        return torch.arange(n // sub)
    dtype = torch.int32 if n < 2**31 else torch.int64
    idx = layout.from_gguf(torch.arange(n, dtype=dtype).view(rows, n_per_row)).reshape(-1, sub)
    first = idx[:, 0]
    if bool((first % sub).ne(0).any()) or not torch.equal(idx, first[:, None] + torch.arange(sub, dtype=dtype)):
        return None
    return (first // sub).long()


@functools.lru_cache(maxsize=None)
def bytes_per_weight(qtype: str) -> float | None:
    """What one weight of a `qtype` candidate costs held as codes: 1 byte of code plus its
    sub-block's float32 scale (and offset) shared by the sub-block; None for the float types."""
    q = qt.get(qtype)
    if q.is_float:
        return None
    blob = torch.from_numpy(random_blocks(q, 1, np.random.default_rng(0)).reshape(-1).copy())
    a = quants.decompose(blob, q.name, (1, q.block))
    if a is None:
        return None
    return 1.0 + (4.0 + (4.0 if a.offset is not None else 0.0)) / a.sub_len


def holds_codes(device_kind: str, dtype: str, world: int) -> bool:
    """Whether a run keeps eager candidates as int8 codes (``student.build_mixed``): float32 on
    the CPU, in one process, the kernel switched on (a missing compiler shows when it is built)."""
    return device_kind == "cpu" and dtype == "float32" and world == 1 and envs.mix_kernel()


def held_bytes(types: Sequence[str], numel: int) -> float:
    """Bytes of a tensor of `numel` weights with candidates `types` held as codes; a menu with a
    float rung keeps its float32 stack (:meth:`CompactCandidates.build`)."""
    per = [bytes_per_weight(t) for t in types]
    return numel * (sum(per) if None not in per else 4.0 * len(per))


class CompactCandidates:
    """Callable k -> candidate k as float32 (the shape of the HF weight), mixed by :meth:`mix`,
    with the gate gradients of :meth:`grad`: what ``layers._Mix`` uses instead of a float32 stack."""

    def __init__(self, name: str, shape: Sequence[int], codes: Sequence[torch.Tensor], scales: Sequence[torch.Tensor],
                 offsets: Sequence[torch.Tensor | None], shifts: Sequence[int], lib: ctypes.CDLL):
        self.name = name
        self.shape = tuple(int(s) for s in shape)
        self.numel = 1
        for s in self.shape:
            self.numel *= s
        for c, s, o, sh in zip(codes, scales, offsets, shifts):
            if c.dtype != torch.int8 or c.numel() != self.numel or s.dtype != torch.float32 or \
                    s.numel() << sh != self.numel or (o is not None and o.shape != s.shape):
                raise ValueError(f"{name}: inconsistent compact candidate")
        self.codes = [c.contiguous() for c in codes]
        self.scales = [s.contiguous() for s in scales]
        self.offsets = [o.contiguous() if o is not None else None for o in offsets]
        self.shifts = [int(s) for s in shifts]
        self._lib = lib
        self._cands = (mixkernel.Cand * len(self.codes))(*[
            mixkernel.Cand(c.data_ptr(), s.data_ptr(), o.data_ptr() if o is not None else None, sh)
            for c, s, o, sh in zip(self.codes, self.scales, self.offsets, self.shifts)])

    @classmethod
    def build(cls, plan, blobs: Sequence[bytes], dense: Sequence[torch.Tensor]) -> "CompactCandidates | None":
        """`plan`'s candidates from their ggml bytes, checked against `dense` (the float32 HF-layout
        weights that libggml-base dequantizes them to); None where that cannot be done exactly."""
        lib = mixkernel.load()
        if lib is None:
            return None
        shape = (plan.rows, plan.n_per_row)
        codes, scales, offsets, shifts = [], [], [], []
        orders: dict[int, torch.Tensor | None] = {}
        for blob, t in zip(blobs, plan.menu.types):
            a = quants.decompose(torch.frombuffer(bytearray(blob), dtype=torch.uint8), t, shape, name=plan.name)
            if a is None:
                return None
            sub = a.sub_len
            if sub < 8 or sub & (sub - 1):
                return None
            code = a.code.reshape(-1)
            c8 = code.to(torch.int8)
            if not torch.equal(c8.to(code.dtype), code):
                return None
            if sub not in orders:
                orders[sub] = _sub_block_order(plan.layout, plan.rows, plan.n_per_row, sub)
            order = orders[sub]
            if order is None:
                return None
            scale, offset = a.scale.reshape(-1), a.offset.reshape(-1) if a.offset is not None else None
            codes.append(c8.view(-1, sub).index_select(0, order).reshape(-1))
            scales.append(scale.index_select(0, order))
            offsets.append(offset.index_select(0, order) if offset is not None else None)
            shifts.append(sub.bit_length() - 1)
        out = cls(plan.name, plan.shape, codes, scales, offsets, shifts, lib)
        for k, d in enumerate(dense):
            if not torch.equal(out(k).view(torch.int32), d.reshape(out.shape).contiguous().view(torch.int32)):
                return None  # not bit for bit what to_float gives: keep the float32 stack
        return out

    def __deepcopy__(self, memo) -> "CompactCandidates":
        """A copy with its own tensors, and kernel descriptors that point at them (not at ours)."""
        dc = copy.deepcopy
        return CompactCandidates(self.name, self.shape, dc(self.codes, memo), dc(self.scales, memo),
                                 dc(self.offsets, memo), list(self.shifts), self._lib)

    # -- the interface of a lazy candidate source (layers._Mix, MixedQuant, rungs) ----------------
    def __call__(self, k: int) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=torch.float32)
        self._lib.vq_expand(self.numel, ctypes.byref(self._cands[k]), out.data_ptr(), torch.get_num_threads())
        return out

    @property
    def k(self) -> int:
        return len(self.codes)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def nbytes(self) -> int:
        held = [*self.codes, *self.scales, *(o for o in self.offsets if o is not None)]
        return sum(t.numel() * t.element_size() for t in held)

    # -- the mixture -------------------------------------------------------------------------
    def mix(self, p: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Σ_k p_k W_k in float32 (into `out` when given), the candidates summed in order."""
        pf = p.detach().to(torch.float32).contiguous()
        if out is None:
            out = torch.empty(self.shape, dtype=torch.float32)
        if not out.is_contiguous() or out.dtype != torch.float32 or out.numel() != self.numel:
            raise ValueError(f"{self.name}: the mixture's buffer must be a contiguous float32 tensor of {self.shape}")
        # The kernel writes behind autograd's back: bump `out`'s version counter (shared by its views)
        # as a torch write would, so that a mixture still held by a pending backward is refused.
        out.view(-1)[:1].mul_(1.0)
        self._lib.vq_mix_forward(self.numel, self.k, self._cands, pf.data_ptr(), out.data_ptr(), torch.get_num_threads())
        return out.view(self.shape)

    def grad(self, g: torch.Tensor) -> torch.Tensor:
        """(K,) float64: ⟨g, W_k⟩ for every candidate."""
        g = g.detach().to(torch.float32).contiguous()
        if g.numel() != self.numel:
            raise ValueError(f"{self.name}: gradient of {g.numel()} elements for a weight of {self.numel}")
        nch = -(-self.numel // mixkernel.CHUNK)
        partial = torch.empty(nch * self.k, dtype=torch.float64)
        out = torch.empty(self.k, dtype=torch.float64)
        self._lib.vq_mix_backward(self.numel, self.k, self._cands, g.data_ptr(), partial.data_ptr(), out.data_ptr(),
                                  torch.get_num_threads())
        return out
