"""`seerd.submit(...)` and `seerd submit`: a rollout as one submitit job.

submitit's `AutoExecutor` picks Slurm when `srun` is on the PATH and its local executor otherwise,
so the same call works on a laptop. The submitted callable (`RolloutJob`) runs the coordinator in
the job's one task (`srun --overlap`, so it never holds CPUs or GPUs the worker steps need) and
starts the workers as steps of the same allocation (launch/slurm.py); under the local executor it
starts local worker processes instead.

The run is created (or found, to resume) before submission, on the submitting host: bad input
fails at once, not in a job log. Each submission gets a fresh submitit folder under the run
directory: Slurm job ids restart when a cluster's state is wiped, and a stale
`<id>_0_result.pkl` would be returned as this job's result.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
import time
import uuid
from dataclasses import dataclass, field, fields
from pathlib import Path

import submitit

from seerd.config import DEFAULT_DRAIN_GRACE_S, ROLLOUT_DEFAULTS, ConfigError, build_config, number_problem
from seerd.db import RolloutStatus
from seerd.db.read import UnreadableDatabase
from seerd.launch.prepare import BadRun, prepare_run, read_rollout
from seerd.ownership import take_ownership
from seerd.rundir import RunDir

log = logging.getLogger("seerd.submit")

H800_GPUS_PER_NODE = 8
EXIT_REQUEUED = 1  # the job was requeued after a drain: no result now, the next start continues


class RolloutFailed(RuntimeError):
    """The job ended without a complete output (the run's state says why; it is resumable)."""


@dataclass(frozen=True)
class SlurmResources:
    """What one rollout job asks Slurm for. Defaults: whole H800 nodes (8 GPUs), one worker per
    GPU, requeued after a warning signal 5 minutes before the time limit."""

    nodes: int = 1
    workers_per_node: int | None = None  # default: GPUs per node / gpus_per_worker, or 1 CPU worker
    gpus_per_worker: int = 1  # tensor parallel size of each vLLM instance; 0: CPU workers
    gpus_per_node: int = H800_GPUS_PER_NODE
    cpus_per_worker: int | None = None  # default: the node's CPUs split evenly
    mem_per_worker_mb: int | None = None
    time_min: int = 240
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    signal_delay_s: int = 300  # the warning signal comes this long before the time limit
    drain_grace_s: float = DEFAULT_DRAIN_GRACE_S  # in-flight chunks may report this long after the warning
    exclusive: bool = True
    job_name: str = "seerd-rollout"
    slurm_args: dict = field(default_factory=dict)  # more sbatch options, {"constraint": "h800"}

    @property
    def workers(self) -> int:
        """Workers per node."""
        if self.workers_per_node is not None:
            return self.workers_per_node
        return self.gpus_per_node // self.gpus_per_worker if self.gpus_per_worker else 1

    def validate(self) -> None:
        # Types and finiteness first: the relations below would raise on a string or pass a NaN.
        numbers = [number_problem("nodes", self.nodes, integer=True, at_least=1),
                   number_problem("gpus_per_worker", self.gpus_per_worker, integer=True, at_least=0),
                   number_problem("gpus_per_node", self.gpus_per_node, integer=True, at_least=0),
                   number_problem("time_min", self.time_min, integer=True),
                   number_problem("signal_delay_s", self.signal_delay_s, integer=True),
                   number_problem("drain_grace_s", self.drain_grace_s)]
        numbers += [number_problem(name, getattr(self, name), integer=True, at_least=1)
                    for name in ("workers_per_node", "cpus_per_worker", "mem_per_worker_mb")
                    if getattr(self, name) is not None]
        problems = [problem for problem in numbers if problem]
        if problems:
            raise BadRun("; ".join(problems))
        if self.workers < 1:
            problems.append(f"no worker fits: workers_per_node {self.workers_per_node}, gpus_per_node "
                            f"{self.gpus_per_node}, gpus_per_worker {self.gpus_per_worker}")
        elif self.gpus_per_worker and self.workers * self.gpus_per_worker > self.gpus_per_node:
            problems.append(f"{self.workers} workers x {self.gpus_per_worker} GPUs exceed gpus_per_node "
                            f"{self.gpus_per_node}")
        if self.time_min < 3:
            problems.append(f"time_min must be >= 3 (got {self.time_min}): Slurm's warning signal can come "
                            f"~60 s early")
        if not 0 < self.drain_grace_s < self.signal_delay_s:
            problems.append(f"drain_grace_s ({self.drain_grace_s}) must be > 0 and below signal_delay_s "
                            f"({self.signal_delay_s}), so that the drain ends before the time limit")
        if self.signal_delay_s >= self.time_min * 60:
            problems.append(f"signal_delay_s ({self.signal_delay_s}) must be below the time limit "
                            f"({self.time_min} min)")
        if problems:
            raise BadRun("; ".join(problems))


def submitit_parameters(resources: SlurmResources) -> dict:
    """AutoExecutor.update_parameters(...) for this job (generic names, Slurm ones prefixed)."""
    params: dict = {
        "name": resources.job_name,
        "timeout_min": resources.time_min,
        "nodes": resources.nodes,
        "tasks_per_node": 1,
        # One coordinator task on the first node, overlapping the worker steps' CPUs and GPUs.
        "slurm_srun_args": ["--overlap", "--nodes=1", "--ntasks=1"],
        "slurm_signal_delay_s": resources.signal_delay_s,
        "slurm_additional_parameters": {"requeue": True, **resources.slurm_args},
    }
    if resources.gpus_per_worker:
        params["gpus_per_node"] = resources.workers * resources.gpus_per_worker
    if resources.cpus_per_worker is not None:
        params["cpus_per_task"] = resources.workers * resources.cpus_per_worker
    if resources.mem_per_worker_mb is not None:
        params["mem_gb"] = resources.workers * resources.mem_per_worker_mb / 1024
    if resources.exclusive:
        params["slurm_exclusive"] = True
    for name in ("partition", "account", "qos"):
        if getattr(resources, name) is not None:
            params[f"slurm_{name}"] = getattr(resources, name)
    return params


def sbatch_script(resources: SlurmResources, folder: Path, python: str) -> str:
    """The sbatch script submitit writes for this job on Slurm (`seerd submit --dry-run`), made by
    submitit's own renderer from the parameters above, translated as its AutoExecutor does."""
    from submitit.slurm import slurm as submitit_slurm

    renames = submitit.SlurmExecutor._equivalence_dict()
    params = {}
    for key, value in submitit_parameters(resources).items():
        if key.startswith("slurm_"):
            params[key.removeprefix("slurm_")] = value
        elif key in renames:
            params[renames[key]] = submitit_slurm._convert_mem(value) if key == "mem_gb" else value
    command = " ".join([python, "-u -m submitit.core._submit", shlex.quote(str(folder))])
    return submitit_slurm._make_sbatch_string(command=command, folder=folder, **params)


class RolloutJob(submitit.helpers.Checkpointable):
    """The submitted callable: run (or resume) the rollout in `run_dir` with this job's workers.

    Checkpointable: should submitit's own handler see the warning signal (before the coordinator
    has taken the signal over), it requeues this same call, which resumes from the database.
    """

    def __init__(self, run_dir: str, resources: SlurmResources, *, allow_model_change: bool = False) -> None:
        self.run_dir = run_dir
        self.resources = resources
        self.allow_model_change = allow_model_change

    def __call__(self) -> dict:
        from seerd.coordinator.daemon import Coordinator
        from seerd.launch.local import run_local
        from seerd.launch.slurm import allocation_layout, run_in_allocation

        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        rundir = RunDir(Path(self.run_dir))
        res = self.resources
        # RunOwned when a live coordinator has the run; a requeued job waits for its predecessor's
        # heartbeat to go stale (seerd/ownership.py).
        with take_ownership(rundir.path) as ownership:
            if os.environ.get("SLURM_JOB_ID"):
                layout = allocation_layout(os.environ, workers_per_node=res.workers,
                                           gpus_per_worker=res.gpus_per_worker, cpus_per_worker=res.cpus_per_worker,
                                           mem_per_worker_mb=res.mem_per_worker_mb)
                outcome = run_in_allocation(rundir, layout, ownership, allow_model_change=self.allow_model_change,
                                            drain_grace_s=res.drain_grace_s)
                if outcome.requeued:
                    # SystemExit, not an exception: submitit then writes no result, and the requeued
                    # job (the same pickled call) continues the run.
                    print(f"seerd: requeued job {layout.job_id}: {outcome.result.reason}", file=sys.stderr,
                          flush=True)
                    sys.exit(EXIT_REQUEUED)
                result = outcome.result
            else:
                workers = res.nodes * res.workers
                result = run_local(Coordinator(rundir, ownership, allow_model_change=self.allow_model_change,
                                               expected_workers=workers), workers)
        if result.status != RolloutStatus.FINISHED:
            raise RolloutFailed(f"run {result.status.value}: {result.reason}. It is resumable: submit again or "
                                f"`seerd resume {rundir.path}`")
        return summary(rundir)


def summary(rundir: RunDir) -> dict:
    """What the outputs say (rollouts.meta.json); an unfinished run has none yet."""
    import json

    meta = json.loads(rundir.meta_path.read_text()) if rundir.meta_path.exists() else {}
    return {"run_dir": str(rundir.path), "complete": meta.get("complete", False),
            "responses": meta.get("responses"), "failed": meta.get("failed", 0),
            "parquet": str(rundir.parquet_path), "jsonl": str(rundir.jsonl_path)}


class RolloutHandle:
    """A submitted rollout: `job_id`, `done()`, `wait()` (the summary, or RolloutFailed) and
    `results()` (one dict per response, as in rollouts.parquet)."""

    def __init__(self, rundir: RunDir, job: submitit.Job | None, folder: Path | None = None) -> None:
        self.rundir = rundir
        self.job = job  # None: the run was already finished, nothing was submitted
        self.folder = folder

    @property
    def job_id(self) -> str | None:
        return None if self.job is None else self.job.job_id

    @property
    def run_dir(self) -> Path:
        return self.rundir.path

    def done(self) -> bool:
        return self.job is None or self.job.done()

    def wait(self) -> dict:
        """Block until the job ends; the run's summary when its output is complete."""
        if self.job is not None:
            try:
                self.job.task(0).result()
            except (submitit.core.utils.UncompletedJobError, submitit.core.utils.FailedJobError) as exc:
                raise RolloutFailed(self._failure(exc)) from exc
        done = summary(self.rundir)
        if not done["complete"]:
            raise RolloutFailed(self._failure(None))
        return done

    def results(self) -> list[dict]:
        import pyarrow.parquet as pq

        self.wait()
        return pq.read_table(self.rundir.parquet_path).to_pylist()

    def cancel(self) -> None:
        if self.job is not None:
            self.job.cancel(check=False)

    def _failure(self, exc: BaseException | None) -> str:
        where = f"job {self.job_id} (log: {self.job.paths.stderr})" if self.job is not None else "the run"
        detail = f": {str(exc).strip().splitlines()[-1]}" if exc is not None and str(exc).strip() else ""
        try:
            rollout = read_rollout(self.rundir)
        except UnreadableDatabase as unreadable:  # e.g. its coordinator's node died a moment ago (db.sharing)
            return (f"{where} ended without a complete output; its state cannot be read from here "
                    f"({unreadable}){detail}")
        return (f"{where} ended without a complete output; run {rollout.status.value}"
                f"{f' ({rollout.status_reason})' if rollout.status_reason else ''}{detail}")


def submit_rollout(rundir: RunDir, config, input_path: Path, resources: SlurmResources, *,  # noqa: ANN001
                   prior_dir: Path | None = None, cluster: str | None = None, folder: Path | None = None,
                   allow_model_change: bool = False) -> RolloutHandle:
    """Create (or find) the run, then submit the job that runs it; BadRun for bad input, a changed
    model or a run that a live coordinator owns."""
    resources.validate()
    prepared = prepare_run(rundir, config, input_path, prior_dir, allow_model_change=allow_model_change)
    for note in prepared.notes:
        log.warning("%s", note)
    if prepared.finished:
        return RolloutHandle(rundir, None)
    prepared.ownership.release()  # the job owns the run from its start
    folder = Path(folder) if folder is not None else (
        rundir.path / "submitit" / f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}")
    folder.mkdir(parents=True, mode=0o700, exist_ok=False)  # fresh: a stale result must never be read
    executor = submitit.AutoExecutor(folder=folder, cluster=cluster)
    executor.update_parameters(**submitit_parameters(resources))
    job = executor.submit(RolloutJob(str(rundir.path), resources, allow_model_change=allow_model_change))
    log.info("submitted %s job %s for %s (submitit folder %s)", executor.cluster, job.job_id, rundir.path, folder)
    return RolloutHandle(rundir, job, folder)


def submit(input: str | Path, model: str | Path, run_dir: str | Path, *,  # noqa: A002
           cluster: str | None = None, folder: str | Path | None = None, **options: object) -> RolloutHandle:
    """Submit a rollout; see `seerd.submit`."""
    resource_names = {f.name for f in fields(SlurmResources)}
    resources = SlurmResources(**{k: v for k, v in options.items() if k in resource_names})
    rollout = {k: v for k, v in options.items() if k not in resource_names}
    allow_model_change = bool(rollout.pop("allow_model_change", False))
    if "prior" in rollout:  # the CLI's --prior
        rollout["prior_dir"] = rollout.pop("prior")
    unknown = sorted(set(rollout) - set(ROLLOUT_DEFAULTS) - {"engine_args"})
    if unknown:
        raise TypeError(f"unknown options {unknown}; rollout options: {sorted(ROLLOUT_DEFAULTS)}, engine_args; "
                        f"Slurm resources: {sorted(resource_names)}")
    merged = {**ROLLOUT_DEFAULTS, **rollout}
    prior = merged.pop("prior_dir")
    prior_dir = Path(prior) if prior is not None else None
    resources.validate()
    try:
        config = build_config(workers=resources.nodes * resources.workers, gpus_per_worker=resources.gpus_per_worker,
                              nodes=resources.nodes,
                              input_path=Path(input), model_path=Path(model), prior_dir=prior_dir, **merged)
    except ConfigError as exc:
        raise BadRun(str(exc)) from None
    return submit_rollout(RunDir(Path(run_dir).resolve()), config, Path(input), resources, prior_dir=prior_dir,
                          cluster=cluster, folder=Path(folder) if folder is not None else None,
                          allow_model_change=allow_model_change)
