"""`voodoo train`: its options are TrainConfig's settings (``cli/options.py``); it builds the
config and runs the trainer."""

from __future__ import annotations

import typer

from .common import console, report_errors
from .options import config_kwargs, from_config


def build_config(**values):
    """The TrainConfig of parsed `voodoo train` options (unset ones take the dataclass's defaults)."""
    from ..training.config import TrainConfig

    return TrainConfig(**config_kwargs(TrainConfig, values))


def register(app: typer.Typer) -> None:
    from ..training.config import TrainConfig

    @app.command("train")
    @report_errors
    @from_config(TrainConfig, "train")
    def train(**settings) -> None:
        """Train the gates under the size budget, bake, and write the assignment."""
        # lazy: keeps `voodoo --help` light
        from ..training.report import print_dry_run, print_result, progress_reporter
        from ..distributed.parallel import launched_rank, leave, shutdown  # lazy: keeps `voodoo --help` light
        from ..training.setup import tiny  # lazy: keeps `voodoo --help` light
        from ..training.trainer import Trainer  # lazy: keeps `voodoo --help` light

        cfg = build_config(**settings)
        dry_run = cfg.dry_run
        try:
            if dry_run:  # from the config alone: no weights, no tokens file, no process group
                from ..memory.dry_run import dry_run as plan_dry_run  # lazy: keeps `voodoo --help` light

                if launched_rank() == 0:
                    print_dry_run(console, plan_dry_run(tiny(cfg), timing=True))
                return
            from ..tools.memory_check import check_memory  # lazy: keeps `voodoo --help` light

            # before anything loads: the plan of --dry_run, acted on (--memory_check); every rank
            # plans alike and goes on with the same config, rank 0 says so
            cfg = check_memory(cfg, announce=launched_rank() == 0).cfg
            if cfg.tensor_parallel > 1 and launched_rank() > 0:  # rank 0 reports and writes; the others compute
                Trainer(cfg).train()
                leave()
            trainer = Trainer(cfg, progress=True)
            with progress_reporter(console, trainer) as (on_step, on_search):
                trainer.on_step = on_step
                trainer.on_search = on_search
                trainer.prepare()
                result = trainer.train()
            print_result(console, trainer.run, result)
            if cfg.tensor_parallel > 1:
                leave()  # after rank 0 has written and reported
        finally:
            if cfg.tensor_parallel > 1:
                shutdown()
