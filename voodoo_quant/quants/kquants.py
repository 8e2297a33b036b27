"""K-quants (256-weight super-blocks): Q2_K, Q3_K, Q4_K, Q5_K, Q6_K.

Formulas, bit layouts and float operation order follow ``dequantize_row_q*_K`` in llama.cpp
``ggml/src/ggml-quants.c`` (struct layouts: ``ggml/src/ggml-common.h``). ggml first rounds the
sub-block scale (``dl = d * sc``, ``ml = dmin * m``) and then computes ``dl * q - ml``: two more
roundings, never fused. Q6_K is ``d * sc * q`` evaluated left to right.

Each kernel lays the codes out in output order, ``(n_blocks, n_sub, sub_len)``, so that one
scale broadcasts over its sub-block.
"""

from __future__ import annotations

import torch

from . import _fields as f
from ._registry import register
from .affine import Affine


def _crumbs(q: torch.Tensor) -> torch.Tensor:
    """(n, 64) bytes of 2-bit codes -> (n, 256) in ggml order.

    For each 128-weight half n, its 32 bytes give four runs of 32 weights, at bit shifts 0, 2, 4, 6.
    """
    n = q.shape[0]
    shifts = f.ar(0, 8, 2, q.device).view(1, 1, 4, 1)
    return ((q.view(n, 2, 1, 32) >> shifts) & 3).reshape(n, 256)


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``get_scale_min_k4`` for j = 0..7 of the 12 scale bytes of Q4_K/Q5_K: 6-bit (scale, min)."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([lo & 63, (hi & 0xF) | ((lo >> 6) << 4)], dim=1)
    mn = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=1)
    return sc, mn


@register("Q2_K")
def q2_k(blocks: torch.Tensor) -> torch.Tensor:
    # block_q2_K: scales[16], qs[64], d, dmin
    n = blocks.shape[0]
    sc = f.u8(blocks, 0, 16)
    q = _crumbs(f.u8(blocks, 16, 64)).view(n, 16, 16)
    d, dmin = f.f16(blocks, 80), f.f16(blocks, 82)
    dl = d[:, None] * (sc & 0xF).float()
    ml = dmin[:, None] * (sc >> 4).float()
    return Affine.of(q, dl, -ml)  # dl * q - ml


def _q3_k_scales(s: torch.Tensor) -> torch.Tensor:
    """The 16 signed 6-bit scales of Q3_K (already minus 32), from its 12 packed bytes.

    Scale j: low nibble of byte j (j < 8) or the high nibble of byte j-8; its top two bits are
    bits 2*(j//4) of byte 8 + j%4 (the ``aux``/``kmask`` shuffle of dequantize_row_q3_K).
    """
    low = torch.cat([s[:, 0:8] & 0xF, s[:, 0:8] >> 4], dim=1)
    shifts = f.ar(0, 8, 2, s.device).view(1, 4, 1)
    high = ((s[:, 8:12].unsqueeze(1) >> shifts) & 3).reshape(-1, 16)
    return (low | (high << 4)) - 32


@register("Q3_K")
def q3_k(blocks: torch.Tensor) -> torch.Tensor:
    # block_q3_K: hmask[32], qs[64], scales[12], d
    n = blocks.shape[0]
    hm = f.u8(blocks, 0, 32)
    q = _crumbs(f.u8(blocks, 32, 64))
    scales = _q3_k_scales(f.u8(blocks, 96, 12))
    d_all = f.f16(blocks, 108)
    # The high bit of run r (0..7, ggml's mask m = 1 << r) is bit r of hmask[l], l = 0..31.
    hbit = f.bits(hm, 8).transpose(1, 2).reshape(n, 256)
    x = q - 4 * (1 - hbit)
    dl = d_all[:, None] * scales.float()
    return Affine.of(x, dl)


def _q45_k(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = f.f16(blocks, 0), f.f16(blocks, 2)
    sc, mn = _scale_min_k4(f.u8(blocks, 4, 12))
    d1 = d[:, None] * sc.float()
    m1 = dmin[:, None] * mn.float()
    return Affine.of(q, d1, -m1)  # d1 * q - m1


def _nibble_runs(ql: torch.Tensor) -> torch.Tensor:
    """(n, 128) bytes -> (n, 8, 32): for each 32-byte chunk, its low nibbles then its high ones."""
    c = ql.view(ql.shape[0], 4, 1, 32)
    return torch.cat([c & 0xF, c >> 4], dim=2).view(ql.shape[0], 8, 32)


@register("Q4_K")
def q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # block_q4_K: d, dmin, scales[12], qs[128]
    return _q45_k(blocks, _nibble_runs(f.u8(blocks, 16, 128)))


@register("Q5_K")
def q5_k(blocks: torch.Tensor) -> torch.Tensor:
    # block_q5_K: d, dmin, scales[12], qh[32], qs[128]; run g (0..7) takes bit g of qh[l] as 16.
    qh = f.bits(f.u8(blocks, 16, 32), 8).transpose(1, 2)  # (n, 8 runs, 32)
    q = _nibble_runs(f.u8(blocks, 48, 128)) + 16 * qh
    return _q45_k(blocks, q)


@register("Q6_K")
def q6_k(blocks: torch.Tensor) -> torch.Tensor:
    # block_q6_K: ql[128], qh[64], scales[16] (int8), d
    n = blocks.shape[0]
    ql = f.u8(blocks, 0, 128).view(n, 2, 1, 2, 32)  # (half, nibble, byte run, l)
    low = torch.cat([ql & 0xF, ql >> 4], dim=2).view(n, 2, 4, 32)  # run k = 2*nibble + byte run
    shifts = f.ar(0, 8, 2, blocks.device).view(1, 1, 4, 1)
    high = (f.u8(blocks, 128, 64).view(n, 2, 1, 32) >> shifts) & 3
    q = (low | (high << 4)) - 32
    sc = f.i8(blocks, 192, 16)
    d = f.f16(blocks, 208)
    dsc = d[:, None] * sc.float()
    return Affine.of(q, dsc)
