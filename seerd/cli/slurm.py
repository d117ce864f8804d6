"""`seerd slurm-run` (what slurm/rollout.sh runs inside its allocation) and `seerd submit` (submitit)."""

from __future__ import annotations

import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

import click

from seerd.cli import ui
from seerd.cli.launching import EXIT_BAD_INPUT, EXIT_INCOMPLETE, exit_2_on, prepare_or_exit, report_result
from seerd.cli.options import (
    ALLOW_MODEL_CHANGE_OPTION, ENGINE_ARG_OPTION, parse_engine_args, rollout_options, submit_options,
)
from seerd.config import DEFAULT_DRAIN_GRACE_S, ConfigError, build_config, number_problem, parallel_engine_args
from seerd.launch.prepare import BadRun


def _engine_args(pairs: tuple[str, ...], gpus_per_worker: int) -> dict:
    return parallel_engine_args(parse_engine_args(pairs), gpus_per_worker)


def allocation_options(command: Callable) -> Callable:
    """How workers fill the allocation: `seerd slurm-run` and `seerd slurm-serve`."""
    for option in reversed([
        click.option("--workers-per-node", type=int, default=None,
                     help="vLLM workers on each node (default: the node's GPUs / --gpus-per-worker; 1 without GPUs)."),
        click.option("--gpus-per-worker", type=int, default=None,
                     help="GPUs per worker = its tensor parallel size; 0: CPU workers (default: 1 with GPUs, else 0)."),
        click.option("--cpus-per-worker", type=int, default=None,
                     help="CPUs of each worker step (default: an even share)."),
        click.option("--mem-per-worker", "mem_per_worker_mb", type=int, default=None,
                     help="MB of each worker step (default: an even share of the job's memory, if it has any)."),
    ]):
        command = option(command)
    return command


@click.command("slurm-run")
@rollout_options
@allocation_options
@click.option("--drain-grace", default=DEFAULT_DRAIN_GRACE_S, show_default=True,
              help="After the warning signal, seconds in-flight chunks may still report before the requeue.")
@ENGINE_ARG_OPTION
@ALLOW_MODEL_CHANGE_OPTION
def slurm_run(workers_per_node: int | None, gpus_per_worker: int | None, cpus_per_worker: int | None,
              mem_per_worker_mb: int | None, drain_grace: float, engine_args: tuple[str, ...],
              allow_model_change: bool, **options) -> None:  # noqa: ANN003
    """Run a rollout inside a Slurm allocation: the coordinator here, workers as job steps on every
    node. What `sbatch slurm/rollout.sh` runs; after a requeue it resumes the run."""
    from seerd.coordinator.model_identity import ModelChanged
    from seerd.launch.slurm import LayoutError, NotInAllocation, allocation_layout, run_in_allocation

    try:
        drain_problem = number_problem("--drain-grace", drain_grace, above=0)
        if drain_problem:
            raise ConfigError(drain_problem)
        layout = allocation_layout(os.environ, workers_per_node=workers_per_node, gpus_per_worker=gpus_per_worker,
                                   cpus_per_worker=cpus_per_worker, mem_per_worker_mb=mem_per_worker_mb)
        parsed = _engine_args(engine_args, layout.gpus_per_worker)
    except (ConfigError, LayoutError, NotInAllocation, click.BadParameter) as exc:
        ui.error(str(exc))
        raise SystemExit(EXIT_BAD_INPUT) from None
    prepared = prepare_or_exit({**options, "engine_args": parsed, "gpus_per_worker": layout.gpus_per_worker,
                                "nodes": len(layout.nodes)},
                               workers=layout.total_workers, where=layout.describe(),
                               allow_model_change=allow_model_change)
    if prepared.finished:
        return
    started = time.monotonic()
    with prepared.ownership, exit_2_on(ModelChanged):
        outcome = run_in_allocation(prepared.rundir, layout, prepared.ownership, allow_model_change=allow_model_change,
                                    drain_grace_s=drain_grace)
    if outcome.requeued:
        ui.warn(f"run interrupted: {outcome.result.reason}. Requeued job {layout.job_id}: it continues from the "
                f"database when it starts again")
        raise SystemExit(EXIT_INCOMPLETE)
    report_result(prepared.rundir, outcome.result, time.monotonic() - started,
                  resume_hint=f"Continue with sbatch and the same arguments, or `seerd resume {prepared.rundir.path}`")


@click.command()
@submit_options
@click.option("--serve", is_flag=True, help="Submit `seerd serve` (batches come later: seerd rollout, seerd.Client) "
              "instead of one rollout; no --input.")
@click.option("--nodes", default=1, show_default=True, help="Nodes of the allocation.")
@click.option("--workers-per-node", type=int, default=None,
              help="vLLM workers per node (default: --gpus-per-node / --gpus-per-worker; 1 for CPU workers).")
@click.option("--gpus-per-worker", default=1, show_default=True,
              help="GPUs per worker = its tensor parallel size; 0: CPU workers.")
@click.option("--gpus-per-node", default=8, show_default=True, help="GPUs of a node (H800 nodes: 8).")
@click.option("--cpus-per-worker", type=int, default=None, help="CPUs of each worker step (default: an even share).")
@click.option("--mem-per-worker", "mem_per_worker_mb", type=int, default=None, help="MB of each worker step.")
@click.option("--time", "time_min", default=240, show_default=True, help="Time limit in minutes.")
@click.option("--partition", default=None)
@click.option("--account", default=None)
@click.option("--qos", default=None)
@click.option("--signal-delay", "signal_delay_s", default=300, show_default=True,
              help="Seconds before the time limit that the warning signal (drain, then requeue) comes.")
@click.option("--drain-grace", "drain_grace_s", default=DEFAULT_DRAIN_GRACE_S, show_default=True,
              help="After the warning signal, seconds in-flight chunks may still report before the requeue.")
@click.option("--exclusive/--shared", default=True, show_default=True, help="Whole nodes.")
@click.option("--slurm-arg", "slurm_args", multiple=True, metavar="KEY=VALUE",
              help="Another sbatch option, e.g. constraint=h800 (repeatable).")
@click.option("--cluster", type=click.Choice(["auto", "slurm", "local"]), default="auto", show_default=True,
              help="submitit's executor: auto = Slurm when srun is on the PATH, else local processes.")
@click.option("--wait/--no-wait", default=False, show_default=True,
              help="Wait for the job and exit 0 only when the output is complete.")
@click.option("--dry-run", is_flag=True, help="Print the sbatch script submitit would write; submit nothing.")
@ENGINE_ARG_OPTION
@ALLOW_MODEL_CHANGE_OPTION
def submit(nodes: int, workers_per_node: int | None, gpus_per_worker: int, gpus_per_node: int,
           cpus_per_worker: int | None, mem_per_worker_mb: int | None, time_min: int, partition: str | None,
           account: str | None, qos: str | None, signal_delay_s: int, drain_grace_s: float, exclusive: bool,
           slurm_args: tuple[str, ...], cluster: str, wait: bool, dry_run: bool, engine_args: tuple[str, ...],
           allow_model_change: bool, serve: bool, **options) -> None:  # noqa: ANN003
    """Submit a rollout as a submitit job (seerd.submit from the shell): the coordinator in the job,
    workers as steps of the same allocation. Prints the job id."""
    from seerd.launch.submitit_launch import RolloutFailed, SlurmResources, sbatch_script, submit_rollout
    from seerd.rundir import RunDir

    try:
        extra = {}
        for pair in slurm_args:
            key, sep, value = pair.partition("=")
            if not sep or not key:
                raise click.BadParameter(f"expected KEY=VALUE, got {pair!r}", param_hint="--slurm-arg")
            extra[key] = value
        resources = SlurmResources(
            nodes=nodes, workers_per_node=workers_per_node, gpus_per_worker=gpus_per_worker,
            gpus_per_node=gpus_per_node, cpus_per_worker=cpus_per_worker, mem_per_worker_mb=mem_per_worker_mb,
            time_min=time_min, partition=partition, account=account, qos=qos, signal_delay_s=signal_delay_s,
            drain_grace_s=drain_grace_s, exclusive=exclusive, slurm_args=extra)
        resources.validate()
        if dry_run:
            folder = options["run_dir"].resolve() / "submitit" / "DRY-RUN"
            click.echo(sbatch_script(resources, folder, shlex.quote(sys.executable)), nl=False)
            return
        if serve:
            if wait:
                raise click.BadParameter("a serve runs until cancelled: --wait is for one rollout")
            if options["input_path"] is not None or options["prior_dir"] is not None:
                raise click.BadParameter("a serve takes its prompts batch by batch: no --input or --prior with --serve")
            _submit_serve(resources, _engine_args(engine_args, gpus_per_worker), cluster, options)
            return
        if options["input_path"] is None:
            raise click.BadParameter("a rollout needs its prompt file: --input (or --serve for a serve)")
        config = build_config(workers=nodes * resources.workers, gpus_per_worker=resources.gpus_per_worker, nodes=nodes,
                              engine_args=_engine_args(engine_args, gpus_per_worker), **options)
        handle = submit_rollout(RunDir(options["run_dir"].resolve()), config, options["input_path"], resources,
                                prior_dir=options["prior_dir"], cluster=None if cluster == "auto" else cluster,
                                allow_model_change=allow_model_change)
    except (BadRun, ConfigError, click.BadParameter) as exc:
        ui.error(str(exc))
        raise SystemExit(EXIT_BAD_INPUT) from None
    if handle.job is None:
        ui.info(f"run {handle.run_dir} is already finished; nothing submitted")
        return
    click.echo(handle.job_id)
    ui.info(f"submitted job {handle.job_id} for run {handle.run_dir}; logs in {handle.folder}")
    if not wait:
        return
    try:
        done = handle.wait()
    except RolloutFailed as exc:
        ui.error(str(exc))
        raise SystemExit(EXIT_INCOMPLETE) from None
    ui.summary({"responses": done["responses"], "parquet": Path(done["parquet"]), "jsonl": Path(done["jsonl"])})


def _submit_serve(resources, engine_args: dict, cluster: str, options: dict) -> None:  # noqa: ANN001
    """`seerd submit --serve`: print the job id; batches go to it with `seerd rollout --server RUN_DIR`."""
    from dataclasses import asdict

    from seerd.serve.launch import submit_serve

    settings = {k: v for k, v in options.items() if k not in ("input_path", "prior_dir", "model_path", "run_dir")}
    slurm = {k: v for k, v in asdict(resources).items() if k != "job_name"}  # the serve's own: seerd-serve
    handle = submit_serve(options["model_path"], options["run_dir"], cluster=None if cluster == "auto" else cluster,
                          engine_args=engine_args, **settings, **slurm)
    click.echo(handle.job_id)
    ui.info(f"submitted serve job {handle.job_id} in {handle.run_dir}; batches: `seerd rollout --server "
            f"{handle.run_dir} --input FILE` or seerd.Client; logs in {handle.folder}")
