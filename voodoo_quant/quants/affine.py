"""The affine form every quantized ggml type dequantizes through: ``w = scale · code (+ offset)``.

Every block type but the floats stores, per sub-block of a few weights, a float scale (and for
some types an offset) and small integer codes; ``to_float`` computes ``scale * code`` (one
rounding) and, where the type has one, adds the offset (a second rounding, never fused). The
kernels return that form (:class:`Affine`) and :func:`expand` does the arithmetic, so the codes and
scales that :mod:`voodoo_quant.candidates.compact` keeps are by construction the ones ``to_float`` uses.

A code is an integer in int8 range for every type (IQ1's ``grid + delta`` is stored as
``8 · (grid + delta)`` with the scale divided by 8: both exact, the same product).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Affine:
    """Per block: ``code`` (n, n_sub, sub_len) integers (any dtype), ``scale`` and ``offset`` (None
    for types without one) (n, n_sub) float32."""

    code: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None = None

    @classmethod
    def of(cls, code: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None = None) -> "Affine":
        """Normalize shapes: `scale`'s elements in order are the sub-blocks of `code`'s."""
        n = code.shape[0]
        scale = scale.reshape(n, -1)
        code = code.reshape(n, scale.shape[1], -1)
        if offset is not None:
            offset = offset.reshape(scale.shape)
        return cls(code, scale, offset)

    @property
    def sub_len(self) -> int:
        return int(self.code.shape[2])


def expand(a: Affine) -> torch.Tensor:
    """The float32 weights (n, n_sub · sub_len): ``scale * code``, then ``+ offset``."""
    w = a.scale.unsqueeze(-1) * a.code.float()
    if a.offset is not None:
        w = w + a.offset.unsqueeze(-1)
    return w.reshape(a.code.shape[0], -1)
