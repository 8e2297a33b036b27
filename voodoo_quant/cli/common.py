"""What every CLI command shares: turning typed library errors into one line and an exit code."""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import click
import typer
from rich.console import Console

from ..core.errors import VoodooError

# Piped output (logs, CI) gets a wide console so tables are not truncated to 80 columns.
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True)


def _current_context():
    # Typer >= 0.29 parses with its own vendored copy of click, whose context stack is not
    # click's; ask it first, then plain click (older Typer).
    try:
        from typer._click.globals import get_current_context as typer_ctx
    except ImportError:  # pragma: no cover - older typer
        typer_ctx = None
    ctx = typer_ctx(silent=True) if typer_ctx else None
    return ctx or click.get_current_context(silent=True)


def debug_enabled() -> bool:
    ctx = _current_context()
    if ctx is None:
        return False
    obj = ctx.find_root().obj
    return bool(obj and obj.get("debug"))


def report_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a command: a VoodooError becomes ``error: <message>`` and a non-zero exit.

    With ``voodoo --debug`` the traceback is shown instead. Anything that is not a VoodooError
    is a bug and keeps its traceback.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except VoodooError as e:
            if debug_enabled():
                raise
            msg = " ".join(str(e).split()) or type(e).__name__
            print(f"error: {msg}", file=sys.stderr)
            raise typer.Exit(code=e.exit_code) from None

    return wrapper
