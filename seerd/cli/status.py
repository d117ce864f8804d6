"""`seerd status`: watch a run (live, one frame, or JSON), read-only."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from seerd.cli import ui
from seerd.cli.launching import EXIT_BAD_INPUT
from seerd.db.read import UnreadableDatabase
from seerd.status.locate import resolve_run, take_snapshot
from seerd.status.snapshot import UnknownRun

# The database exists but could not be read (locked past the timeout, corrupt; or on a network
# filesystem, written from another host by a coordinator whose API does not answer).
EXIT_UNREADABLE = 3


@click.command()
@click.argument("target")
@click.option("--once", is_flag=True, help="Print one frame and exit.")
@click.option("--json", "as_json", is_flag=True, help="Print one snapshot as JSON and exit.")
@click.option("--interval", default=1.0, show_default=True, type=click.FloatRange(min=0.1),
              help="Seconds between frames of the live view.")
@click.option("--tail-rows", default=15, show_default=True, type=click.IntRange(min=0),
              help="Running requests shown (longest first); JSON lists up to 10x as many.")
def status(target: str, once: bool, as_json: bool, interval: float, tail_rows: int) -> None:
    """Show a run's progress, its tail and its workers. TARGET: a run directory, or the Slurm job
    id of a run started with `sbatch slurm/rollout.sh` or `seerd submit`."""
    try:
        run_dir = resolve_run(target)
        if as_json:
            click.echo(json.dumps(take_snapshot(run_dir, tail_rows * 10), indent=1))
            return
        if once:
            ui.out.print(_frame(run_dir, tail_rows))
            return
        _live(run_dir, tail_rows, interval)
    except UnknownRun as exc:
        ui.error(str(exc))
        raise SystemExit(EXIT_BAD_INPUT) from None
    except UnreadableDatabase as exc:
        ui.error(str(exc))  # "cannot read PATH: why"
        raise SystemExit(EXIT_UNREADABLE) from None


def _frame(run_dir: Path, tail_rows: int):  # noqa: ANN202
    from seerd.status.render import render

    return render(take_snapshot(run_dir, tail_rows))


def _live(run_dir: Path, tail_rows: int, interval: float) -> None:
    """Redraw until the run stops running (then the last frame stays) or Ctrl-C."""
    from rich.live import Live

    from seerd.status.render import render

    snapshot = take_snapshot(run_dir, tail_rows)
    with Live(render(snapshot), console=ui.out, auto_refresh=False, transient=False) as live:
        try:
            while True:
                time.sleep(interval)
                snapshot = take_snapshot(run_dir, tail_rows)
                live.update(render(snapshot), refresh=True)
                if snapshot["state"] != "running" and snapshot["state"] != "created":
                    return
        except KeyboardInterrupt:
            return
