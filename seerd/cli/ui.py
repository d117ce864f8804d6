"""The one module that talks to rich: progress while a run goes, and messages."""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

console = Console(stderr=True, highlight=False)  # messages and progress: stdout stays for data
out = Console(highlight=False)  # views a person asked for (`seerd status`)


def error(message: str) -> None:
    console.print(f"[bold red]error:[/] {message}", soft_wrap=True)


def warn(message: str) -> None:
    console.print(f"[yellow]warning:[/] {message}", soft_wrap=True)


def info(message: str) -> None:
    console.print(message, soft_wrap=True)


class RunProgress:
    """A progress bar of requests and a tokens/s figure, fed by the coordinator's ticks."""

    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[detail]}"), TimeElapsedColumn(), console=console,
            disable=not self.enabled,
        )
        self.task = None
        self.started = time.monotonic()
        self.start_tokens: int | None = None

    def __enter__(self) -> RunProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(*exc)

    def update(self, counts: dict[str, int]) -> None:
        if self.start_tokens is None:
            self.start_tokens = counts["output_tokens"]
        rate = (counts["output_tokens"] - self.start_tokens) / max(time.monotonic() - self.started, 1e-9)
        detail = (f"{counts['output_tokens']} tok  {rate:,.0f} tok/s  "
                  f"{counts['workers_alive']} workers  {counts['leases']} leases")
        if self.task is None:
            self.task = self.progress.add_task("requests", total=counts["requests_total"], detail=detail)
        self.progress.update(self.task, completed=counts["requests_done"], detail=detail)


def summary(lines: dict[str, object]) -> None:
    width = max(len(k) for k in lines)
    for key, value in lines.items():
        console.print(f"  {key:<{width}}  {value}")
