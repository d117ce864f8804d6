"""How a serve starts, for every launcher: `seerd serve` (local workers), `seerd slurm-serve`
(`sbatch slurm/serve.sh`: workers as job steps) and `seerd.submit_serve` / `seerd submit --serve`
(a submitit job, on Slurm or local processes).

The settings are checked as `seerd run` checks a run's before anything starts (`serve_config`:
bad options fail on the submitting host); the run directory and its database are made on the
first start (`prepare_serve_dir`); `run_serve` then runs the serve until it stops and, after
Slurm's warning signal, requeues the job (it serves on from the database).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass, fields
from pathlib import Path

import submitit

from seerd.config import ROLLOUT_DEFAULTS, ConfigError, RunConfig, build_config
from seerd.launch.local import WorkerPool
from seerd.launch.prepare import BadRun, own
from seerd.launch.submitit_launch import EXIT_REQUEUED, SlurmResources, submitit_parameters
from seerd.ownership import Ownership
from seerd.rundir import RunDir

log = logging.getLogger("seerd.serve")


@dataclass(frozen=True)
class ServeOutcome:
    reason: str  # why it stopped
    batches_run: int
    workers_exhausted: bool  # every worker kept dying: the serve stopped for it
    requeued: bool = False  # after Slurm's warning signal: the requeued job serves on
    requeue_error: str | None = None


def serve_config(workers: int, options: dict) -> RunConfig:
    """The serve's settings, checked as `seerd run` checks a run's (ConfigError otherwise): the
    engines', and the sampling defaults of batches that name none. `options`: `build_config`'s
    (every rollout option but the input and the prior)."""
    from seerd.io.prompts import ModelDirError, load_model_limits
    from seerd.launch.engine_rules import SamplingCheck, context_length, with_context_length

    config = build_config(workers=workers, input_path=Path(os.devnull), prior_dir=None, **options)
    config.validate()
    if config.engine.api == "sim":
        raise ConfigError("seerd serve runs vLLM engines: --engine-api sim is for `seerd run` and tools/bench/load.py")
    try:
        context = context_length(config.engine, load_model_limits(config.model_dir))
    except ModelDirError as exc:
        raise ConfigError(str(exc)) from None
    problem = SamplingCheck(config).options_problem()
    if problem:
        raise ConfigError(problem)
    return with_context_length(config, context)


def prepare_serve_dir(rundir: RunDir) -> None:
    """The run directory (private) and its database, on a serve's first start; the owner's to call."""
    from seerd.db import make_engine
    from seerd.db.migrate import upgrade

    if not rundir.exists():
        rundir.create()
        engine = make_engine(rundir.db_path)
        upgrade(engine)
        engine.dispose()


def run_serve(rundir: RunDir, ownership: Ownership, config: RunConfig, *, workers: int,
              layout: object | None = None) -> ServeOutcome:
    """The serve with local workers, or with `layout`'s (a `launch.slurm.WorkerLayout`) as job
    steps, until it stops; inside an allocation its warning signal requeues the job."""
    from seerd.event_loop import run_event_loop
    from seerd.serve.server import Server

    prepare_serve_dir(rundir)
    if layout is None:
        pool = WorkerPool(rundir, workers, kv_pool=config.kv_pool, gpus_per_worker=config.engine.gpus_per_worker)
        host, warning_signals = "127.0.0.1", ()
    else:
        from seerd.launch.slurm import DRAIN_SIGNALS, SlurmWorkerPool, node_address

        pool, host, warning_signals = SlurmWorkerPool(rundir, layout, kv_pool=config.kv_pool), node_address(), DRAIN_SIGNALS
    server = Server(rundir, ownership, config, workers=workers, host=host, pool=pool, warning_signals=warning_signals)
    try:
        reason = run_event_loop(server.serve(on_ready=pool.start))
    finally:
        pool.stop(complete=False)
    outcome = ServeOutcome(reason, server.batches_run, pool.exhausted)
    if server.warned and layout is not None:
        from seerd.launch.slurm import requeue_job

        # Said before the requeue: Slurm signals this job's processes as soon as it is requeued.
        log.warning("requeueing job %s: %s", layout.job_id, reason)
        error = requeue_job(layout.job_id)
        return ServeOutcome(reason, server.batches_run, pool.exhausted, requeued=error is None, requeue_error=error)
    return outcome


class ServeJob(submitit.helpers.Checkpointable):
    """`submit_serve`'s submitted callable: the serve in `run_dir` with this job's workers (job
    steps on Slurm, local processes under submitit's local executor). After Slurm's warning signal
    it requeues the job and exits without a result; the requeued job serves on. Checkpointable, as
    `RolloutJob`: should submitit's own handler see the signal first, it requeues this same call."""

    def __init__(self, run_dir: str, config_json: str, resources: SlurmResources) -> None:
        self.run_dir, self.config_json, self.resources = run_dir, config_json, resources

    def __call__(self) -> dict:
        import logging
        import sys

        from seerd.launch.slurm import allocation_layout
        from seerd.ownership import take_ownership

        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        rundir, res, config = RunDir(Path(self.run_dir)), self.resources, RunConfig.from_json(self.config_json)
        with take_ownership(rundir.path) as ownership:
            if os.environ.get("SLURM_JOB_ID"):
                layout = allocation_layout(os.environ, workers_per_node=res.workers, gpus_per_worker=res.gpus_per_worker,
                                           cpus_per_worker=res.cpus_per_worker, mem_per_worker_mb=res.mem_per_worker_mb)
                outcome = run_serve(rundir, ownership, config, workers=layout.total_workers, layout=layout)
                if outcome.requeued:
                    print(f"seerd: requeued job {layout.job_id}: {outcome.reason}", file=sys.stderr, flush=True)
                    sys.exit(EXIT_REQUEUED)
            else:
                outcome = run_serve(rundir, ownership, config, workers=res.nodes * res.workers)
        return {"run_dir": str(rundir.path), "reason": outcome.reason, "batches_run": outcome.batches_run,
                "workers_exhausted": outcome.workers_exhausted}


@dataclass(frozen=True)
class ServeHandle:
    """A submitted serve: its `job` (submitit's), the run directory, and a `client()` for batches."""

    run_dir: Path
    job: submitit.Job
    folder: Path

    @property
    def job_id(self) -> str:
        return self.job.job_id

    def client(self, **options: object):  # noqa: ANN201 - seerd.Client
        from seerd.serve.client import Client

        return Client(self.run_dir, **options)

    def done(self) -> bool:
        return self.job.done()

    def cancel(self) -> None:
        self.job.cancel(check=False)


def submit_serve(model: str | Path, run_dir: str | Path, *, cluster: str | None = None,
                 folder: str | Path | None = None, **options: object) -> ServeHandle:
    """`seerd serve` as a submitit job; see `seerd.submit_serve`. BadRun (nothing submitted) for
    bad settings or a run directory a live serve or coordinator owns."""
    resource_names = {f.name for f in fields(SlurmResources)}
    resources = SlurmResources(**{"job_name": "seerd-serve",
                                  **{k: v for k, v in options.items() if k in resource_names}})
    engine = {k: v for k, v in options.items() if k not in resource_names}
    unknown = sorted(set(engine) - set(ROLLOUT_DEFAULTS) - {"engine_args"} | ({"prior_dir"} & set(engine)))
    if unknown:
        raise TypeError(f"unknown options {unknown}; serve options: {sorted(set(ROLLOUT_DEFAULTS) - {'prior_dir'})}, "
                        f"engine_args; Slurm resources: {sorted(resource_names)}")
    resources.validate()
    merged = {k: v for k, v in {**ROLLOUT_DEFAULTS, **engine}.items() if k != "prior_dir"}
    workers = resources.nodes * resources.workers
    rundir = RunDir(Path(run_dir).resolve())
    try:
        config = serve_config(workers, {**merged, "model_path": Path(model), "run_dir": rundir.path,
                                        "gpus_per_worker": resources.gpus_per_worker, "nodes": resources.nodes})
    except ConfigError as exc:
        raise BadRun(str(exc)) from None
    rundir.path.mkdir(parents=True, exist_ok=True, mode=0o700)
    own(rundir).release()  # refused here, on the submitting host, while a live serve has it
    folder = Path(folder) if folder is not None else (
        rundir.path / "submitit" / f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}")
    folder.mkdir(parents=True, mode=0o700, exist_ok=False)
    executor = submitit.AutoExecutor(folder=folder, cluster=cluster)
    executor.update_parameters(**submitit_parameters(resources))
    job = executor.submit(ServeJob(str(rundir.path), config.to_json(), resources))
    return ServeHandle(rundir.path, job, folder)
