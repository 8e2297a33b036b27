"""`voodoo tp --nproc N -- <train flags>`: tensor-parallel training through torchrun.

It validates the train flags exactly as `voodoo train` does, then checks what the run needs
(model files, devices) in that order and says plainly what is missing.
"""

from __future__ import annotations

from pathlib import Path

import typer

from ..errors import ConfigError, NotBuiltYetError
from .argv import declared_flags, normalize
from .common import report_errors


def parse_train_flags(args: list[str]):
    """The TrainConfig that `voodoo train <args>` would build (no model is loaded)."""
    from .app import app as root
    from .train import _FIELDS, build_config

    group = typer.main.get_command(root)
    train_cmd = group.commands["train"]
    try:
        ctx = train_cmd.make_context("train", normalize(args, declared_flags(train_cmd)))
    except Exception as e:  # click's or Typer's vendored click's Exit / UsageError
        if hasattr(e, "format_message"):
            raise ConfigError(f"train flags: {e.format_message()}") from None
        if type(e).__name__ == "Exit":
            raise ConfigError("`voodoo tp` needs train flags after `--`") from None
        raise
    return build_config(**{k: v for k, v in ctx.params.items() if k in _FIELDS})


def register(app: typer.Typer) -> None:
    @app.command("tp", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    @report_errors
    def tp(
        ctx: typer.Context,
        nproc: int = typer.Option(..., "--nproc", help="Processes (one per device) that torchrun starts."),
    ) -> None:
        """Tensor-parallel `voodoo train` through torchrun: voodoo tp --nproc N -- <train flags>."""
        if nproc < 1:
            raise ConfigError(f"--nproc must be >= 1, got {nproc}")
        cfg = parse_train_flags(list(ctx.args))
        if cfg.tensor_parallel not in (1, nproc):
            raise ConfigError(f"--tensor_parallel {cfg.tensor_parallel} disagrees with --nproc {nproc}")
        if not Path(cfg.model).is_dir():
            raise ConfigError(f"--model {cfg.model}: no such model directory (the flags themselves are valid)")
        for flag, path in (("--base_checkpoint", cfg.base_checkpoint), ("--teacher_checkpoint", cfg.teacher_checkpoint),
                           ("--imatrix", cfg.imatrix)):
            if path and not Path(path).is_file():
                raise ConfigError(f"{flag} {path}: no such file")
        if not cfg.data_path.is_file():
            raise ConfigError(f"tokens file {cfg.data_path} not found (--data_dir / --data_name)")
        from ..hardware import detect

        accel = detect()
        if accel.is_gpu and len(accel.devices) < nproc:
            raise ConfigError(f"--nproc {nproc} needs {nproc} GPUs; found {len(accel.devices)}: {accel.reason}")
        if not accel.is_gpu and cfg.device != "cpu":
            raise ConfigError(f"--device {cfg.device} but no GPU is usable: {accel.reason}")
        raise NotBuiltYetError(
            "tensor-parallel training is not built in this version; the flags and inputs are valid. "
            f"Run single-device with `voodoo train` (drop --tensor_parallel) meanwhile"
        )
