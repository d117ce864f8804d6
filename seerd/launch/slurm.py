"""Inside a Slurm allocation: the coordinator on the first node, one job step per worker.

`slurm/rollout.sh` (through `seerd slurm-run`) and the submitit job (`submitit_launch.py`) both
end here. The coordinator listens on the node's own address, never loopback, and writes it to
the run directory's `coordinator.json`; every worker is `srun` as its own step of the same job
(`--exact`, so steps share the nodes without waiting on each other), finds the address and the
secret in the run directory (shared filesystem, 0600 files) and nothing else: the command line
and the job's environment carry neither. A step that dies is started again (the local pool's
rule); its leases expire and run elsewhere meanwhile.

Preemption and time limits: Slurm's warning signal (`--signal`; USR1 from rollout.sh, USR2 from
submitit) makes the coordinator drain (no new leases; in-flight chunks report or the grace
period ends), record the run as interrupted, and this module requeue the job (`scontrol
requeue`). The restarted job resumes from the database; finished chunks never run again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import shutil
import socket
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from seerd.config import DEFAULT_DRAIN_GRACE_S
from seerd.coordinator.daemon import Coordinator, CoordinatorResult
from seerd.db import RolloutStatus
from seerd.launch.local import WorkerPool, run_local, worker_env
from seerd.ownership import Ownership
from seerd.rundir import RunDir
from seerd.settings import KVPoolConfig
from seerd.status.locate import record_slurm_job

log = logging.getLogger("seerd.slurm")

# rollout.sh asks for USR1 (`--signal=B:USR1@300`); submitit's jobs get USR2.
DRAIN_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
# A worker step waits this long for the coordinator's address file, then fails with a message.
WORKER_ADDRESS_TIMEOUT_S = 300.0
# What srun reads from its environment: a worker step must not inherit the launching step's
# task count, CPU binding or overlap settings (submitit runs the coordinator inside a step).
_STEP_INPUT_ENV = re.compile(r"^SLURM_(?!JOB_ID$|JOBID$|CONF$)")


class LayoutError(ValueError):
    """The requested workers do not fit the allocation."""


class NotInAllocation(RuntimeError):
    """Not inside a Slurm job (no SLURM_JOB_ID)."""


@dataclass(frozen=True)
class WorkerLayout:
    """Where the workers of one allocation run: `workers_per_node` on each node, rank r on node
    r // workers_per_node."""

    job_id: str
    nodes: tuple[str, ...]
    workers_per_node: int
    gpus_per_worker: int  # tensor parallel size; 0: CPU workers
    cpus_per_worker: int
    mem_per_worker_mb: int | None = None

    @property
    def total_workers(self) -> int:
        return len(self.nodes) * self.workers_per_node

    def node_of(self, rank: int) -> str:
        return self.nodes[rank // self.workers_per_node]

    def describe(self) -> str:
        kind = f"{self.gpus_per_worker} GPUs" if self.gpus_per_worker else "CPU"
        return (f"{len(self.nodes)} nodes x {self.workers_per_node} workers ({kind}, {self.cpus_per_worker} CPUs "
                f"each) in job {self.job_id}")


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed node list (`gpu[01-04]`) as host names, as Slurm itself expands it."""
    if "[" not in nodelist and nodelist.strip():  # plain names (`node01`, `a,b`): nothing to expand
        return [name for name in nodelist.split(",") if name]
    if shutil.which("scontrol") is None:  # a Slurm environment without Slurm's tools on PATH
        raise LayoutError(f"cannot expand the node list {nodelist!r}: scontrol is not on PATH "
                          "(run inside a Slurm job on a node with Slurm's client tools)")
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60)
    if out.returncode != 0 or not out.stdout.split():
        raise LayoutError(f"cannot expand the node list {nodelist!r}: {out.stderr.strip()}")
    return out.stdout.split()


def _leading_int(value: str | None) -> int | None:
    """SLURM_GPUS_ON_NODE is "8"; SLURM_GPUS_PER_NODE may be "h800:8"."""
    if not value:
        return None
    match = re.search(r"(\d+)$", value)
    return int(match.group(1)) if match else None


def allocation_layout(env: Mapping[str, str], *, workers_per_node: int | None = None,
                      gpus_per_worker: int | None = None, cpus_per_worker: int | None = None,
                      mem_per_worker_mb: int | None = None,
                      hostnames: Callable[[str], list[str]] = expand_nodelist) -> WorkerLayout:
    """The worker layout for the allocation described by `env` (a job's SLURM_* variables).

    Defaults: with GPUs on the node, one GPU per worker and as many workers as GPUs; without,
    one CPU worker per node. CPUs are split evenly between a node's workers; memory too when the
    job has a memory allocation (else steps get no --mem: the cluster does not track memory).
    """
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        raise NotInAllocation("not inside a Slurm job (no SLURM_JOB_ID): submit with `sbatch slurm/rollout.sh "
                              "...` or `seerd submit ...`, or run locally with `seerd run`")
    nodes = tuple(hostnames(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""))
    gpus_on_node = _leading_int(env.get("SLURM_GPUS_ON_NODE")) or _leading_int(env.get("SLURM_GPUS_PER_NODE")) or 0
    cpus_on_node = _leading_int(env.get("SLURM_CPUS_ON_NODE")) or os.cpu_count() or 1
    if gpus_per_worker is None:
        gpus_per_worker = 1 if gpus_on_node else 0
    if gpus_per_worker < 0:
        raise LayoutError(f"--gpus-per-worker must be >= 0 (got {gpus_per_worker})")
    if gpus_per_worker and not gpus_on_node:
        raise LayoutError(f"--gpus-per-worker {gpus_per_worker} but the job has no GPUs on its nodes "
                          f"(ask for them with --gpus-per-node, or use --gpus-per-worker 0 for CPU workers)")
    if workers_per_node is None:
        workers_per_node = gpus_on_node // gpus_per_worker if gpus_per_worker else 1
    if workers_per_node < 1:
        raise LayoutError(f"no worker fits: {gpus_on_node} GPUs per node, {gpus_per_worker} per worker")
    if gpus_per_worker and workers_per_node * gpus_per_worker > gpus_on_node:
        raise LayoutError(f"{workers_per_node} workers x {gpus_per_worker} GPUs do not fit the {gpus_on_node} GPUs "
                          f"per node of job {job_id}")
    if cpus_per_worker is None:
        cpus_per_worker = max(1, cpus_on_node // workers_per_node)
    if cpus_per_worker < 1 or workers_per_node * cpus_per_worker > cpus_on_node:
        raise LayoutError(f"{workers_per_node} workers x {cpus_per_worker} CPUs do not fit the {cpus_on_node} CPUs "
                          f"per node of job {job_id}")
    if mem_per_worker_mb is None and env.get("SLURM_MEM_PER_NODE", "").isdigit():
        mem_per_worker_mb = int(env["SLURM_MEM_PER_NODE"]) // workers_per_node
    return WorkerLayout(job_id, nodes, workers_per_node, gpus_per_worker, cpus_per_worker, mem_per_worker_mb)


def worker_step_command(layout: WorkerLayout, rank: int, worker_command: list[str]) -> list[str]:
    """`srun` for worker `rank`: one task on its node, exactly its CPUs (and GPUs, memory)."""
    command = ["srun", f"--jobid={layout.job_id}", f"--job-name=seerd-worker-{rank}", "--nodes=1", "--ntasks=1",
               f"--nodelist={layout.node_of(rank)}", f"--cpus-per-task={layout.cpus_per_worker}", "--exact"]
    if layout.gpus_per_worker:
        command.append(f"--gpus-per-task={layout.gpus_per_worker}")
    if layout.mem_per_worker_mb:
        command.append(f"--mem={layout.mem_per_worker_mb}M")
    return command + worker_command


def step_environment(env: Mapping[str, str], layout: WorkerLayout) -> dict[str, str]:
    """The environment srun starts a worker step with: the launcher's, minus srun's inputs."""
    clean = {k: v for k, v in env.items() if not _STEP_INPUT_ENV.match(k)}
    if not layout.gpus_per_worker:  # a CPU engine uses the CPUs its step got
        clean.setdefault("OMP_NUM_THREADS", str(layout.cpus_per_worker))
    return clean


def node_address() -> str:
    """This node's address as other nodes reach it: never loopback.

    SEERD_COORDINATOR_HOST wins; else the host name's non-loopback address; else the source
    address of the default route (a UDP connect sends nothing). Debian maps the host name to
    127.0.1.1, so the name alone is often not enough.
    """
    override = os.environ.get("SEERD_COORDINATOR_HOST")
    if override:
        return override
    with contextlib.suppress(OSError):  # an unresolvable host name: fall back to the route below
        for info in socket.getaddrinfo(socket.getfqdn(), None, socket.AF_INET, socket.SOCK_STREAM):
            address = info[4][0]
            if not address.startswith("127."):
                return address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.254.254.254", 9))  # routed (default route or a cluster's 10/8), never sent
            address = probe.getsockname()[0]
        except OSError:
            address = ""
    if address and not address.startswith("127.") and address != "0.0.0.0":
        return address
    raise RuntimeError("cannot find a non-loopback address for this node (workers on other nodes could not "
                       "reach the coordinator); set SEERD_COORDINATOR_HOST to the address to listen on")


class SlurmWorkerPool(WorkerPool):
    """The local pool's supervision, with each worker started as a job step."""

    def __init__(self, run_dir: RunDir, layout: WorkerLayout, *, kv_pool: KVPoolConfig | None = None) -> None:
        super().__init__(run_dir, layout.total_workers, kv_pool=kv_pool)
        self.layout = layout

    def holder_commands(self) -> dict[str, list[str]]:
        """One holder per node, as a step that overlaps the workers' (it needs memory, not CPUs)."""
        if self.kv_pool is None:
            return {}
        return {f"kvpool-holder-{node}": ["srun", f"--jobid={self.layout.job_id}", f"--job-name=seerd-kvpool-{node}",
                                          "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--overlap",
                                          *self._holder_command("--no-parent-death")]
                for node in self.layout.nodes}

    def command(self, rank: int) -> list[str]:
        worker = [*super().command(rank), "--wait-for-coordinator", f"{WORKER_ADDRESS_TIMEOUT_S:.0f}"]
        return worker_step_command(self.layout, rank, worker)

    def environment(self) -> dict[str, str]:
        return step_environment(worker_env(), self.layout)


@dataclass(frozen=True)
class AllocationResult:
    result: CoordinatorResult
    requeued: bool = False
    requeue_error: str | None = None


def requeue_job(job_id: str) -> str | None:
    """Put the job back in the queue (it restarts from the top of its script); None, or why not."""
    try:
        out = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return None if out.returncode == 0 else (out.stderr or out.stdout).strip() or f"exit {out.returncode}"


def run_in_allocation(run_dir: RunDir, layout: WorkerLayout, ownership: Ownership, *,
                      allow_model_change: bool = False, drain_grace_s: float = DEFAULT_DRAIN_GRACE_S,
                      on_tick: Callable[[dict], None] | None = None) -> AllocationResult:
    """Run the rollout (owned by this process) with this allocation's workers; requeue the job after a
    warning-signal drain. ModelChanged when the run's checkpoint changed, unless allowed."""
    coordinator = Coordinator(run_dir, ownership, allow_model_change=allow_model_change, host=node_address(),
                              expected_workers=layout.total_workers, drain_signals=DRAIN_SIGNALS,
                              drain_grace_s=drain_grace_s)
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    try:  # `seerd status JOBID` finds the run through this; a rollout never fails for it
        record_slurm_job(layout.job_id, run_dir.path)
    except OSError as exc:
        log.warning("could not record job %s for `seerd status`: %s", layout.job_id, exc)
    coordinator.record_event("slurm_job", {"job_id": layout.job_id, "restart_count": restarts,
                                           "nodes": list(layout.nodes), "workers": layout.total_workers,
                                           "address": coordinator.host})
    log.warning("coordinator at %s: %s (restart %d)", coordinator.host, layout.describe(), restarts)
    result = run_local(coordinator, layout.total_workers, on_tick=on_tick,
                       pool=SlurmWorkerPool(run_dir, layout, kv_pool=coordinator.config.kv_pool))
    if not coordinator.drained:
        return AllocationResult(result)
    # Said and recorded before the requeue: Slurm signals this job's processes as soon as it is
    # requeued.
    log.warning("requeueing job %s: %s", layout.job_id, result.reason)
    coordinator.record_event("slurm_requeue", {"job_id": layout.job_id})
    error = requeue_job(layout.job_id)
    if error is None:
        return AllocationResult(result, requeued=True)
    log.error("requeueing job %s failed: %s", layout.job_id, error)
    reason = f"{result.reason}; requeueing job {layout.job_id} failed: {error}"
    coordinator.record_event("slurm_requeue_failed", {"job_id": layout.job_id, "error": error})
    coordinator.mark_failed(reason)
    return AllocationResult(CoordinatorResult(RolloutStatus.FAILED, None, reason), requeue_error=error)
