"""`voodoo tp --tensor_parallel N -- <train flags>`: tensor-parallel training through torchrun.

It validates the train flags exactly as `voodoo train` does, checks what the run needs (model
files, devices) in that order and says plainly what is missing, then starts the ranks
(voodoo_quant/tools/launch.py).
"""

from __future__ import annotations

import shlex

import typer

from ..core.errors import ConfigError
from .argv import declared_flags, normalize
from .common import console, report_errors
from .options import add_aliases
from .train import build_config


def parse_train_flags(args: list[str]):
    """The TrainConfig that `voodoo train <args>` would build (no model is loaded)."""
    from .app import app as root  # lazy: cli.app imports this module while it registers the commands

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
    return build_config(**ctx.params)


def register(app: typer.Typer) -> None:
    add_aliases("tp", {"nproc": "tensor_parallel"})  # the reference recipe's spelling

    @app.command("tp", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    @report_errors
    def tp(
        ctx: typer.Context,
        nproc: int = typer.Option(..., "--tensor_parallel", help="Tensor-parallel degree: processes (one per device) that torchrun starts."),
        print_only: bool = typer.Option(False, "--print_only", help="Print the torchrun command and environment; start nothing."),
    ) -> None:
        """Tensor-parallel `voodoo train` through torchrun: voodoo tp --tensor_parallel N -- <train flags>."""
        from ..tools.launch import check_inputs, plan_launch, run_launch  # lazy: keeps `voodoo --help` light

        args = list(ctx.args)
        cfg = parse_train_flags(args)
        if cfg.dry_run:  # the plan of every rank, from the config alone: nothing is launched
            from ..memory.dry_run import dry_run  # lazy: keeps `voodoo --help` light
            from ..training.report import print_dry_run  # lazy: keeps `voodoo --help` light
            check_inputs(cfg, nproc, dry_run=True)
            print_dry_run(console, dry_run(cfg, world=nproc))
            return
        check_inputs(cfg, nproc)
        launch = plan_launch(args, nproc)
        for k, v in launch.applied.items():
            typer.echo(f"[voodoo tp] {k}={v}")
        typer.echo("[voodoo tp] " + shlex.join(launch.argv))
        if not print_only:
            run_launch(launch)
