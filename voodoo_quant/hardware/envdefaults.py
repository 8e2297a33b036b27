"""Environment defaults per vendor: allocator, collectives, thread caps.

Returned, never applied by the library: ``voodoo tp`` applies them to the environment of the
ranks it launches (values the user already set win), ``voodoo doctor`` prints them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, MutableMapping

from ..errors import ConfigError
from .attention import attention_backend
from .detect import CUDA, ROCM, Accelerator


@dataclass(frozen=True)
class EnvSetting:
    name: str
    value: str
    reason: str


def env_settings(accel: Accelerator, *, local_world_size: int = 1, cpu_count: int | None = None) -> list[EnvSetting]:
    """The variables a run on `accel` with `local_world_size` ranks on this host should have."""
    if local_world_size < 1:
        raise ConfigError(f"local_world_size must be >= 1, got {local_world_size}")
    cpus = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    per_rank = str(max(1, cpus // local_world_size))
    out = [
        EnvSetting("OMP_NUM_THREADS", per_rank,
                   f"{cpus} CPU(s) shared by {local_world_size} rank(s): more OpenMP threads oversubscribe the cores"),
        EnvSetting("VOODOO_QUANT_WORKERS", per_rank,
                   "ggml quantization threads per rank, same cap as OpenMP"),
    ]
    if accel.kind == CUDA:
        out += [
            EnvSetting("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True",
                       "candidate tensors of many sizes fragment the caching allocator; expandable segments avoid OOM from fragmentation"),
            EnvSetting("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1",
                       "a failed or timed-out NCCL collective aborts the rank instead of hanging the job"),
            EnvSetting("NCCL_ASYNC_ERROR_HANDLING", "1", "the same, under the name torch < 2.2 reads"),
        ]
    elif accel.kind == ROCM:
        out += [
            # ROCm torch reads PYTORCH_HIP_ALLOC_CONF (the HIP spelling of PYTORCH_CUDA_ALLOC_CONF).
            EnvSetting("PYTORCH_HIP_ALLOC_CONF", "expandable_segments:True",
                       "candidate tensors of many sizes fragment the caching allocator; expandable segments avoid OOM from fragmentation"),
            EnvSetting("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1",
                       "RCCL runs under torch's nccl backend: a failed collective aborts the rank instead of hanging"),
            EnvSetting("NCCL_ASYNC_ERROR_HANDLING", "1", "the same, under the name torch < 2.2 reads"),
        ]
        attn = attention_backend(accel)
        out += [EnvSetting(k, v, attn.reason) for k, v in attn.env.items()]
    return out


def env_defaults(accel: Accelerator, *, local_world_size: int = 1, cpu_count: int | None = None) -> dict[str, str]:
    """``{name: value}`` of :func:`env_settings`."""
    return {s.name: s.value for s in env_settings(accel, local_world_size=local_world_size, cpu_count=cpu_count)}


def apply_env_defaults(defaults: Mapping[str, str], environ: MutableMapping[str, str]) -> dict[str, str]:
    """Set each default that `environ` lacks (the user's own values win); return what was set.

    The caller passes the mapping explicitly (``os.environ`` or a child's env dict).
    """
    applied = {}
    for k, v in defaults.items():
        if environ.get(k) in (None, ""):
            environ[k] = v
            applied[k] = v
    return applied
