"""``voodoo tp``: start one ``voodoo train`` rank per device through torchrun.

torch's own launcher (``python -m torch.distributed.run --standalone``) does the rendezvous; the
ranks run ``voodoo_quant.cli.app train <flags> --tensor_parallel N`` with the vendor's environment
defaults from :mod:`voodoo_quant.hardware` (values already in the environment win). On CPU the
ranks use gloo, on CUDA / ROCm nccl (RCCL); the trainer picks it from ``--device``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ..core.errors import ConfigError, ToolFailedError
from ..hardware import detect
from ..hardware.envdefaults import apply_env_defaults, env_defaults


@dataclass
class TPLaunch:
    argv: list[str]
    env: dict[str, str]
    applied: dict[str, str]  # the defaults this launch added to the environment


def check_inputs(cfg, nproc: int, *, dry_run: bool = False) -> None:
    """What the ranks will need, checked once here with a clear message (model, files, devices).
    A dry run needs only the model's config: no checkpoints, tokens or GPUs."""
    if nproc < 2:
        raise ConfigError(f"--tensor_parallel must be >= 2 for `voodoo tp`, got {nproc} (use `voodoo train` on one device)")
    if cfg.tensor_parallel not in (1, nproc):
        raise ConfigError(f"the train flags' --tensor_parallel {cfg.tensor_parallel} (after `--`) disagrees with "
                          f"`voodoo tp --tensor_parallel {nproc}`; leave it out, `voodoo tp` passes its own")
    if cfg.device_map:
        raise ConfigError("--device_map places layers on devices within one process; it does not combine with `voodoo tp`")
    if not Path(cfg.model).is_dir():
        raise ConfigError(f"--model {cfg.model}: no such model directory (the flags themselves are valid)")
    if dry_run:
        if not (Path(cfg.model) / "config.json").is_file():
            raise ConfigError(f"--model {cfg.model}: no config.json (the dry run plans from it)")
        return
    for flag, path in (("--base_checkpoint", cfg.base_checkpoint), ("--teacher_checkpoint", cfg.teacher_checkpoint),
                       ("--imatrix", cfg.imatrix)):
        if path and not Path(path).is_file():
            raise ConfigError(f"{flag} {path}: no such file")
    if not cfg.data_path.is_file():
        raise ConfigError(f"tokens file {cfg.data_path} not found (--data_dir / --data_name)")
    accel = detect()
    if cfg.device.startswith("cuda"):
        if not accel.is_gpu:
            raise ConfigError(f"--device {cfg.device} but no GPU is usable: {accel.reason}")
        if len(accel.devices) < nproc:
            raise ConfigError(f"--tensor_parallel {nproc} needs {nproc} GPUs; found {len(accel.devices)}: {accel.reason}")
    elif cfg.device != "cpu":
        raise ConfigError(f"`voodoo tp` runs one rank per device: use --device cuda (one GPU per rank) or cpu, not {cfg.device}")


def plan_launch(train_args: list[str], nproc: int, environ: Mapping[str, str] | None = None) -> TPLaunch:
    """The torchrun command line and environment for `nproc` ranks of ``voodoo train <train_args>``."""
    env = dict(os.environ if environ is None else environ)
    applied = apply_env_defaults(env_defaults(detect(), local_world_size=nproc), env)
    args = list(train_args)
    if not any(a.split("=", 1)[0] in ("--tensor_parallel", "--tensor-parallel") for a in args):
        args += ["--tensor_parallel", str(nproc)]
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "-m", "voodoo_quant.cli.app", "train", *args]
    return TPLaunch(argv, env, applied)


def run_launch(launch: TPLaunch) -> None:
    rc = subprocess.call(launch.argv, env=launch.env)
    if rc != 0:
        raise ToolFailedError(f"tensor-parallel training failed: torchrun exited with status {rc} (the ranks' errors are above)")
