"""`voodoo doctor`: placeholder until the hardware module lands."""

from __future__ import annotations

import typer

from ..errors import NotBuiltYetError
from .common import report_errors


def register(app: typer.Typer) -> None:
    @app.command("doctor")
    @report_errors
    def _cmd() -> None:
        """Hardware / libggml / llama.cpp tools / environment report."""
        raise NotBuiltYetError("`voodoo doctor` is not built yet in this version")
