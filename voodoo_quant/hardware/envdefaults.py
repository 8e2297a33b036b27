"""Environment defaults per vendor: allocator, collectives, thread caps.

Returned, never applied by the library: ``voodoo tp`` applies them to the environment of the
ranks it launches, the ``voodoo`` CLI applies :func:`host_env_settings` to its own process before
any tensor is allocated (values the user already set win, in both), ``voodoo doctor`` prints them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, MutableMapping

from ..core.errors import ConfigError
from .attention import attention_backend
from .detect import CUDA, ROCM, Accelerator


@dataclass(frozen=True)
class EnvSetting:
    name: str
    value: str
    reason: str


def host_env_settings() -> list[EnvSetting]:
    """What every process of this tool should have, whatever its accelerator (torch-free).

    ``THP_MEM_ALLOC_ENABLE=1``: torch's CPU allocator aligns allocations of 2 MB and more to huge
    pages and advises them as such (read once, at the first such allocation). A training step
    allocates every tensor's soft mixture afresh (the whole model's weights, every step); on 4 KB
    pages each new mixture page-faults page by page: a fresh 113 MB tensor (the 135M model's tied
    embedding) took 53 ms to allocate and touch, 13 ms with this set. Paired trainer and plain
    forward+backward steps on SmolLM2-135M (idle 2-core machine, 10 pairs each): the step's
    median ratio fell from 1.36x to 1.24x (per-pair spread 1.1-1.6x: the machine's own noise)."""
    return [EnvSetting("THP_MEM_ALLOC_ENABLE", "1",
                       "huge pages for torch's large CPU tensors: a step's fresh mixtures no longer fault in 4 KB at a time")]


def env_settings(accel: Accelerator, *, local_world_size: int = 1, cpu_count: int | None = None) -> list[EnvSetting]:
    """The variables a run on `accel` with `local_world_size` ranks on this host should have."""
    if local_world_size < 1:
        raise ConfigError(f"local_world_size must be >= 1, got {local_world_size}")
    cpus = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    per_rank = str(max(1, cpus // local_world_size))
    out = [
        *host_env_settings(),
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


def host_env_defaults() -> dict[str, str]:
    """``{name: value}`` of :func:`host_env_settings`."""
    return {s.name: s.value for s in host_env_settings()}


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
