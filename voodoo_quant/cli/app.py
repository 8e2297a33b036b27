"""The Typer application: one module per command, each with ``register(app)``."""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
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
COMMAND_MODULES = ("data", "make_teacher", "precache", "train", "tp", "export", "eval", "doctor")
for _name in COMMAND_MODULES:
    importlib.import_module(f"{__package__}.{_name}").register(app)


def main() -> None:
    app(prog_name="voodoo")
