"""`seerd` command line: thin commands over the coordinator, the launcher and the exporter.

Exit codes: 0 the output is complete; 1 the run failed or was interrupted (resumable);
2 bad input or settings (nothing was created).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import click

from seerd.cli import ui
from seerd.cli.launching import EXIT_BAD_INPUT, EXIT_INCOMPLETE, EXIT_OK, prepare_or_exit, report_result
from seerd.cli.options import rollout_options
from seerd.cli.sim import sim
from seerd.cli.slurm import slurm_run, submit
from seerd.cli.status import status
from seerd.config import MAX_WORKERS, WORKERS_WHY, RunConfig, number_problem
from seerd.db import RolloutStatus, make_engine, make_sessionmaker
from seerd.db.migrate import current_revision, head_revisions, upgrade
from seerd.launch.prepare import read_rollout
from seerd.rundir import RunDir

__all__ = ["EXIT_BAD_INPUT", "EXIT_INCOMPLETE", "EXIT_OK", "cli", "main"]


@click.group()
@click.option("-v", "--verbose", is_flag=True, help="Log the coordinator's decisions.")
def cli(verbose: bool) -> None:
    """seerd: batch rollouts for synchronous LLM RL (divided rollout on vLLM workers)."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


@cli.command()
@rollout_options
@click.option("--workers", default=2, show_default=True, help="Local vLLM worker processes.")
@click.option("--progress/--no-progress", default=None, help="Progress bar (default: when on a terminal).")
def run(workers: int, progress: bool | None, **options) -> None:  # noqa: ANN003
    """Run a rollout on this machine: a coordinator and WORKERS local vLLM engines."""
    prepared = prepare_or_exit(options, workers=workers, where=f"{workers} workers")
    if prepared.finished:
        return
    _drive(prepared.rundir, workers if prepared.created else prepared.config.workers, progress)


def _drive(rundir: RunDir, workers: int, progress: bool | None) -> None:
    from seerd.launch.local import run_local

    started = time.monotonic()
    with ui.RunProgress(progress) as bar:
        result = run_local(rundir, workers, on_tick=bar.update)
    report_result(rundir, result, time.monotonic() - started)


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--workers", default=None, type=int, help="Override the number of local workers.")
@click.option("--progress/--no-progress", default=None)
def resume(run_dir: Path, workers: int | None, progress: bool | None) -> None:
    """Continue an interrupted run from its database."""
    problem = None if workers is None else number_problem("--workers", workers, integer=True, at_least=1,
                                                          at_most=MAX_WORKERS, why=WORKERS_WHY)
    if problem:
        ui.error(problem)
        raise SystemExit(EXIT_BAD_INPUT)
    rundir = _existing_run(run_dir)
    rollout = read_rollout(rundir)
    if rollout.status == RolloutStatus.FINISHED:
        ui.info(f"run {rundir.path} is already finished; nothing to do")
        return
    config = RunConfig.from_json(rollout.config_json)
    _drive(rundir, workers or config.workers, progress)


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
def export(run_dir: Path) -> None:
    """Write rollouts.parquet and rollouts.jsonl again (partial for an unfinished run)."""
    from seerd.io.export import export_run

    rundir = _existing_run(run_dir)
    rollout = read_rollout(rundir)
    engine = make_engine(rundir.db_path)
    with make_sessionmaker(engine).begin() as session:
        result = export_run(session, rollout.id, rundir)
    engine.dispose()
    if result.complete:
        ui.info(f"exported {result.responses} responses to {rundir.parquet_path} and {rundir.jsonl_path}")
    else:
        ui.warn(f"PARTIAL export: {result.responses} of {result.responses_total} responses are finished "
                f"(run is {rollout.status.value}); wrote {rundir.parquet_path} and {rundir.jsonl_path}")


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--out", "out_dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Directory for the PNGs and summary.md (default: RUN_DIR/report).")
def report(run_dir: Path, out_dir: Path | None) -> None:
    """Plots and a markdown summary of a run, finished or not (reads its database read-only)."""
    from seerd.report import ReportError, write_report

    rundir = _existing_run(run_dir)
    out_dir = out_dir if out_dir is not None else rundir.path / "report"
    try:
        written = write_report(rundir.path, out_dir)
    except ReportError as exc:
        ui.error(str(exc))
        raise SystemExit(EXIT_BAD_INPUT) from None
    except OSError as exc:  # e.g. the default RUN_DIR/report in a run directory we may only read
        ui.error(f"cannot write the report to {out_dir}: {exc.strerror or exc}; "
                 "choose another place with --out DIR")
        raise SystemExit(EXIT_BAD_INPUT) from None
    ui.info(f"wrote {len(written.plots)} plots and {written.summary.name} to {out_dir}")


@cli.group()
def db() -> None:
    """The run database's schema."""


@db.command("upgrade")
@click.argument("run_dir", type=click.Path(path_type=Path))
def db_upgrade(run_dir: Path) -> None:
    """Apply Alembic migrations to RUN_DIR's database."""
    rundir = _existing_run(run_dir)
    engine = make_engine(rundir.db_path)
    before = current_revision(engine)
    upgrade(engine)
    after = current_revision(engine)
    engine.dispose()
    ui.info(f"{rundir.db_path}: {before or 'empty'} -> {after} (head {', '.join(head_revisions())})")


def _existing_run(run_dir: Path) -> RunDir:
    rundir = RunDir(run_dir.resolve())
    if not rundir.exists():
        ui.error(f"no run at {run_dir} (no {rundir.db_path.name}); start one with `seerd run`")
        raise SystemExit(EXIT_BAD_INPUT)
    return rundir


cli.add_command(sim)
cli.add_command(slurm_run)
cli.add_command(submit)
cli.add_command(status)


def main() -> None:
    cli(prog_name="seerd")


if __name__ == "__main__":
    main()
