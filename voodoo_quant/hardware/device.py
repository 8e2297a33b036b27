"""Turning a ``--device`` string into a torch.device that exists.

The default is CPU: a GPU is used only when the user names it, never silently.
"""

from __future__ import annotations

import re

from ..core.errors import DeviceError
from .detect import ROCM, Accelerator, detect

_CUDA_RE = re.compile(r"^cuda(?::(\d+))?$")


def available_devices(accel: Accelerator) -> list[str]:
    return ["cpu"] + [f"cuda:{i}" for i in accel.devices]


def resolve_device(spec: str | None, accel: Accelerator | None = None):
    """``"cpu"`` | ``"cuda"`` (= cuda:0) | ``"cuda:N"`` -> torch.device, checked against what exists.

    ``None`` or ``""`` means CPU. ROCm GPUs are addressed as ``cuda[:N]``, as in torch.
    """
    import torch

    s = (spec or "cpu").strip().lower()
    if s == "cpu":
        return torch.device("cpu")
    a = accel if accel is not None else detect()
    exists = ", ".join(available_devices(a))
    if s in ("rocm", "hip") or s.startswith(("rocm:", "hip:")):
        raise DeviceError(f"device {spec!r}: ROCm GPUs are addressed as cuda[:N] in torch; available: {exists}")
    m = _CUDA_RE.match(s)
    if m is None:
        raise DeviceError(f"device {spec!r} is not 'cpu', 'cuda' or 'cuda:N'; available: {exists}")
    if not a.is_gpu:
        raise DeviceError(f"device {spec!r} requested but no GPU is usable: {a.reason}; available: {exists}")
    index = int(m.group(1) or 0)
    if index not in a.devices:
        vendor = "ROCm" if a.kind == ROCM else "CUDA"
        raise DeviceError(
            f"device {spec!r} does not exist: {len(a.devices)} {vendor} device(s); available: {exists}"
        )
    return torch.device("cuda", index)
