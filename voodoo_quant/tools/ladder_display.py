"""The console display of a ``voodoo quantize`` ladder: an overall bar and the current step's."""

from __future__ import annotations

from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn


class LadderDisplay:
    """One rich progress display for the whole ladder: an overall bar and the current step's."""

    def __init__(self, enabled: bool, total: int):
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), disable=not enabled)
        self.enabled = enabled
        self.overall = self.progress.add_task("[bold]voodoo quantize", total=total)
        self.current = None

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)

    def begin(self, name: str, total: int | None = None) -> None:
        self.current = self.progress.add_task(f"  {name}", total=total)

    def advance(self, n: float = 1) -> None:
        if self.current is not None:
            self.progress.advance(self.current, n)

    def end(self, name: str, note: str) -> None:
        if self.current is not None:
            self.progress.remove_task(self.current)
            self.current = None
        self.progress.advance(self.overall)
        if self.enabled:
            self.progress.console.print(f"[green]✓[/green] {name}: {note}")
