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
from seerd.cli.options import engine_options
from seerd.config import ConfigError, RunConfig, build_config
from seerd.launch.prepare import BadRun, own
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


@click.command()
@engine_options
@click.option("--workers", default=2, show_default=True, help="Local vLLM worker processes.")
def serve(run_dir: Path, workers: int, **options) -> None:  # noqa: ANN003
    """Keep a coordinator and WORKERS engines up for batch after batch (`seerd rollout`,
    `seerd.Client`): each batch a rollout in one database, new weights loaded in place."""
    from seerd.db import make_engine
    from seerd.db.migrate import upgrade
    from seerd.event_loop import run_event_loop
    from seerd.launch.local import WorkerPool
    from seerd.serve.server import Server

    with exit_2_on(BadRun, ConfigError):
        config = serve_config(workers, options)
        rundir = RunDir(run_dir.resolve())
        rundir.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        ownership = own(rundir)
    with ownership:
        if not rundir.exists():
            rundir.create()
            engine = make_engine(rundir.db_path)
            upgrade(engine)
            engine.dispose()
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
