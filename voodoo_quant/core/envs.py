"""The only module that reads ``VOODOO_*`` environment variables.

Every variable the package understands is declared here with its type, default and meaning;
everything else asks this module. ``voodoo doctor`` prints :func:`describe`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from .errors import EnvironmentVarError


@dataclass(frozen=True)
class EnvVar:
    name: str
    help: str
    default: str | None = None


VARIABLES: tuple[EnvVar, ...] = (
    EnvVar("VOODOO_GGML_LIB", "path to libggml-base (.so/.dylib); default: the bootstrap build"),
    EnvVar("VOODOO_LLAMA_CPP_DIR", "llama.cpp tree with build/bin tools; default: third_party/llama.cpp"),
    EnvVar("VOODOO_CACHE_DIR", "root of caches (candidates, llama.cpp build); default ~/.cache/voodoo_quant"),
    EnvVar("VOODOO_QUANT_WORKERS", "threads/processes for ggml quantization; default: CPU count"),
    EnvVar("VOODOO_FINALIZE_WORKERS", "workers for bake/export quantization; default: VOODOO_QUANT_WORKERS"),
    EnvVar("VOODOO_DEVICE_MEMORY_GB", "memory of one device for the memory plan's fit check (--dry_run, and a "
           "run's own check before it loads anything, --memory_check); default: the GPU's, else 32 (the reference "
           "recipe's cards) for --device cuda, else the host's RAM"),
    EnvVar("VOODOO_TP_TIMEOUT_MIN", "minutes a tensor-parallel rank waits in a collective before it gives up "
           "(rank 0 alone fills the candidate cache and computes the sensitivity table while the others wait "
           "at a barrier; torch's own default is 10 for NCCL, 30 for gloo)", "240"),
    EnvVar("VOODOO_MIX_KERNEL", "1: eager CPU candidates are kept as int8 codes and mixed by a native kernel "
           "built with the system C compiler (voodoo_quant/candidates/mixkernel.py); 0: float32 stacks", "1"),
    EnvVar("VOODOO_HESSIAN_PASS_GB", "GB of Hessian accumulators one pass of --error_compensation's whole-model "
           "collection holds, only for a loaded model whose decoder layers cannot be run one at a time (every other "
           "model is collected layer by layer in one forward); more passes over the calibration text when they "
           "do not fit", "4"),
    EnvVar("VOODOO_HELP_EXPERIMENTAL", "1: `--help` also lists the Experimental panel (settings measured no better "
           "than the default; they work either way)", "0"),
    EnvVar("VOODOO_TINY_RECIPE", "1 shrinks every run (steps, sequences) for fast tests", "0"),
    EnvVar("VOODOO_FAULT_AT", "tests only: SIGKILL the process at a named point, e.g. step:3, bake, "
           "write:partial.pt:2, export:tensor:5 (the n-th hit, default 1); never set it otherwise"),
)
_KNOWN = {v.name for v in VARIABLES}


def _environ(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def _get(name: str, env: Mapping[str, str] | None) -> str | None:
    assert name in _KNOWN, name
    value = _environ(env).get(name)
    return value if value not in (None, "") else None


def _positive_int(name: str, env: Mapping[str, str] | None, default: Callable[[], int]) -> int:
    raw = _get(name, env)
    if raw is None:
        return default()
    try:
        value = int(raw)
    except ValueError:
        raise EnvironmentVarError(f"{name}={raw!r} is not an integer") from None
    if value < 1:
        raise EnvironmentVarError(f"{name}={raw!r} must be >= 1")
    return value


def ggml_lib(env: Mapping[str, str] | None = None) -> Path | None:
    raw = _get("VOODOO_GGML_LIB", env)
    return Path(raw).expanduser() if raw else None


def llama_cpp_dir(env: Mapping[str, str] | None = None) -> Path | None:
    raw = _get("VOODOO_LLAMA_CPP_DIR", env)
    return Path(raw).expanduser() if raw else None


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    raw = _get("VOODOO_CACHE_DIR", env)
    if raw:
        return Path(raw).expanduser()
    xdg = _environ(env).get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "voodoo_quant"


def quant_workers(env: Mapping[str, str] | None = None) -> int:
    return _positive_int("VOODOO_QUANT_WORKERS", env, lambda: max(1, os.cpu_count() or 1))


def hessian_pass_bytes(env: Mapping[str, str] | None = None) -> int:
    raw = _get("VOODOO_HESSIAN_PASS_GB", env)
    try:
        gb = 4.0 if raw is None else float(raw)
    except ValueError:
        gb = -1.0
    if not gb > 0:
        raise EnvironmentVarError(f"VOODOO_HESSIAN_PASS_GB must be a number of GB > 0, got {raw!r}")
    return int(gb * (1 << 30))


def finalize_workers(env: Mapping[str, str] | None = None) -> int:
    return _positive_int("VOODOO_FINALIZE_WORKERS", env, lambda: quant_workers(env))


def device_memory_gb(env: Mapping[str, str] | None = None) -> float | None:
    raw = _get("VOODOO_DEVICE_MEMORY_GB", env)
    if raw is None:
        return None
    try:
        v = float(raw)
    except ValueError:
        v = -1.0
    if v <= 0:
        raise EnvironmentVarError(f"VOODOO_DEVICE_MEMORY_GB={raw!r} must be a positive number of GB")
    return v


def tp_timeout_min(env: Mapping[str, str] | None = None) -> int:
    return _positive_int("VOODOO_TP_TIMEOUT_MIN", env, lambda: 240)


def _switch(name: str, env: Mapping[str, str] | None, default: bool) -> bool:
    raw = _get(name, env)
    if raw is None:
        return default
    if raw not in ("0", "1"):
        raise EnvironmentVarError(f"{name}={raw!r} must be 0 or 1")
    return raw == "1"


def tiny_recipe(env: Mapping[str, str] | None = None) -> bool:
    return _switch("VOODOO_TINY_RECIPE", env, False)


def help_experimental(env: Mapping[str, str] | None = None) -> bool:
    return _switch("VOODOO_HELP_EXPERIMENTAL", env, False)


def mix_kernel(env: Mapping[str, str] | None = None) -> bool:
    return _switch("VOODOO_MIX_KERNEL", env, True)


def fault_at(env: Mapping[str, str] | None = None) -> tuple[str, int] | None:
    """(point, n) of VOODOO_FAULT_AT: die at the n-th time `point` is reached."""
    raw = _get("VOODOO_FAULT_AT", env)
    if raw is None:
        return None
    point, _, n = raw.rpartition(":")
    if point and n.isdigit() and int(n) >= 1:
        return point, int(n)
    return raw, 1


def describe(env: Mapping[str, str] | None = None) -> list[tuple[str, str | None, str]]:
    """(name, value or None, help) for every variable, for the doctor."""
    return [(v.name, _get(v.name, env), v.help) for v in VARIABLES]
