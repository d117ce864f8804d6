"""`seerd` command line: thin commands over the coordinator, the launcher and the exporter.

Exit codes: 0 the output is complete; 1 the run failed or was interrupted (resumable);
2 bad input or settings (nothing was created), a run that a live coordinator owns, or a model
checkpoint that changed since the run was created; 3 the run finished with failed requests.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import click

from seerd.cli import ui
from seerd.cli.launching import (
    EXIT_BAD_INPUT, EXIT_FAILED_REQUESTS, EXIT_INCOMPLETE, EXIT_OK, exit_2_on, own_or_exit, prepare_or_exit,
    report_result,
)
from seerd.cli.options import ALLOW_MODEL_CHANGE_OPTION, API_PROCESSES_OPTION, LOCAL_GPUS_OPTION, rollout_options
from seerd.cli.serve import rollout, serve, slurm_serve
from seerd.cli.sim import sim
from seerd.cli.slurm import slurm_run, submit
from seerd.cli.status import status
from seerd.config import MAX_WORKERS, WORKERS_WHY, RunConfig, number_problem
from seerd.db import Rollout, RolloutStatus, make_engine
from seerd.db.migrate import UpgradeFailed, head_revisions, upgrade_run_database
from seerd.db.read import UnreadableDatabase
from seerd.launch.prepare import BadRun, owned_rollout
from seerd.ownership import Ownership
from seerd.rundir import RunDir

__all__ = ["EXIT_BAD_INPUT", "EXIT_FAILED_REQUESTS", "EXIT_INCOMPLETE", "EXIT_OK", "cli", "main"]


@click.group()
@click.option("-v", "--verbose", is_flag=True, help="Log the coordinator's decisions.")
def cli(verbose: bool) -> None:
    """seerd: batch rollouts for synchronous LLM RL (divided rollout on vLLM workers)."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


@cli.command()
@rollout_options
@click.option("--workers", default=2, show_default=True, help="Local vLLM worker processes.")
@LOCAL_GPUS_OPTION
@click.option("--progress/--no-progress", default=None, help="Progress bar (default: when on a terminal).")
@ALLOW_MODEL_CHANGE_OPTION
@API_PROCESSES_OPTION
def run(workers: int, progress: bool | None, allow_model_change: bool, api_processes: int | None,
        **options) -> None:  # noqa: ANN003
    """Run a rollout on this machine: a coordinator and WORKERS local vLLM engines."""
    prepared = prepare_or_exit(options, workers=workers, where=f"{workers} workers",
                               allow_model_change=allow_model_change)
    if prepared.finished:
        return
    with prepared.ownership:
        _drive(prepared.rundir, prepared.ownership, workers if prepared.created else prepared.config.workers,
               progress, allow_model_change, api_processes)


def _drive(rundir: RunDir, ownership: Ownership, workers: int, progress: bool | None,
           allow_model_change: bool, api_processes: int | None) -> None:
    from seerd.coordinator.daemon import Coordinator
    from seerd.coordinator.footprint import NotEnoughMemory
    from seerd.coordinator.model_identity import ModelChanged
    from seerd.launch.local import run_local

    with exit_2_on(ModelChanged, NotEnoughMemory):
        coordinator = Coordinator(rundir, ownership, allow_model_change=allow_model_change, expected_workers=workers,
                                  api_processes=api_processes)
    started = time.monotonic()
    with ui.RunProgress(progress) as bar:
        result = run_local(coordinator, workers, on_tick=bar.update)
    report_result(rundir, result, time.monotonic() - started)


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--workers", default=None, type=int, help="Override the number of local workers.")
@click.option("--progress/--no-progress", default=None)
@ALLOW_MODEL_CHANGE_OPTION
@API_PROCESSES_OPTION
def resume(run_dir: Path, workers: int | None, progress: bool | None, allow_model_change: bool,
           api_processes: int | None) -> None:
    """Continue an interrupted run from its database."""
    problem = None if workers is None else number_problem("--workers", workers, integer=True, at_least=1,
                                                          at_most=MAX_WORKERS, why=WORKERS_WHY)
    if problem:
        ui.error(problem)
        raise SystemExit(EXIT_BAD_INPUT)
    rundir = _existing_run(run_dir)
    with own_or_exit(rundir) as ownership:
        rollout = _read_rollout(rundir)
        if rollout.status == RolloutStatus.FINISHED:
            ui.info(f"run {rundir.path} is already finished; nothing to do")
            return
        config = RunConfig.from_json(rollout.config_json)
        _drive(rundir, ownership, workers or config.workers, progress, allow_model_change, api_processes)


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
def export(run_dir: Path) -> None:
    """Write rollouts.parquet and rollouts.jsonl again (partial for an unfinished run).

    Reads one snapshot of the database read-only: safe while the run's coordinator is live."""
    from seerd.io.export import export_snapshot

    rundir = _existing_run(run_dir)
    try:
        result, status = export_snapshot(rundir)
    except UnreadableDatabase as exc:
        ui.error(str(exc))
        raise SystemExit(EXIT_BAD_INPUT) from None
    if result.complete:
        ui.info(f"exported {result.responses} responses to {rundir.parquet_path} and {rundir.jsonl_path}")
    elif not result.written:
        ui.info(f"the run finished while this export read it: its complete outputs are kept ({rundir.parquet_path}, "
                f"{rundir.jsonl_path})")
    else:
        ui.warn(f"PARTIAL export: {result.responses} of {result.responses_total} responses have ended "
                f"(run is {status.value}); wrote {rundir.parquet_path} and {rundir.jsonl_path}")


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
    """The run database: its schema, and a consistent copy of it."""


@db.command("upgrade")
@click.argument("run_dir", type=click.Path(path_type=Path))
def db_upgrade(run_dir: Path) -> None:
    """Apply Alembic migrations to RUN_DIR's database, after copying it aside (removed on success)."""
    rundir = _existing_run(run_dir)
    with own_or_exit(rundir):  # never under a live coordinator
        engine = make_engine(rundir.db_path)
        try:
            done = upgrade_run_database(engine, rundir.db_path)
        except UpgradeFailed as exc:
            ui.error(str(exc))
            raise SystemExit(EXIT_INCOMPLETE) from None
        finally:
            engine.dispose()
    ui.info(f"{rundir.db_path}: {done.before or 'empty'} -> {done.after} (head {', '.join(head_revisions())})")


@db.command("snapshot")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.argument("dest_dir", type=click.Path(path_type=Path, file_okay=False))
def db_snapshot(run_dir: Path, dest_dir: Path) -> None:
    """Copy RUN_DIR's database, consistent as of now, to DEST_DIR/state.db (a new file), live run or not.

    Read it anywhere: `seerd status DEST_DIR`, `seerd report DEST_DIR`, `seerd export DEST_DIR`. Never
    copy a live run's database with cp: the copy would miss what is still in its -wal."""
    from seerd.db.read import copy_database

    rundir = _existing_run(run_dir)
    target = RunDir(dest_dir)
    try:
        copy_database(rundir.db_path, target.db_path)
    except FileExistsError:
        ui.error(f"{target.db_path} exists; choose a new DEST_DIR")
        raise SystemExit(EXIT_BAD_INPUT) from None
    except OSError as exc:
        ui.error(f"cannot write {target.db_path}: {exc.strerror or exc}")
        raise SystemExit(EXIT_BAD_INPUT) from None
    except UnreadableDatabase as exc:
        ui.error(str(exc))
        raise SystemExit(EXIT_BAD_INPUT) from None
    ui.info(f"copied {rundir.db_path} to {target.db_path}")


def _read_rollout(rundir: RunDir) -> Rollout:
    """The run's rollout, or exit 2 when its creation never completed."""
    with exit_2_on(BadRun):
        return owned_rollout(rundir)


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
cli.add_command(serve)
cli.add_command(rollout)
cli.add_command(slurm_serve)


def main() -> None:
    cli(prog_name="seerd")


if __name__ == "__main__":
    main()
