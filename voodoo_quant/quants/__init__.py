"""Torch dequantization kernels for ``--lazy``: candidates stay packed, dequantized on device.

:func:`dequantize` turns the packed ggml bytes of a tensor (a uint8 torch tensor, on any device)
into float32 on that device, bit-exact with libggml-base's ``to_float``; :class:`PackedTensor`
carries the bytes with their type and shape. One module per family registers its kernels:
:mod:`.floats`, :mod:`.legacy`, :mod:`.kquants`, :mod:`.iquants` (tables in :mod:`.grids`).
Kernels are pure torch ops vectorized over blocks, so the same code runs on CPU, CUDA or ROCm.
"""

from __future__ import annotations

from . import floats, iquants, kquants, legacy  # noqa: F401  (self-registering kernels)
from ._registry import decompose, dequantize, kernel, supported_types
from .affine import Affine, expand
from .packed import PackedTensor

__all__ = ["Affine", "PackedTensor", "decompose", "dequantize", "expand", "kernel", "supported_types"]
