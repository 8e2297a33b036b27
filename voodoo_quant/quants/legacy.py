"""Legacy 32-weight block types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (MXFP4 is with the codebook types, in iquants).

Formulas and float operation order follow ``dequantize_row_*`` in llama.cpp
``ggml/src/ggml-quants.c``: ``x*d`` for the symmetric types, ``x*d + m`` for the ``_1`` types
(two roundings: a product, then a sum; never fused), returned as their :class:`.Affine` form. Block layouts: ``ggml/src/ggml-common.h``.
"""

from __future__ import annotations

import torch

from . import _fields as f
from ._registry import register
from .affine import Affine


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes -> 32 codes: low nibbles are weights 0..15, high nibbles 16..31."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _high_bits(blocks: torch.Tensor, off: int) -> torch.Tensor:
    """The 5th bit of the 32 codes of Q5_0/Q5_1: bit j of the uint32 ``qh`` belongs to weight j."""
    qh = f.raw8(blocks, off, 4)  # bit j of the little-endian uint32 = bit j % 8 of byte j // 8
    shifts = torch.arange(8, device=blocks.device, dtype=torch.uint8)
    return (((qh.unsqueeze(-1) >> shifts) & 1) << 4).reshape(-1, 32)


@register("Q4_0")
def q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = f.f16(blocks, 0)
    x = _nibbles(f.raw8(blocks, 2, 16)).float() - 8.0  # == float(q - 8): small ints are exact
    return Affine.of(x, d)


@register("Q4_1")
def q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = f.f16(blocks, 0), f.f16(blocks, 2)
    x = _nibbles(f.raw8(blocks, 4, 16))
    return Affine.of(x, d, m)


@register("Q5_0")
def q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = f.f16(blocks, 0)
    x = (_nibbles(f.raw8(blocks, 6, 16)) | _high_bits(blocks, 2)).float() - 16.0
    return Affine.of(x, d)


@register("Q5_1")
def q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = f.f16(blocks, 0), f.f16(blocks, 2)
    x = _nibbles(f.raw8(blocks, 8, 16)) | _high_bits(blocks, 4)
    return Affine.of(x, d, m)


@register("Q8_0")
def q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = f.f16(blocks, 0)
    return Affine.of(f.i8(blocks, 2, 32), d)
