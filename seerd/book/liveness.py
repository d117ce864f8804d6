"""Whether a worker is working: judged by its engine's progress, not by its heartbeats alone.

A heartbeat says the worker's event loop runs; it does not say its engine does. An engine core
stopped (SIGSTOP) or deadlocked under a live loop used to renew its leases forever. So a
heartbeat carries the engine's step counter (`protocol.EngineProgress`), and a worker's leases
are renewed only by a heartbeat whose counter moved (or while it holds no chunk: an idle engine
does not step). A worker that holds chunks and whose engine has not stepped for the stall bound,
`max(lease TTL, STALL_STEPS x the longest recent step it reported)`, is stuck: the coordinator
takes it out (its leases run elsewhere) and tells it so at its next call, and it exits to be
restarted by whatever supervises it.

The second rule takes out an engine that fails what others run: a worker whose engine failed
`RETIRE_AFTER_REFUTED` chunks since its own last good one, each of which another engine then
ran, is taken out the same way. A poison request (one every engine refuses) never counts: no
other engine runs it, so it ends failed by its own bound (`book.MAX_FAILED_ATTEMPTS`) and costs
no worker a restart.

Pure bookkeeping: the lease book owns these objects and writes every status change.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from seerd.db import WorkerStatus
from seerd.protocol import EngineProgress

# A chunk may wait this many of its engine's longest recent steps (a long prefill, a big batch)
# before it counts as stalled; never less than the lease TTL.
STALL_STEPS = 4
STALL_BOUND_MAX_S = 3600.0  # whatever a worker reports, a stalled engine is found within an hour
# Chunks a worker's engine failed that another engine then ran, with no good chunk of its own
# in between, before the worker is taken out.
RETIRE_AFTER_REFUTED = 3


def stall_bound(lease_ttl_s: float, longest_step_s: float) -> float:
    """How long a chunk may go without its engine stepping before it runs elsewhere."""
    return max(lease_ttl_s, min(STALL_BOUND_MAX_S, STALL_STEPS * longest_step_s))


@dataclass
class WorkerLiveness:
    id: str
    status: WorkerStatus
    last_heartbeat: float
    last_progress_at: float  # the last heartbeat that showed the engine stepping (or idle)
    engine_steps: int | None = None  # None: its engine does not report steps; heartbeats renew
    longest_step_s: float = 0.0
    busy: bool = False  # at its last heartbeat it held chunks its engine was generating
    retired: str | None = None  # why the coordinator took it out; said to it at its next call
    failed_since_good: set[int] = field(default_factory=set)  # requests its engine failed since its last good chunk
    refuted: int = 0  # of those, the ones another engine then ran

    def stall_bound(self, lease_ttl_s: float) -> float:
        return stall_bound(lease_ttl_s, self.longest_step_s)

    def observe(self, engine: EngineProgress | None, holds_chunks: bool, now: float) -> bool:
        """Record a heartbeat; True when it shows progress (the worker's leases are renewed then).
        An engine with nothing to generate (idle, or its chunks done and their reports on the way)
        does not step, and is not stuck."""
        self.last_heartbeat = now
        if engine is None:
            progressed, self.busy = True, False
        else:
            self.busy = holds_chunks and engine.generating > 0
            progressed = not self.busy or self.engine_steps is None or engine.steps != self.engine_steps
            self.engine_steps = engine.steps
            self.longest_step_s = max(0.0, float(engine.longest_step_s))
        if progressed:
            self.last_progress_at = now
        return progressed

    def stuck(self, holds_chunks: bool, now: float, lease_ttl_s: float) -> str | None:
        """Why the worker counts as stuck now, or None."""
        if not (holds_chunks and self.busy) or self.engine_steps is None or self.status != WorkerStatus.ALIVE:
            return None
        silent = now - self.last_progress_at
        bound = self.stall_bound(lease_ttl_s)
        if silent <= bound:
            return None
        return (f"its engine made no progress for {silent:.0f}s while holding chunks (bound {bound:.0f}s: "
                f"the lease TTL, or {STALL_STEPS}x its longest recent step of {self.longest_step_s:.1f}s)")


def chunk_failed(worker: WorkerLiveness, request_id: int) -> None:
    worker.failed_since_good.add(request_id)


def chunk_done(workers: dict[str, WorkerLiveness], worker_id: str, request_id: int,
               failed_on: set[str]) -> list[WorkerLiveness]:
    """A chunk of `request_id` ran on `worker_id`: that worker's streak of failures ends, and each
    other worker whose engine failed this request in its streak (`failed_on`: the workers that
    ever failed it, from the scheduler's state) is refuted once. Returns the workers to take out."""
    doer = workers.get(worker_id)
    if doer is not None:
        doer.failed_since_good.clear()
        doer.refuted = 0
    refuted = []
    for other in failed_on:
        worker = workers.get(other)
        if worker is None or other == worker_id or request_id not in worker.failed_since_good:
            continue
        worker.failed_since_good.discard(request_id)
        worker.refuted += 1
        if worker.refuted >= RETIRE_AFTER_REFUTED and worker.status != WorkerStatus.GONE:
            refuted.append(worker)
    return refuted


def refuted_reason(worker: WorkerLiveness) -> str:
    return (f"its engine failed {worker.refuted} chunks in a row that other workers' engines then ran "
            f"(a broken engine, not poison requests)")
