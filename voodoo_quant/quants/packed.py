"""A tensor kept as its packed ggml bytes, dequantized on demand on its own device."""

from __future__ import annotations

import numpy as np
import torch

from ..core import qtypes as qt
from ..core.errors import QuantizationInputError
from ._registry import dequantize, kernel


class PackedTensor:
    """The quantized bytes of one tensor (uint8 torch tensor) with their ggml type and shape.

    ``shape`` is in ggml row order (last dim = row length), like the float tensor it stands for.
    Construction checks the byte count and that a kernel exists, so a bad candidate fails when it
    is loaded, not in the middle of a training step.
    """

    __slots__ = ("data", "qtype", "shape", "name")

    def __init__(self, data: torch.Tensor, qtype: str | qt.QType, shape, *, name: str = "tensor"):
        q = qt.get(qtype)
        shape = tuple(int(s) for s in shape)
        if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8:
            got = data.dtype if isinstance(data, torch.Tensor) else type(data).__name__
            raise QuantizationInputError(f"{name}: packed data must be a uint8 torch tensor, got {got}")
        expected = qt.tensor_bytes(q, shape)
        if data.numel() != expected:
            raise QuantizationInputError(
                f"{name}: {data.numel()} bytes for a {q.name} tensor of shape {shape}, expected {expected}"
            )
        kernel(q)  # raises UnknownQuantTypeError when the type has no torch kernel
        self.data = data.reshape(-1).contiguous()
        self.qtype = q.name
        self.shape = shape
        self.name = name

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview | np.ndarray, qtype: str | qt.QType, shape,
                   *, device: torch.device | str = "cpu", name: str = "tensor") -> "PackedTensor":
        """Wrap bytes from ggml (e.g. ``ggml.lib().quantize``) or a GGUF file; copies them once."""
        arr = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.view(np.uint8).reshape(-1)
        return cls(torch.from_numpy(arr.copy()).to(device), qtype, shape, name=name)

    @property
    def nbytes(self) -> int:
        """Bytes held (the packed size; what --lazy keeps in memory per candidate)."""
        return self.data.numel()

    @property
    def device(self) -> torch.device:
        return self.data.device

    def to(self, device: torch.device | str) -> "PackedTensor":
        if torch.device(device) == self.data.device:
            return self
        return PackedTensor(self.data.to(device), self.qtype, self.shape, name=self.name)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float tensor (ggml ``to_float``, bit-exact), on this tensor's device, cast to `dtype`."""
        w = dequantize(self.data, self.qtype, self.shape, name=self.name)
        return w if dtype == torch.float32 else w.to(dtype)

    def __repr__(self) -> str:
        return f"PackedTensor({self.name!r}, {self.qtype}, shape={self.shape}, {self.nbytes} bytes, {self.device})"
