"""The Typer application: one module per command, each with ``register(app)``."""

from __future__ import annotations

import importlib

import typer
from typer.core import TyperGroup

from .argv import declared_flags, normalize


class _Group(TyperGroup):
    """Normalizes each subcommand's arguments (flag spellings, space-separated lists)."""

    def resolve_command(self, ctx, args):
        name, cmd, rest = super().resolve_command(ctx, args)
        if cmd is not None:
            rest = normalize(rest, declared_flags(cmd))
        return name, cmd, rest


app = typer.Typer(
    cls=_Group,
    name="voodoo",
    help="Learned per-tensor llama.cpp quantization under a size budget, exported as a stock GGUF.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root(
    ctx: typer.Context,
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks instead of one-line errors."),
) -> None:
    ctx.obj = {"debug": debug}


# Order = order in --help. Each module defines register(app).
COMMAND_MODULES = ("quantize", "data", "make_teacher", "imatrix", "precache", "train", "tp", "export", "eval", "doctor")
for _name in COMMAND_MODULES:
    importlib.import_module(f"{__package__}.{_name}").register(app)


def main() -> None:
    import os

    # lazy: `import voodoo_quant.cli.app` stays light
    from ..hardware.envdefaults import apply_env_defaults, host_env_defaults

    apply_env_defaults(host_env_defaults(), os.environ)  # before the first large tensor (the user's values win)
    app(prog_name="voodoo")


if __name__ == "__main__":  # torchrun starts the ranks as `python -m voodoo_quant.cli.app train ...`
    main()
