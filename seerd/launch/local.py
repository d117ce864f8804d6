"""Local mode: the coordinator in this process and N worker processes on this machine.

Workers are supervised: one that exits before the rollout is done is started again (a bounded
number of times); its leases expire meanwhile and run on the others. Each exit is said in words
(`launch.exits`: the signal, what it usually means, the fix) with the last lines of the worker's
log. A worker that ends the same way twice in a row with no output from the run in between
(an engine that cannot start on this machine: SIGILL from kernels the CPU cannot run, a model
that does not fit) stops the run at once with that message instead of spending its restarts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from seerd.coordinator.daemon import Coordinator, CoordinatorResult
from seerd.db import RolloutStatus
from seerd.event_loop import run_event_loop
from seerd.launch.exits import WorkerExit, describe_exit, log_tail
from seerd.parent_death import die_with_parent as _die_with_parent
from seerd.rundir import RunDir
from seerd.settings import KVPoolConfig

log = logging.getLogger("seerd.local")

RESTARTS_PER_WORKER = 3
WORKER_EXIT_GRACE_S = 20.0
# Simulated workers (`--engine-api sim`) one process hosts (seerd/worker/sim_host.py): each is a
# worker of its own on the wire, and they share the process's event loop.
SIM_WORKERS_PER_PROCESS = 128


@dataclass(frozen=True)
class EndedWorker:
    """A worker process that exited before the rollout was done, as the run's events record it."""

    rank: int
    exit: WorkerExit
    log_path: Path
    log_tail: list[str]
    restart: int | None  # which restart of the rank this exit led to; None: not started again

    def event_data(self) -> dict:
        return {"rank": self.rank, **self.exit.as_dict(), "summary": self.exit.summary(),
                "log": str(self.log_path), "log_tail": self.log_tail, "restart": self.restart}

    def log_lines(self) -> str:
        """The log's last lines, indented: to follow a warning or a run's error."""
        lines = "".join(f"\n    {line}" for line in self.log_tail) or " (empty)"
        return f"last lines of {self.log_path}:{lines}"


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # two engines without it ran 17x slower here
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


class WorkerPool:
    """The run's worker processes, supervised. With `simulated`, a process hosts up to
    `SIM_WORKERS_PER_PROCESS` workers (ranks `hosted[i]`); else each process is one worker, and
    process i is rank i."""

    def __init__(self, run_dir: RunDir, count: int, *, kv_pool: KVPoolConfig | None = None,
                 simulated: bool = False, gpus_per_worker: int = 0) -> None:
        self.run_dir = run_dir
        self.simulated = simulated
        self.gpus_per_worker = gpus_per_worker
        per_process = SIM_WORKERS_PER_PROCESS if simulated else 1
        self.hosted = {i: range(first, min(count, first + per_process))
                       for i, first in enumerate(range(0, count, per_process))}
        count = len(self.hosted)
        self.count = count
        self.kv_pool = kv_pool if kv_pool is not None and kv_pool.mode == "mooncake" else None
        self.procs: dict[int, subprocess.Popen] = {}
        self.restarts: dict[int, int] = {rank: 0 for rank in range(count)}
        # rank -> (its last exit, the run's progress when it was started again after it)
        self.last_exit: dict[int, tuple[WorkerExit, int | None]] = {}
        self.ended: list[EndedWorker] = []  # every exit so far (at most RESTARTS_PER_WORKER + 1 a rank)
        self._ended_taken = 0  # how many of them `take_ended` returned
        self.log_starts: dict[int, int] = {}  # rank -> where its current process's output begins in its log
        self.holders: dict[str, subprocess.Popen] = {}  # the KV pool's memory, one per node
        self.exhausted = False

    def start(self, *_address: object) -> None:
        for name in self.holder_commands():  # before the workers: their engines find a pool at once
            self._spawn_holder(name)
        for rank in range(self.count):
            self._spawn(rank)

    def holder_commands(self) -> dict[str, list[str]]:
        """The KV pool's holders (long-lived processes that give the pool its memory), by name."""
        if self.kv_pool is None:
            return {}
        return {"kvpool-holder": self._holder_command()}

    def _holder_command(self, *extra: str) -> list[str]:
        command = [sys.executable, "-m", "seerd.kvpool.holder", "--run-dir", str(self.run_dir.path), *extra]
        if self.kv_pool is not None and self.kv_pool.segment_bytes:
            command += ["--segment-bytes", str(self.kv_pool.segment_bytes)]
        return command

    def _spawn_holder(self, name: str) -> None:
        self.holders[name] = self._popen(self.holder_commands()[name], self.run_dir.logs / f"{name}.log")

    def command(self, rank: int) -> list[str]:
        """How worker process `rank` starts (the Slurm pool wraps it in `srun`)."""
        if self.simulated:
            ranks = self.hosted[rank]
            return [sys.executable, "-m", "seerd.worker.sim_host", "--run-dir", str(self.run_dir.path),
                    "--rank", str(ranks.start), "--count", str(len(ranks))]
        return [sys.executable, "-m", "seerd.worker", "--run-dir", str(self.run_dir.path), "--rank", str(rank)]

    def log_path(self, rank: int) -> Path:
        if self.simulated:
            ranks = self.hosted[rank]
            return self.run_dir.logs / f"sim-workers-{ranks.start}-{ranks.stop - 1}.log"
        return self.run_dir.logs / f"worker-{rank}.log"

    def environment(self) -> dict[str, str]:
        return worker_env()

    def _spawn(self, rank: int) -> None:
        with contextlib.suppress(OSError):  # no log yet: it starts at 0
            self.log_starts[rank] = self.log_path(rank).stat().st_size
        self.procs[rank] = self._popen(self.command(rank), self.log_path(rank), self._devices(rank))

    def _devices(self, rank: int) -> dict[str, str]:
        """Local GPU workers: rank r sees its own GPUs only (of those this process sees)."""
        if not self.gpus_per_worker:
            return {}
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(self.count * self.gpus_per_worker)]
        mine = devices[rank * self.gpus_per_worker:(rank + 1) * self.gpus_per_worker]
        if len(mine) < self.gpus_per_worker:
            raise ValueError(f"worker {rank} needs GPUs {rank * self.gpus_per_worker}-"
                             f"{(rank + 1) * self.gpus_per_worker - 1}; this node shows {len(devices)}")
        return {"CUDA_VISIBLE_DEVICES": ",".join(mine)}

    def _popen(self, command: list[str], log_path: Path, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
        with open(log_path, "ab") as log_file:
            os.chmod(log_path, 0o600)
            return subprocess.Popen(
                command,
                stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**self.environment(), **(extra_env or {})},
                preexec_fn=_die_with_parent,  # never outlive the coordinator (kill -9 included)
                # Its own process group: vLLM's engine-core processes outlive a killed frontend
                # (they are re-parented, never exit), so we reap the whole group.
                start_new_session=True,
            )

    def supervise(self, rollout_complete: bool, progress: int | None = None) -> str | None:
        """Restart workers that died; return a reason to stop when none can run any more, or when a
        worker failed the same way twice with no `progress` (the run's output tokens) in between."""
        if rollout_complete:
            self._note_late_exits()
            return None
        for name, holder in list(self.holders.items()):
            if holder.poll() is not None:  # the pool lost this node's memory: workers recompute meanwhile
                log.warning("KV pool holder %s exited with %s; starting it again", name, holder.returncode)
                _kill_group(holder)
                self._spawn_holder(name)
        for rank, proc in list(self.procs.items()):
            code = proc.poll()
            if code is None:
                continue
            _kill_group(proc)
            stop = self._worker_ended(rank, describe_exit(code), progress)
            if stop:
                self.exhausted = True
                return stop
        if not self.procs:
            self.exhausted = True
            last = "; ".join(f"worker {e.rank}: {e.exit.summary()}" for e in self._last_of_each_rank())
            return (f"every worker exited {RESTARTS_PER_WORKER + 1} times ({last}); see "
                    f"{self.log_path(0).parent}/{'sim-workers' if self.simulated else 'worker'}-*.log")
        return None

    def _worker_ended(self, rank: int, exit_: WorkerExit, progress: int | None) -> str | None:
        """Start worker `rank` again after `exit_`, or give it up; a reason to stop the run, or None."""
        previous = self.last_exit.get(rank)
        crash_loop = exit_.code != 0 and previous is not None and previous == (exit_, progress)
        restart = None if crash_loop or self.restarts[rank] >= RESTARTS_PER_WORKER else self.restarts[rank] + 1
        ended = EndedWorker(rank, exit_, self.log_path(rank),
                            log_tail(self.log_path(rank), since=self.log_starts.get(rank, 0)), restart)
        self.ended.append(ended)
        if crash_loop:
            del self.procs[rank]
            return (f"worker {rank} failed the same way again after a restart, with no output from the run in "
                    f"between, so it is not started again: {exit_.summary()}; {ended.log_lines()}")
        if restart is None:
            del self.procs[rank]
            log.warning("worker %d %s; not started again (it exited %d times); %s", rank, exit_.summary(),
                        RESTARTS_PER_WORKER + 1, ended.log_lines())
            return None
        self.restarts[rank] = restart
        self.last_exit[rank] = (exit_, progress)
        log.warning("worker %d %s; starting it again (%d/%d); %s", rank, exit_.summary(), restart,
                    RESTARTS_PER_WORKER, ended.log_lines())
        self._spawn(rank)
        return None

    def _note_late_exits(self) -> None:
        """Workers that failed as the rollout completed: said and recorded, not started again."""
        for rank, proc in list(self.procs.items()):
            code = proc.poll()
            if not code:  # running, or done: heard the rollout is complete
                continue
            _kill_group(proc)
            del self.procs[rank]
            ended = EndedWorker(rank, describe_exit(code), self.log_path(rank),
                                log_tail(self.log_path(rank), since=self.log_starts.get(rank, 0)), None)
            self.ended.append(ended)
            log.warning("worker %d %s; not started again: the rollout is complete; %s", rank, ended.exit.summary(),
                        ended.log_lines())

    def _last_of_each_rank(self) -> list[EndedWorker]:
        last = {e.rank: e for e in self.ended}
        return [last[rank] for rank in sorted(last)]

    def take_ended(self) -> list[EndedWorker]:
        """The exits seen since the last call (for the run's events)."""
        taken = self.ended[self._ended_taken:]
        self._ended_taken = len(self.ended)
        return taken

    def stop(self, *, complete: bool, grace_s: float = WORKER_EXIT_GRACE_S) -> None:
        """Let workers that heard "done" exit, ask the others to stop, then reap every group."""
        deadline = time.monotonic() + (grace_s if complete else 0.0)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):  # still running: terminated below
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            if proc.poll() is None:
                proc.terminate()  # the worker shuts its engine down on SIGTERM
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            _kill_group(proc)
        for holder in self.holders.values():  # after the workers: their last saves may still land
            holder.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                holder.wait(timeout=10)
            _kill_group(holder)


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is already gone
        os.killpg(proc.pid, signal.SIGKILL)


def run_local(coordinator: Coordinator, workers: int, on_tick: Callable[[dict], None] | None = None,
              pool: WorkerPool | None = None) -> CoordinatorResult:
    """`coordinator` in this process, its workers supervised by `pool` (local processes by
    default; the Slurm launcher passes a pool of job steps)."""
    pool = pool or WorkerPool(coordinator.run_dir, workers, kv_pool=coordinator.config.kv_pool,
                              simulated=coordinator.config.engine.api == "sim",
                              gpus_per_worker=coordinator.config.engine.gpus_per_worker)

    def tick(counts: dict) -> None:
        reason = pool.supervise(counts["requests_done"] == counts["requests_total"], counts["output_tokens"])
        for ended in pool.take_ended():
            coordinator.note_event("worker_exited", ended.event_data())
        if reason:
            coordinator.request_stop(reason)
        if on_tick:
            on_tick(counts)

    try:
        result = run_event_loop(coordinator.serve(on_tick=tick, on_ready=pool.start))
    except BaseException:
        pool.stop(complete=False)
        raise
    pool.stop(complete=result.status == RolloutStatus.FINISHED)
    if pool.exhausted:
        coordinator.mark_failed(result.reason or "workers exited")
        return CoordinatorResult(RolloutStatus.FAILED, None, result.reason)
    return result

