"""`seerd serve` (a coordinator and its engines across batches) and `seerd rollout` (one batch on it)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import click

from seerd.cli import ui
from seerd.cli.launching import EXIT_BAD_INPUT, EXIT_INCOMPLETE, EXIT_OK, exit_2_on
from seerd.cli.options import ENGINE_ARG_OPTION, engine_options
from seerd.config import ConfigError, RunConfig, build_config
from seerd.launch.prepare import BadRun, own
from seerd.ownership import Ownership
from seerd.rundir import RunDir, write_private


def serve_config(workers: int, options: dict) -> RunConfig:
    """The serve's settings, checked as `seerd run` checks a run's (ConfigError otherwise): the
    engines', and the sampling defaults of batches that name none."""
    from seerd.io.prompts import ModelDirError, load_model_limits
    from seerd.launch.engine_rules import SamplingCheck, context_length, with_context_length

    config = build_config(workers=workers, input_path=Path(os.devnull), prior_dir=None, **options)
    config.validate()
    if config.engine.api == "sim":
        raise ConfigError("seerd serve runs vLLM engines: --engine-api sim is for `seerd run` and tools/load.py")
    if config.kv_pool.mode != "off":
        raise ConfigError("seerd serve has no KV pool yet (its pool lives as long as one batch): use --kv-pool off")
    try:
        context = context_length(config.engine, load_model_limits(config.model_dir))
    except ModelDirError as exc:
        raise ConfigError(str(exc)) from None
    problem = SamplingCheck(config).options_problem()
    if problem:
        raise ConfigError(problem)
    return with_context_length(config, context)


def _serve_setup(workers: int, options: dict) -> tuple[RunDir, Ownership, RunConfig]:
    """The serve's settings checked, its run directory owned, its database there (exit 2 otherwise)."""
    from seerd.db import make_engine
    from seerd.db.migrate import upgrade

    with exit_2_on(BadRun, ConfigError):
        config = serve_config(workers, options)
        rundir = RunDir(options["run_dir"].resolve())
        rundir.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        ownership = own(rundir)
    if not rundir.exists():
        rundir.create()
        engine = make_engine(rundir.db_path)
        upgrade(engine)
        engine.dispose()
    return rundir, ownership, config


@click.command()
@engine_options
@click.option("--workers", default=2, show_default=True, help="Local vLLM worker processes.")
def serve(workers: int, **options) -> None:  # noqa: ANN003
    """Keep a coordinator and WORKERS engines up for batch after batch (`seerd rollout`,
    `seerd.Client`): each batch a rollout in one database, new weights loaded in place."""
    from seerd.event_loop import run_event_loop
    from seerd.launch.local import WorkerPool
    from seerd.serve.server import Server

    rundir, ownership, config = _serve_setup(workers, options)
    with ownership:
        pool = WorkerPool(rundir, workers)
        server = Server(rundir, ownership, config, workers=workers, pool=pool)
        ui.info(f"serving {config.model_path} on {workers} workers in {rundir.path}; batches: "
                f"`seerd rollout --server {rundir.path} --input FILE` or seerd.Client")
        try:
            reason = run_event_loop(server.serve(on_ready=pool.start))
        finally:
            pool.stop(complete=False)
    ui.info(f"serve stopped: {reason} ({server.batches_run} batches run)")
    raise SystemExit(EXIT_INCOMPLETE if pool.exhausted else EXIT_OK)


@click.command("slurm-serve")
@engine_options
@click.option("--workers-per-node", type=int, default=None,
              help="vLLM workers on each node (default: the node's GPUs / --gpus-per-worker; 1 without GPUs).")
@click.option("--gpus-per-worker", type=int, default=None,
              help="GPUs per worker = its tensor parallel size; 0: CPU workers (default: 1 with GPUs, else 0).")
@click.option("--cpus-per-worker", type=int, default=None, help="CPUs of each worker step (default: an even share).")
@click.option("--mem-per-worker", "mem_per_worker_mb", type=int, default=None, help="MB of each worker step.")
@ENGINE_ARG_OPTION
def slurm_serve(workers_per_node: int | None, gpus_per_worker: int | None, cpus_per_worker: int | None,
                mem_per_worker_mb: int | None, engine_args: tuple[str, ...], **options) -> None:  # noqa: ANN003
    """`seerd serve` inside a Slurm allocation (what `sbatch slurm/serve.sh` runs): the serve here,
    workers as job steps on every node. Its warning signal stops it and requeues the job; the
    requeued job serves on, the batch in flight first."""
    from seerd.cli.slurm import _engine_args
    from seerd.event_loop import run_event_loop
    from seerd.serve.server import Server
    from seerd.launch.slurm import (
        DRAIN_SIGNALS, LayoutError, NotInAllocation, SlurmWorkerPool, allocation_layout, node_address, requeue_job,
    )

    try:
        layout = allocation_layout(os.environ, workers_per_node=workers_per_node, gpus_per_worker=gpus_per_worker,
                                   cpus_per_worker=cpus_per_worker, mem_per_worker_mb=mem_per_worker_mb)
        options = {**options, "engine_args": _engine_args(engine_args, layout.gpus_per_worker),
                   "gpus_per_worker": layout.gpus_per_worker, "nodes": len(layout.nodes)}
    except (ConfigError, LayoutError, NotInAllocation, click.BadParameter) as exc:
        ui.error(str(exc))
        raise SystemExit(EXIT_BAD_INPUT) from None
    rundir, ownership, config = _serve_setup(layout.total_workers, options)
    with ownership:
        pool = SlurmWorkerPool(rundir, layout)
        server = Server(rundir, ownership, config, workers=layout.total_workers, host=node_address(), pool=pool,
                        warning_signals=DRAIN_SIGNALS)
        ui.info(f"serving {config.model_path} on {layout.describe()} in {rundir.path}")
        try:
            reason = run_event_loop(server.serve(on_ready=pool.start))
        finally:
            pool.stop(complete=False)
    if server.warned:
        error = requeue_job(layout.job_id)
        if error is None:
            ui.warn(f"serve stopped ({reason}); requeued job {layout.job_id}: it serves on from the database")
            raise SystemExit(EXIT_INCOMPLETE)
        ui.error(f"serve stopped ({reason}); requeueing job {layout.job_id} failed: {error}")
        raise SystemExit(EXIT_INCOMPLETE)
    ui.info(f"serve stopped: {reason} ({server.batches_run} batches run)")
    raise SystemExit(EXIT_INCOMPLETE if pool.exhausted else EXIT_OK)


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
