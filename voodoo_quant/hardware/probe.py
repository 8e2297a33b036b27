"""The torch facts that hardware detection looks at, gathered in one injectable object.

Detection never calls torch itself: it reads a :class:`TorchProbe`. :func:`probe_torch` fills one
from the running torch; tests build one by hand to fake CUDA, ROCm (any gfx arch) or a CPU box.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

# Variables that hide or reorder GPUs; shown in reasons so "no GPU found" can be explained.
VISIBILITY_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


@dataclass(frozen=True)
class GPUInfo:
    index: int
    name: str
    total_memory: int = 0  # bytes
    # ROCm: torch's gcnArchName, e.g. "gfx90a:sramecc+:xnack-"; None on CUDA.
    gcn_arch: str | None = None
    # CUDA compute capability (major, minor); ROCm reports a nominal value we ignore.
    capability: tuple[int, int] | None = None


@dataclass(frozen=True)
class TorchProbe:
    torch_version: str
    cuda_version: str | None = None  # torch.version.cuda: set on CUDA builds
    hip_version: str | None = None  # torch.version.hip: set on ROCm builds
    available: bool = False  # torch.cuda.is_available()
    gpus: tuple[GPUInfo, ...] = ()
    visibility: Mapping[str, str] = field(default_factory=dict)
    # Why torch could not enumerate devices (an exception text), if it could not.
    error: str | None = None


def probe_torch(environ: Mapping[str, str] | None = None) -> TorchProbe:
    """Read the facts from the imported torch. Never raises for a missing/broken GPU stack."""
    import os

    import torch

    env = os.environ if environ is None else environ
    visibility = {k: env[k] for k in VISIBILITY_VARS if k in env}
    cuda_version = getattr(torch.version, "cuda", None)
    hip_version = getattr(torch.version, "hip", None)
    gpus: list[GPUInfo] = []
    error = None
    try:
        available = bool(torch.cuda.is_available())
        if available:
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                gcn = getattr(p, "gcnArchName", None) if hip_version else None
                cap = None if hip_version else (int(p.major), int(p.minor))
                gpus.append(GPUInfo(i, str(p.name), int(p.total_memory), gcn or None, cap))
    except Exception as e:  # a broken driver must not crash detection; it becomes the reason
        available = False
        error = f"{type(e).__name__}: {e}"
        gpus = []
    return TorchProbe(
        torch_version=str(torch.__version__),
        cuda_version=cuda_version,
        hip_version=hip_version,
        available=available,
        gpus=tuple(gpus),
        visibility=visibility,
        error=error,
    )
