"""`seerd serve` (a coordinator and its engines across batches) and `seerd rollout` (one batch on it)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from seerd.cli import ui
from seerd.cli.launching import EXIT_BAD_INPUT, EXIT_INCOMPLETE, EXIT_OK, exit_2_on
from seerd.cli.options import ENGINE_ARG_OPTION, LOCAL_GPUS_OPTION, engine_options
from seerd.cli.slurm import allocation_options
from seerd.config import ConfigError, RunConfig
from seerd.launch.prepare import BadRun, own
from seerd.ownership import Ownership
from seerd.rundir import RunDir, write_private

if TYPE_CHECKING:
    from seerd.serve.launch import ServeOutcome


def _owned_serve(workers: int, options: dict) -> tuple[RunDir, Ownership, RunConfig]:
    """The serve's settings checked and its run directory owned (exit 2 otherwise)."""
    from seerd.serve.launch import serve_config

    with exit_2_on(BadRun, ConfigError):
        config = serve_config(workers, options)
        rundir = RunDir(options["run_dir"].resolve())
        rundir.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        ownership = own(rundir)
    return rundir, ownership, config


def _report(outcome: ServeOutcome, job_id: str | None = None) -> None:
    if outcome.requeued:
        ui.warn(f"serve stopped ({outcome.reason}); requeued job {job_id}: it serves on from the database")
        raise SystemExit(EXIT_INCOMPLETE)
    if outcome.requeue_error is not None:
        ui.error(f"serve stopped ({outcome.reason}); requeueing job {job_id} failed: {outcome.requeue_error}")
        raise SystemExit(EXIT_INCOMPLETE)
    ui.info(f"serve stopped: {outcome.reason} ({outcome.batches_run} batches run)")
    raise SystemExit(EXIT_INCOMPLETE if outcome.workers_exhausted else EXIT_OK)


@click.command()
@engine_options
@click.option("--workers", default=2, show_default=True, help="Local vLLM worker processes.")
@LOCAL_GPUS_OPTION
def serve(workers: int, **options) -> None:  # noqa: ANN003
    """Keep a coordinator and WORKERS engines up for batch after batch (`seerd rollout`,
    `seerd.Client`): each batch a rollout in one database, new weights loaded in place."""
    from seerd.serve.launch import run_serve

    rundir, ownership, config = _owned_serve(workers, options)
    with ownership:
        ui.info(f"serving {config.model_path} on {workers} workers in {rundir.path}; batches: "
                f"`seerd rollout --server {rundir.path} --input FILE` or seerd.Client")
        outcome = run_serve(rundir, ownership, config, workers=workers)
    _report(outcome)


@click.command("slurm-serve")
@engine_options
@allocation_options
@ENGINE_ARG_OPTION
def slurm_serve(workers_per_node: int | None, gpus_per_worker: int | None, cpus_per_worker: int | None,
                mem_per_worker_mb: int | None, engine_args: tuple[str, ...], **options) -> None:  # noqa: ANN003
    """`seerd serve` inside a Slurm allocation (what `sbatch slurm/serve.sh` runs): the serve here,
    workers as job steps on every node. Its warning signal stops it and requeues the job; the
    requeued job serves on, the batch in flight first."""
    from seerd.cli.slurm import _engine_args
    from seerd.launch.slurm import LayoutError, NotInAllocation, allocation_layout
    from seerd.serve.launch import run_serve

    try:
        layout = allocation_layout(os.environ, workers_per_node=workers_per_node, gpus_per_worker=gpus_per_worker,
                                   cpus_per_worker=cpus_per_worker, mem_per_worker_mb=mem_per_worker_mb)
        options = {**options, "engine_args": _engine_args(engine_args, layout.gpus_per_worker),
                   "gpus_per_worker": layout.gpus_per_worker, "nodes": len(layout.nodes)}
    except (ConfigError, LayoutError, NotInAllocation, click.BadParameter) as exc:
        ui.error(str(exc))
        raise SystemExit(EXIT_BAD_INPUT) from None
    rundir, ownership, config = _owned_serve(layout.total_workers, options)
    with ownership:
        ui.info(f"serving {config.model_path} on {layout.describe()} in {rundir.path}")
        outcome = run_serve(rundir, ownership, config, workers=layout.total_workers, layout=layout)
    _report(outcome, layout.job_id)


@click.command()
@click.option("--server", "server_dir", required=True, type=click.Path(path_type=Path),
              help="The run directory of a running `seerd serve`.")
@click.option("--input", "input_path", required=True, type=click.Path(path_type=Path), help="Prompt file.")
@click.option("--weights", type=click.Path(path_type=Path), help="A checkpoint of the serve's model (default: its --model).")
@click.option("--out", type=click.Path(path_type=Path), help="Write the rows here (JSONL, with weight_version).")
@click.option("--n", type=int)
@click.option("--max-tokens", type=int)
@click.option("--temperature", type=float)
@click.option("--top-p", type=float)
@click.option("--top-k", type=int)
@click.option("--seed", type=int)
def rollout(server_dir: Path, input_path: Path, weights: Path | None, out: Path | None, **sampling) -> None:  # noqa: ANN003
    """Run one batch on a `seerd serve` and wait for it; options not given are the serve's."""
    from seerd.serve.client import BatchFailed, Client, ServeError

    client = Client(server_dir)
    sampling = {k: v for k, v in sampling.items() if v is not None}
    started = time.monotonic()
    try:
        state = client.submit(input_path, weights, **sampling)
        ui.info(f"batch {state.batch}: {state.groups} groups, {state.requests} requests, weights {state.weights_version}")
        rows = []
        for group in client.groups(state.batch):
            rows.extend(group["rows"])
    except BatchFailed as exc:
        ui.error(str(exc))
        raise SystemExit(EXIT_INCOMPLETE) from None
    except ServeError as exc:
        ui.error(str(exc))
        raise SystemExit(EXIT_BAD_INPUT) from None
    rows.sort(key=lambda row: (row["group_index"], row["response_index"]))
    text = "".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows)
    if out is not None:
        write_private(out, text)
        ui.info(f"batch {state.batch}: {len(rows)} responses in {time.monotonic() - started:.1f}s -> {out}")
    else:
        sys.stdout.write(text)
