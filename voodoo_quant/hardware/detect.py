"""Which accelerator this torch can use, and why.

CUDA and ROCm builds of torch both expose devices as ``cuda:N`` (HIP is mapped onto the CUDA
API); ``torch.version.hip`` is what tells them apart (torchao ``utils.is_ROCM`` does the same).
"""

from __future__ import annotations

from dataclasses import dataclass

from .probe import TorchProbe, probe_torch

CPU, CUDA, ROCM = "cpu", "cuda", "rocm"


@dataclass(frozen=True)
class Accelerator:
    kind: str  # "cpu" | "cuda" | "rocm"
    devices: tuple[int, ...]  # torch indices (cuda:N), empty on CPU
    names: tuple[str, ...]
    arch: tuple[str, ...]  # per device: "gfx942" (ROCm) or "sm_90" (CUDA)
    reason: str
    torch_build: str  # "CPU", "CUDA 12.8", "ROCm 6.4.1"

    @property
    def is_gpu(self) -> bool:
        return self.kind != CPU

    @property
    def dist_backend(self) -> str:
        # RCCL is registered under the "nccl" name on ROCm builds; gloo is the CPU backend.
        return "nccl" if self.is_gpu else "gloo"

    @property
    def collective_library(self) -> str:
        return {CUDA: "NCCL", ROCM: "RCCL"}.get(self.kind, "gloo")


def base_gfx(gcn_arch: str) -> str:
    """``gfx90a:sramecc+:xnack-`` -> ``gfx90a`` (the feature flags do not change the kernels)."""
    return gcn_arch.split(":", 1)[0].strip()


def torch_build(probe: TorchProbe) -> str:
    if probe.hip_version:
        return f"ROCm {probe.hip_version}"
    if probe.cuda_version:
        return f"CUDA {probe.cuda_version}"
    return "CPU"


def _visibility_note(probe: TorchProbe) -> str:
    if not probe.visibility:
        return ""
    return " (" + ", ".join(f"{k}={v!r}" for k, v in sorted(probe.visibility.items())) + ")"


def detect(probe: TorchProbe | None = None) -> Accelerator:
    """The accelerator and the reason it was (or was not) chosen. Pure given the probe."""
    p = probe if probe is not None else probe_torch()
    build = torch_build(p)

    def cpu(reason: str) -> Accelerator:
        return Accelerator(CPU, (), (), (), reason, build)

    if not p.cuda_version and not p.hip_version:
        return cpu(f"torch {p.torch_version} is a CPU-only build (torch.version.cuda and torch.version.hip are None)")
    vendor = "ROCm" if p.hip_version else "CUDA"
    if p.error:
        return cpu(f"torch {p.torch_version} is a {build} build but querying devices failed: {p.error}")
    if not p.available or not p.gpus:
        return cpu(
            f"torch {p.torch_version} is a {build} build but torch.cuda.is_available() found no {vendor} "
            f"device{_visibility_note(p)}"
        )
    if p.hip_version:
        arch = tuple(base_gfx(g.gcn_arch) if g.gcn_arch else "gfx?" for g in p.gpus)
        kind = ROCM
    else:
        arch = tuple(f"sm_{g.capability[0]}{g.capability[1]}" if g.capability else "sm_?" for g in p.gpus)
        kind = CUDA
    names = tuple(g.name for g in p.gpus)
    listing = ", ".join(f"cuda:{g.index} {g.name} ({a})" for g, a in zip(p.gpus, arch))
    reason = (
        f"torch {p.torch_version} is a {build} build (torch.version.{'hip' if p.hip_version else 'cuda'}="
        f"{p.hip_version or p.cuda_version}) and sees {len(p.gpus)} device(s): {listing}{_visibility_note(p)}"
    )
    return Accelerator(kind, tuple(g.index for g in p.gpus), names, arch, reason, build)
