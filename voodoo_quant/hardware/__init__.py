"""Everything vendor-specific (CUDA vs ROCm vs CPU) lives in this package.

- :mod:`.probe` gathers the torch facts (injectable, so tests fake any GPU);
- :mod:`.detect` decides the accelerator and says why;
- :mod:`.attention` picks the SDPA backend (the ROCm AOTriton question);
- :mod:`.envdefaults` proposes allocator / NCCL-RCCL / thread variables (never applied here);
- :mod:`.device` validates ``--device``.
"""

from .attention import AttentionChoice, attention_backend
from .detect import CPU, CUDA, ROCM, Accelerator, detect
from .device import available_devices, resolve_device
from .envdefaults import (
    EnvSetting, apply_env_defaults, env_defaults, env_settings, host_env_defaults, host_env_settings,
)
from .probe import GPUInfo, TorchProbe, probe_torch

__all__ = [
    "CPU", "CUDA", "ROCM", "Accelerator", "AttentionChoice", "EnvSetting", "GPUInfo", "TorchProbe",
    "apply_env_defaults", "attention_backend", "available_devices", "detect", "env_defaults",
    "env_settings", "host_env_defaults", "host_env_settings", "probe_torch", "resolve_device",
]
