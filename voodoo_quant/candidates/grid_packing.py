"""Stage 2 of libggml-base's grid quantizers (the superblock's scale and each sub-block's 4-bit
scale code, ``quantize_row_*_impl`` in ``ggml-quants.c``) and the block layouts of
``ggml-common.h``: a :class:`Search` (every sub-block's scale and codes, from :mod:`.grid_search`)
becomes the bytes libggml-base would write.

Per superblock: ``d = max s / DIV``; the stored fp16 is ``d · fudge`` (IQ3_S 1.033, IQ2_S 0.9875,
IQ1_S 1.125, IQ2_XXS none), and each sub-block's code ``l = clamp(nearest_int(0.5·(s/d − 1)), 0,
LMAX)`` uses ``1/d`` before the fudge. A superblock whose every s is 0 stores d = 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..core import qtypes as qt
from .grid_tables import nearest_int

# type → (DIV, LMAX, fudge of the stored d or None)
STAGE2 = {"IQ2_XXS": (31, 15, None), "IQ2_S": (31, 15, 0.9875), "IQ3_S": (31, 15, 1.033), "IQ1_S": (15, 7, 1.125)}


@dataclass
class Search:
    """The grid search of a rows × n matrix: per superblock (S = rows · n/256) and sub-block,
    ``scale`` (S × sub-blocks, float32, the fitted s before coding), ``entry`` (S × sub-blocks ×
    groups, grid indices), ``signs`` (IQ2_XXS: 7-bit ksigns codes per 8; IQ2_S/IQ3_S: sign bytes
    per 8; None for IQ1_S) and ``shift`` (IQ1_S: True where the sub-block's delta is −1/8)."""

    qtype: str
    rows: int
    n: int
    scale: torch.Tensor
    entry: torch.Tensor
    signs: torch.Tensor | None
    shift: torch.Tensor | None

    def codes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(d as stored, float32 (S,); each sub-block's scale code l (S × sub-blocks, int64))."""
        div, lmax, fudge = STAGE2[self.qtype]
        m = self.scale.amax(1).clamp_min(0)
        d = m / div
        live = m > 0
        safe = torch.where(live, d, torch.ones_like(d))
        l = torch.clamp(nearest_int(0.5 * ((torch.ones_like(safe) / safe)[:, None] * self.scale - 1)), 0, lmax).to(torch.int64)
        stored = d if fudge is None else d * float(np.float32(fudge))
        stored = torch.where(live, stored, torch.zeros_like(stored)).to(torch.float16).to(torch.float32)
        return stored, torch.where(live[:, None], l, torch.zeros_like(l))


def _bytes_u16(v: torch.Tensor) -> torch.Tensor:
    """(…, k) integers < 2^16 as (…, 2k) little-endian bytes."""
    v = v.to(torch.int64)
    return torch.stack([v & 255, (v >> 8) & 255], -1).reshape(*v.shape[:-1], -1)


def _bytes_u32(v: torch.Tensor) -> torch.Tensor:
    v = v.to(torch.int64)
    return torch.stack([(v >> s) & 255 for s in (0, 8, 16, 24)], -1).reshape(*v.shape[:-1], -1)


def pack(sr: Search) -> torch.Tensor:
    """The block bytes (S × type_size, flattened; uint8) of `sr`, on its device."""
    d, l = sr.codes()
    dev = sr.scale.device
    S = sr.scale.shape[0]
    d16 = _bytes_u16(d.to(torch.float16).view(torch.int16).to(torch.int64).unsqueeze(1) & 0xFFFF)
    e = sr.entry.to(torch.int64)
    if sr.qtype == "IQ2_XXS":  # per sub-block: 4 index bytes, then signs | l << 28
        aux = (sr.signs.to(torch.int64) << torch.arange(0, 28, 7, device=dev)).sum(-1) | (l << 28)
        body = torch.cat([e, _bytes_u32(aux.unsqueeze(-1))], -1).reshape(S, 64)
        parts = [d16, body]
    elif sr.qtype == "IQ2_S":  # qs: 32 low index bytes, 32 sign bytes; qh: 2 bits per group; scales: nibbles
        e = e.reshape(S, 32)
        qh = ((e >> 8).reshape(S, 8, 4) << torch.arange(0, 8, 2, device=dev)).sum(-1)
        sc = l[:, 0::2] | (l[:, 1::2] << 4)
        parts = [d16, e & 255, sr.signs.to(torch.int64).reshape(S, 32), qh, sc]
    elif sr.qtype == "IQ3_S":  # qs: 64 low index bytes; qh: 1 bit per group; signs: 32 bytes; scales: nibbles
        qh = ((e.reshape(S, 64) >> 8).reshape(S, 8, 8) << torch.arange(8, device=dev)).sum(-1)
        sc = l[:, 0::2] | (l[:, 1::2] << 4)
        # quantize_row_iq3_s_impl skips an all-zero sub-block with `continue` before its `qs += bs4;
        # signs += bs8;`: the later sub-blocks' indices and signs move up a slot, the last slots stay 0
        # (qh and the scales are indexed by the sub-block and do not move)
        dead = sr.scale == 0
        slot = torch.arange(8, device=dev) - (torch.cumsum(dead.to(torch.int64), 1) - dead.to(torch.int64))
        slot = torch.where(dead, torch.full_like(slot, 8), slot)  # a dead sub-block writes nothing
        lo = torch.zeros(S, 9, 8, dtype=torch.int64, device=dev).scatter_(1, slot[..., None].expand(S, 8, 8), e & 255)
        sg = torch.zeros(S, 9, 4, dtype=torch.int64, device=dev).scatter_(
            1, slot[..., None].expand(S, 8, 4), sr.signs.to(torch.int64))
        parts = [d16, lo[:, :8].reshape(S, 64), qh, sg[:, :8].reshape(S, 32), sc]
    elif sr.qtype == "IQ1_S":  # qs: 32 low index bytes; qh (uint16 per sub-block): 3 bits per group, l, the shift
        h = ((e >> 8) << torch.arange(0, 12, 3, device=dev)).sum(-1) | (l << 12) | (sr.shift.to(torch.int64) << 15)
        parts = [d16, (e & 255).reshape(S, 32), _bytes_u16(h)]
    else:
        raise KeyError(sr.qtype)
    out = torch.cat(parts, 1).to(torch.uint8)
    assert out.shape[1] == qt.get(sr.qtype).type_size, (sr.qtype, out.shape)
    return out.reshape(-1)
