"""`voodoo doctor`: the hardware / libggml / llama.cpp tools / environment report."""

from __future__ import annotations

import json

import typer
from rich.table import Table

from ..tools.doctor import MISSING, WARN, DoctorConfig, run_doctor
from .common import console, err_console, report_errors
from .options import add_aliases

_STYLE = {"ok": "green", WARN: "yellow", MISSING: "bold red"}


def register(app: typer.Typer) -> None:
    add_aliases("doctor", {"world_size": "tensor_parallel", "nproc": "tensor_parallel"})

    @app.command("doctor")
    @report_errors
    def _cmd(
        as_json: bool = typer.Option(False, "--json", help="Print the report as JSON instead of a table."),
        tensor_parallel: int = typer.Option(1, "--tensor_parallel", help="Ranks per host `voodoo tp` would run (sizes the thread caps)."),
    ) -> None:
        """Hardware / libggml / llama.cpp tools / environment report, with reasons. Exits 1 when something required is missing."""
        report = run_doctor(DoctorConfig(tensor_parallel=tensor_parallel))
        if as_json:
            typer.echo(json.dumps(report.to_dict(), indent=2))
        else:
            table = Table(title="voodoo doctor", show_lines=False)
            for col in ("check", "status", "detail", "reason / fix"):
                table.add_column(col, overflow="fold")
            for c in report.checks:
                why = c.reason + (f" — fix: {c.fix}" if c.fix and c.fix not in c.reason else "")
                table.add_row(c.name, f"[{_STYLE[c.status]}]{c.status}[/]", c.detail, why)
            console.print(table)
        if not report.ok:
            for c in report.failures:
                fix = f" (fix: {c.fix})" if c.fix and c.fix not in c.reason else ""
                msg = " ".join(f"{c.name} {c.status}: {c.reason}{fix}".split())
                err_console.print(f"error: {msg}", markup=False, highlight=False, soft_wrap=True)
            raise typer.Exit(code=1)
