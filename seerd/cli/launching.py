"""What every launching command does before and after its launcher: prepare the run, report the end.

Exit codes: 0 the output is complete; 1 the run failed or was interrupted (resumable);
2 bad input or settings (nothing was created), a run that a live coordinator owns, or a model
checkpoint that changed since the run was created; 3 the run finished with failed requests (the
output holds every response; the failed ones have finish_reason "error" and the engine's message in
"error").
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from seerd.cli import ui
from seerd.config import ConfigError, build_config
from seerd.db import RolloutStatus
from seerd.launch.prepare import BadRun, PreparedRun, own, prepare_run
from seerd.ownership import Ownership
from seerd.rundir import RunDir

if TYPE_CHECKING:
    from seerd.coordinator.daemon import CoordinatorResult

EXIT_OK, EXIT_INCOMPLETE, EXIT_BAD_INPUT, EXIT_FAILED_REQUESTS = 0, 1, 2, 3


def prepare_or_exit(options: dict, *, workers: int, where: str, allow_model_change: bool) -> PreparedRun:
    """Create the run the options describe, or find the one to resume; tell the user which (exit 2
    for bad input, with nothing created, or a run that cannot be resumed now). `where` says where its
    workers run. The caller releases `ownership` (None for a finished run)."""
    rundir = RunDir(options["run_dir"].resolve())
    with exit_2_on(BadRun, ConfigError):
        config = build_config(workers=workers, **options)
        prepared = prepare_run(rundir, config, options["input_path"], options["prior_dir"],
                               allow_model_change=allow_model_change)
    for note in prepared.notes:
        ui.warn(note)
    if prepared.finished:
        ui.info(f"run {rundir.path} is already finished; outputs: {rundir.parquet_path}, {rundir.jsonl_path}")
        return prepared
    if not prepared.created:
        ui.info(f"run {rundir.path} exists and is unfinished ({prepared.previous_status.value}): resuming it")
        return prepared
    ui.info(f"run {rundir.path}: {prepared.groups} groups, {prepared.requests} requests, policy "
            f"{config.policy}, {where}")
    if prepared.seeded is not None:
        ui.info(f"--prior {config.prior_run_dir}: seeded the estimates of {prepared.seeded} of {prepared.groups} "
                f"groups")
    return prepared


@contextmanager
def exit_2_on(*refusals: type[Exception]) -> Iterator[None]:
    """Exit 2 with the message of any of `refusals` raised inside: bad input, or a run that cannot
    start now (a live owner, a changed model checkpoint)."""
    try:
        yield
    except refusals as exc:
        ui.error(str(exc))
        raise SystemExit(EXIT_BAD_INPUT) from None


def own_or_exit(rundir: RunDir) -> Ownership:
    """Own the run directory, or exit 2 naming the live coordinator that owns it."""
    with exit_2_on(BadRun):
        return own(rundir)


def report_result(rundir: RunDir, result: CoordinatorResult, elapsed: float, *,
                  resume_hint: str | None = None) -> None:
    """Say how the run ended; exit 1 unless the output is complete, 3 if requests failed."""
    if result.status == RolloutStatus.FINISHED and result.export is not None:
        ui.info(f"finished in {elapsed:.1f}s")
        figures = {"responses": result.export.responses, "parquet": rundir.parquet_path,
                   "jsonl": rundir.jsonl_path}
        if result.load:
            load = result.load
            figures["coordinator"] = (f"{load.get('generation_cpu_s', load['cpu_s']):.2f}s CPU = {load['cpu_share']:.2%} of the "
                                      f"{load['generation_s']:.1f}s generation phase "
                                      f"({load['api_calls']} API calls)")
            threads = sorted((load.get("generation_cpu_by_thread_s") or {}).items(), key=lambda t: -t[1])
            if threads:  # where that CPU went: the state thread (SQL, scheduling), the event loop (HTTP)
                figures["by thread"] = ", ".join(f"{name} {seconds:.2f}s" for name, seconds in threads if seconds >= 0.01)
        ui.summary(figures)
        if result.export.failed:
            ui.warn(f"{result.export.failed} of {result.export.responses_total} requests failed: their rows have "
                    f'finish_reason "error" and the engine\'s message in "error" (`seerd status {rundir.path}`)')
            raise SystemExit(EXIT_FAILED_REQUESTS)
        return
    if result.status == RolloutStatus.FINISHED:
        ui.info(f"run {rundir.path} is already finished")
        return
    hint = resume_hint or f"Continue with `seerd resume {rundir.path}`"
    ui.error(f"run {result.status.value}: {result.reason}. {hint}")
    raise SystemExit(EXIT_INCOMPLETE)
