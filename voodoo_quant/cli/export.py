"""`voodoo export`: not built yet in this version."""

from __future__ import annotations

import typer

from ..errors import NotBuiltYetError
from .common import report_errors


def register(app: typer.Typer) -> None:
    @app.command("export", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    @report_errors
    def _cmd() -> None:
        """Not built yet in this version."""
        raise NotBuiltYetError("`voodoo export` is not built yet in this version")
