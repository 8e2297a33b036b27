"""IQ types: IQ4_NL, IQ4_XS, IQ3_S, IQ3_XXS, IQ2_S, IQ2_XS, IQ2_XXS, IQ1_S, IQ1_M; and MXFP4.

Formulas, bit layouts and float operation order follow ``dequantize_row_iq*`` (and
``dequantize_row_mxfp4``) in llama.cpp ``ggml/src/ggml-quants.c``; struct layouts are those of
``ggml/src/ggml-common.h``. The lookup tables come from :mod:`.grids` (read out of libggml-base).

Operation order matters for bit-exactness: IQ2/IQ3 compute ``db * grid[j] * sign`` left to
right, with ``db`` itself rounded first (``d * (0.5f + s) * 0.25f``); IQ1 computes
``dl * (grid[j] + delta)``.
"""

from __future__ import annotations

import torch

from . import _fields as f
from ._registry import register
from .affine import Affine
from .grids import table

_DELTA = 0.125  # IQ1S_DELTA / IQ1M_DELTA (ggml-common.h)


def _ar(n: int, step: int, device) -> torch.Tensor:
    return f.ar(0, n * step, step, device)


def _nibble_codes(qs: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """(n, m, 16) bytes -> (n, m, 32) codebook values: low nibbles first, then high ones."""
    return kv[torch.cat([qs & 0xF, qs >> 4], dim=-1).to(torch.int32)]


@register("IQ4_NL")
def iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    d = f.f16(blocks, 0)
    kv = table("kvalues_iq4nl", blocks.device)
    return Affine.of(_nibble_codes(f.raw8(blocks, 2, 16), kv), d)


@register("IQ4_XS")
def iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    # block_iq4_xs: d, scales_h (uint16), scales_l[4], qs[128]
    n, dev = blocks.shape[0], blocks.device
    d = f.f16(blocks, 0)
    sh = f.uint(blocks, 2, 1, 2)  # (n, 1)
    sl = f.u8(blocks, 4, 4).repeat_interleave(2, dim=1)  # sl[ib // 2]
    ls = ((sl >> (4 * (f.ar(0, 8, 1, dev) % 2))) & 0xF) | (((sh >> _ar(8, 2, dev)) & 3) << 4)
    dl = d[:, None] * (ls - 32).float()
    q = _nibble_codes(f.u8(blocks, 8, 128).view(n, 8, 16), table("kvalues_iq4nl", dev))
    return Affine.of(q, dl)


@register("MXFP4")
def mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    # block_mxfp4: e (E8M0), qs[16]. GGML_E8M0_TO_FP32_HALF (ggml-impl.h): 2^(e-128), with the
    # two smallest exponents given as float32 denormal bit patterns.
    e = f.u8(blocks, 0, 1)[:, 0]
    bits_ = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(torch.int32)
    d = bits_.view(torch.float32)
    x = _nibble_codes(f.u8(blocks, 1, 16), table("kvalues_mxfp4", blocks.device))
    return Affine.of(x, d)


def _iq2_db(d: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``d * (0.5f + s) * 0.25f`` with `s` an integer tensor broadcast against d[:, None]."""
    return d[:, None] * (0.5 + s.float()) * 0.25


def _ksigns(aux: torch.Tensor) -> torch.Tensor:
    """Signs of 4 groups of 8 from the 4 × 7-bit ksigns indices packed in a uint32: (…, 4, 8)."""
    idx = (aux.unsqueeze(-1) >> _ar(4, 7, aux.device)) & 127
    return table("ksigns_iq2xs", aux.device)[idx]


@register("IQ2_XXS")
def iq2_xxs(blocks: torch.Tensor) -> torch.Tensor:
    # block_iq2_xxs: d, qs[32] (uint16) = per 32 weights 4 grid-index bytes + a uint32 aux
    n = blocks.shape[0]
    d = f.f16(blocks, 0)
    raw = f.u8(blocks, 2, 64).view(n, 8, 8)
    aux = f.uint(blocks, 2, 16, 4).view(n, 8, 2)[:, :, 1]
    db = _iq2_db(d, (aux >> 28) & 0xF)
    grid = table("iq2xxs_grid", blocks.device)[raw[:, :, 0:4]]  # (n, 8, 4, 8)
    return Affine.of(grid * _ksigns(aux), db)  # db * grid * sign, left to right: the sign is exact


@register("IQ2_XS")
def iq2_xs(blocks: torch.Tensor) -> torch.Tensor:
    # block_iq2_xs: d, qs[32] (uint16: 9-bit grid index | 7-bit ksigns index << 9), scales[8]
    n, dev = blocks.shape[0], blocks.device
    d = f.f16(blocks, 0)
    qs = f.uint(blocks, 2, 32, 2).view(n, 8, 4)
    sc = f.u8(blocks, 66, 8)
    db = torch.stack([_iq2_db(d, sc & 0xF), _iq2_db(d, sc >> 4)], dim=2)  # (n, 8, 2)
    db = db.repeat_interleave(2, dim=2)  # db[l / 2]
    grid = table("iq2xs_grid", dev)[qs & 511]
    signs = table("ksigns_iq2xs", dev)[qs >> 9]
    return Affine.of(grid * signs, db)


@register("IQ2_S")
def iq2_s(blocks: torch.Tensor) -> torch.Tensor:
    # block_iq2_s: d, qs[64] (32 index low bytes, then 32 sign bytes), qh[8], scales[8]
    n, dev = blocks.shape[0], blocks.device
    d = f.f16(blocks, 0)
    lo = f.u8(blocks, 2, 32).view(n, 8, 4)
    signs = f.u8(blocks, 34, 32).view(n, 8, 4)
    qh = f.u8(blocks, 66, 8)
    sc = f.u8(blocks, 74, 8)
    idx = lo | (((qh[:, :, None] >> _ar(4, 2, dev)) & 3) << 8)
    db = torch.stack([_iq2_db(d, sc & 0xF), _iq2_db(d, sc >> 4)], dim=2).repeat_interleave(2, dim=2)
    grid = table("iq2s_grid", dev)[idx]
    return Affine.of(grid * f.sign_from_bits(f.bits(signs, 8)), db)


@register("IQ3_XXS")
def iq3_xxs(blocks: torch.Tensor) -> torch.Tensor:
    # block_iq3_xxs: d, qs[64] grid indices (4 weights each), then 8 uint32 scales_and_signs
    n, dev = blocks.shape[0], blocks.device
    d = f.f16(blocks, 0)
    qs = f.u8(blocks, 2, 64).view(n, 8, 8)
    aux = f.uint(blocks, 66, 8, 4)
    db = d[:, None] * (0.5 + ((aux >> 28) & 0xF).float()) * 0.5
    grid = table("iq3xxs_grid", dev)[qs].view(n, 8, 4, 8)  # two 4-entries per group of 8
    return Affine.of(grid * _ksigns(aux), db)  # db * grid * sign, left to right: the sign is exact


@register("IQ3_S")
def iq3_s(blocks: torch.Tensor) -> torch.Tensor:
    # block_iq3_s: d, qs[64], qh[8], signs[32], scales[4]; index m of group k takes bit m of qh[k]
    n, dev = blocks.shape[0], blocks.device
    d = f.f16(blocks, 0)
    qs = f.u8(blocks, 2, 64).view(n, 8, 8)
    qh = f.u8(blocks, 66, 8)
    signs = f.u8(blocks, 74, 32).view(n, 8, 4)
    sc = f.u8(blocks, 106, 4).repeat_interleave(2, dim=1)  # scales[k / 2]
    nib = (sc >> (4 * (f.ar(0, 8, 1, dev) % 2))) & 0xF
    db = d[:, None] * (1 + 2 * nib).float()
    idx = qs | (((qh[:, :, None] >> f.ar(0, 8, 1, dev)) & 1) << 8)
    grid = table("iq3s_grid", dev)[idx].view(n, 8, 4, 8)
    return Affine.of(grid * f.sign_from_bits(f.bits(signs, 8)), db)


def _iq1(dl: torch.Tensor, idx: torch.Tensor, negative: torch.Tensor) -> Affine:
    """``dl * (grid[j] + delta)`` over (n, 8 groups, 4 runs, 8 weights), as the integer code
    ``8 · (grid + delta)`` and the scale ``dl / 8``: both exact (delta = ±1/8, a power-of-two
    scale of a normal float), so their product is the same real number, rounded once."""
    delta = torch.where(negative, -_DELTA, _DELTA).to(torch.float32)
    grid = table("iq1s_grid", idx.device)[idx]
    return Affine.of((grid + delta[..., None]) * 8.0, dl * 0.125)


@register("IQ1_S")
def iq1_s(blocks: torch.Tensor) -> torch.Tensor:
    # block_iq1_s: d, qs[32], qh[8] (uint16: 4 × 3 index high bits, 3-bit scale, delta sign)
    n, dev = blocks.shape[0], blocks.device
    d = f.f16(blocks, 0)
    qs = f.u8(blocks, 2, 32).view(n, 8, 4)
    qh = f.uint(blocks, 34, 8, 2)
    dl = d[:, None] * (2 * ((qh >> 12) & 7) + 1).float()
    idx = qs | (((qh[:, :, None] >> _ar(4, 3, dev)) & 7) << 8)
    neg = ((qh & 0x8000) != 0)[:, :, None].expand(n, 8, 4)
    return _iq1(dl[:, :, None].expand(n, 8, 4), idx, neg)


@register("IQ1_M")
def iq1_m(blocks: torch.Tensor) -> torch.Tensor:
    # block_iq1_m: qs[32], qh[16], scales[8] (4 uint16: 4 × 3-bit sub-scales + 4 bits of the fp16 d)
    n, dev = blocks.shape[0], blocks.device
    qs = f.u8(blocks, 0, 32).view(n, 8, 4)
    qh = f.u8(blocks, 32, 16).view(n, 8, 2).repeat_interleave(2, dim=2)  # qh[l / 2]
    sc = f.uint(blocks, 48, 4, 2)
    d_bits = (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0x00F0) | ((sc[:, 2] >> 4) & 0x0F00) | (sc[:, 3] & 0xF000)
    d = f.u16_to_f32_via_f16(d_bits)
    s = sc.repeat_interleave(2, dim=1)  # sc[ib / 2]
    shift = 6 * (f.ar(0, 8, 1, dev) % 2)
    dl1 = d[:, None] * (2 * ((s >> shift) & 7) + 1).float()
    dl2 = d[:, None] * (2 * ((s >> (shift + 3)) & 7) + 1).float()
    dl = torch.stack([dl1, dl1, dl2, dl2], dim=2)  # (n, 8, 4)
    odd = 4 * (f.ar(0, 4, 1, dev) % 2)  # runs 1 and 3 use the high half of qh
    idx = qs | (((qh >> odd) & 7) << 8)
    neg = ((qh >> odd) & 0x08) != 0
    return _iq1(dl, idx, neg)
