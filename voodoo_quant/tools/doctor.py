"""`voodoo doctor`: what this machine has, what is missing, why, and how to fix it.

The report is data (a list of :class:`Check`); the CLI renders it as a table or JSON. Nothing
here prints or exits. A check marked ``required`` that is not ``ok`` makes the report fail:
without libggml-base nothing can be quantized, without the stock tools nothing can be verified
against llama.cpp.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import asdict, dataclass, field
from typing import Mapping

from ..core import envs, paths
from ..core import qtypes as qt
from ..core.errors import ConfigError, VoodooError

OK, WARN, MISSING = "ok", "warn", "missing"


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | warn | missing
    detail: str
    reason: str = ""
    fix: str = ""
    required: bool = False

    @property
    def failed(self) -> bool:
        return self.required and self.status != OK


@dataclass(frozen=True)
class DoctorConfig:
    # Ranks per host that `voodoo tp` would launch; sizes the thread caps shown.
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        if int(self.tensor_parallel) < 1:
            raise ConfigError(f"--tensor_parallel must be >= 1, got {self.tensor_parallel}")


@dataclass(frozen=True)
class DoctorReport:
    checks: tuple[Check, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return not any(c.failed for c in self.checks)

    @property
    def failures(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if c.failed)

    def to_dict(self) -> dict:
        return {"ok": self.ok, "checks": [asdict(c) | {"failed": c.failed} for c in self.checks]}


def _python() -> Check:
    return Check("python", OK, f"{platform.python_version()} ({sys.executable})")


def _torch_and_hardware(cfg: DoctorConfig, environ: Mapping[str, str]) -> list[Check]:
    # lazy: `voodoo --help` imports this module
    from ..hardware import attention_backend, detect, env_settings, probe_torch
    from ..hardware.detect import torch_build  # lazy: `voodoo --help` imports this module

    probe = probe_torch(environ)
    accel = detect(probe)
    out = [Check("torch", OK, f"{probe.torch_version} ({torch_build(probe)} build)")]
    gpu_build = bool(probe.cuda_version or probe.hip_version)
    acc_status = WARN if gpu_build and not accel.is_gpu else OK
    detail = accel.kind if not accel.is_gpu else f"{accel.kind}: " + ", ".join(
        f"cuda:{i} {n} ({a})" for i, n, a in zip(accel.devices, accel.names, accel.arch))
    out.append(Check("accelerator", acc_status, detail, accel.reason,
                     "check the driver and *_VISIBLE_DEVICES" if acc_status == WARN else ""))
    attn = attention_backend(accel)
    out.append(Check("attention backend", OK, ", ".join(attn.sdpa_backends) or "torch default", attn.reason))
    for s in env_settings(accel, local_world_size=cfg.tensor_parallel):
        current = environ.get(s.name)
        if current in (None, ""):
            out.append(Check(f"tp env {s.name}", OK, f"{s.value} (voodoo tp would set it)", s.reason))
        elif current == s.value:
            out.append(Check(f"tp env {s.name}", OK, f"{s.value} (already set)", s.reason))
        else:
            out.append(Check(f"tp env {s.name}", WARN, f"{current} (yours, kept; default {s.value})", s.reason))
    return out


def _libggml() -> list[Check]:
    from ..core import ggml  # lazy: `voodoo --help` imports this module

    fix = "run `make bootstrap`, or set VOODOO_GGML_LIB to an existing libggml-base"
    try:
        path = paths.ggml_lib_path()
        g = ggml.lib(path)
        version, commit = g.version, g.commit
    except VoodooError as e:
        return [Check("libggml-base", MISSING, "not usable", str(e), fix, required=True)]
    # A library of another ggml version would quantize differently: its type table must match ours.
    bad = [n for n, q in qt.QTYPES.items() if (lambda t: (t.block, t.type_size) != (q.block, q.type_size))(g.traits(q))]
    if bad:
        return [Check("libggml-base", MISSING, f"{path} (ggml {version})",
                      f"block/type sizes differ from the type table for {', '.join(bad)}",
                      "point VOODOO_GGML_LIB at the pinned build (`make bootstrap`)", required=True)]
    return [Check("libggml-base", OK, f"{path}", f"ggml {version} (commit {commit}); type table matches")]


def _tools() -> list[Check]:
    out = []
    for name in paths.STOCK_TOOLS:
        try:
            p = paths.tool_path(name)
        except VoodooError as e:
            out.append(Check(name, MISSING, "not built", str(e), "run `make bootstrap`", required=True))
            continue
        if not os.access(p, os.X_OK):
            out.append(Check(name, MISSING, str(p), "not executable", f"chmod +x {p}", required=True))
        else:
            out.append(Check(name, OK, str(p)))
    try:
        out.append(Check("convert_hf_to_gguf.py", OK, str(paths.convert_script())))
    except VoodooError as e:
        out.append(Check("convert_hf_to_gguf.py", WARN, "missing", str(e), "run `make bootstrap`"))
    gp = paths.gguf_py_dir()
    if (gp / "gguf" / "__init__.py").is_file():
        out.append(Check("gguf-py (vendored)", OK, str(gp)))
    else:
        out.append(Check("gguf-py (vendored)", WARN, "missing", f"{gp} has no gguf package", "run `make bootstrap`"))
    return out


# Parsers that validate each variable's value; raise EnvironmentVarError on a bad one.
_VALIDATORS = {
    "VOODOO_QUANT_WORKERS": envs.quant_workers,
    "VOODOO_FINALIZE_WORKERS": envs.finalize_workers,
    "VOODOO_TINY_RECIPE": envs.tiny_recipe,
}


def _variables(environ: Mapping[str, str]) -> list[Check]:
    out = []
    for name, value, help_ in envs.describe(environ):
        if value is None:
            out.append(Check(name, OK, "(unset)", help_))
            continue
        try:
            if name in _VALIDATORS:
                _VALIDATORS[name](environ)
        except VoodooError as e:
            out.append(Check(name, WARN, value, str(e), f"unset {name} or fix its value"))
            continue
        out.append(Check(name, OK, value, help_))
    return out


def _mix_kernel() -> list[Check]:
    from ..candidates import mixkernel  # lazy: `voodoo --help` imports this module

    try:
        lib = mixkernel.load()
    except VoodooError as e:  # a bad VOODOO_MIX_KERNEL value: the variables' check says which
        return [Check("mixing kernel", WARN, "not checked", str(e))]
    if lib is not None:
        return [Check("mixing kernel", OK, lib._name, "eager CPU candidates are held as int8 codes")]
    reason = mixkernel.unavailable_reason() or "unknown"
    fix = "" if not envs.mix_kernel() else "install a C compiler (cc), e.g. `apt install gcc`"
    return [Check("mixing kernel", WARN, "off", f"{reason}: eager CPU candidates stay float32 stacks "
                  "(about 3x the memory, a slower step)", fix)]


def run_doctor(config: DoctorConfig | None = None, environ: Mapping[str, str] | None = None) -> DoctorReport:
    """Build the report. `environ` defaults to the process environment (read, never written)."""
    cfg = config or DoctorConfig()
    env = os.environ if environ is None else environ
    checks: list[Check] = [_python()]
    checks += _torch_and_hardware(cfg, env)
    checks += _libggml()
    checks += _tools()
    checks += _mix_kernel()
    checks += _variables(env)
    return DoctorReport(tuple(checks))
