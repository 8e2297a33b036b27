"""The registry of torch dequantization kernels, keyed by ggml type name.

A kernel takes the packed blocks of a tensor as a ``(n_blocks, type_size)`` uint8 tensor and
returns, on the same device, the blocks' :class:`.Affine` form (codes, scales, offsets: every
quantized type) or ``(n_blocks, block)`` float32 (the float types). Block sizes and bytes per block come
from the one type table (:mod:`voodoo_quant.core.qtypes`); nothing here re-declares them.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..core import qtypes as qt
from ..core.errors import QuantizationInputError, UnknownQuantTypeError
from .affine import Affine, expand

Kernel = Callable[[torch.Tensor], "torch.Tensor | Affine"]

_KERNELS: dict[str, Kernel] = {}


def register(name: str) -> Callable[[Kernel], Kernel]:
    """Decorator: register the kernel of type `name`; refuses duplicates and unknown types."""
    q = qt.get(name)

    def deco(fn: Kernel) -> Kernel:
        if q.name in _KERNELS:
            raise ValueError(f"a dequantization kernel for {q.name} is already registered")
        _KERNELS[q.name] = fn
        return fn

    return deco


def supported_types() -> tuple[str, ...]:
    """Types with a torch kernel, in the order of the type table."""
    return tuple(n for n in qt.QTYPES if n in _KERNELS)


def kernel(qtype: str | qt.QType) -> Kernel:
    q = qt.get(qtype)
    fn = _KERNELS.get(q.name)
    if fn is None:
        raise UnknownQuantTypeError(
            f"no torch dequantization kernel for {q.name}; supported: {', '.join(supported_types())}"
        )
    return fn


def _blocks(packed: torch.Tensor, q: qt.QType, shape: tuple[int, ...], name: str) -> torch.Tensor:
    """`packed` as (n_blocks, type_size), after checking its dtype and byte count."""
    if not shape or any(s < 0 for s in shape):
        raise QuantizationInputError(f"{name}: invalid shape {shape}")
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        got = packed.dtype if isinstance(packed, torch.Tensor) else type(packed).__name__
        raise QuantizationInputError(f"{name}: packed data must be a uint8 torch tensor, got {got}")
    expected = qt.tensor_bytes(q, shape)  # also refuses a row length that is not a block multiple
    if packed.numel() != expected:
        raise QuantizationInputError(
            f"{name}: {packed.numel()} bytes given for a {q.name} tensor of shape {shape}, expected {expected}"
        )
    return packed.reshape(-1, q.type_size)


def dequantize(packed: torch.Tensor, qtype: str | qt.QType, shape, *, name: str = "tensor") -> torch.Tensor:
    """float32 tensor of `shape` from the packed ggml bytes of a `qtype` tensor (ggml ``to_float``).

    `packed` is a uint8 tensor of exactly ``qtypes.tensor_bytes(qtype, shape)`` elements, on any
    device; the result is on the same device. Bit-exact with libggml-base's ``to_float``.
    """
    q = qt.get(qtype)
    shape = tuple(int(s) for s in shape)
    blocks = _blocks(packed, q, shape, name)
    fn = kernel(q)
    if blocks.numel() == 0:
        return torch.zeros(shape, dtype=torch.float32, device=packed.device)
    out = fn(blocks)
    return (expand(out) if isinstance(out, Affine) else out).reshape(shape)


def decompose(packed: torch.Tensor, qtype: str | qt.QType, shape, *, name: str = "tensor") -> Affine | None:
    """The :class:`.Affine` form (codes, scales, offsets, in the tensor's element order) that
    :func:`dequantize` expands, or None for the float types (and an empty tensor)."""
    q = qt.get(qtype)
    shape = tuple(int(s) for s in shape)
    blocks = _blocks(packed, q, shape, name)
    if blocks.numel() == 0:
        return None
    out = kernel(q)(blocks)
    return out if isinstance(out, Affine) else None
