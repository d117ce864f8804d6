"""The scheduler interface: a policy is a pure function from a snapshot to a plan.

The coordinator builds a `Snapshot` when a worker asks for work and applies the returned `Plan`;
the simulator (`seerd sim`) drives the very same policies with a simulated clock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Protocol

from seerd.scheduler.forecast import NO_GROWTH, GrowthRatios

if TYPE_CHECKING:
    from seerd.scheduler.queue import RequestQueue


@dataclass(frozen=True)
class QueuedRequest:
    """A request waiting in the buffer for its next chunk."""

    request_id: int
    group_id: int
    group_index: int
    response_index: int
    prompt_len: int
    generated: int  # tokens committed so far
    max_tokens: int  # the request's original budget
    is_probe: bool
    group_estimate: int  # the paper's L_g: the group's longest finished response (else its start value)
    last_worker: str | None
    queued_at: float
    # What the group's forecast (`forecast.group_forecast`) is made of besides the estimate.
    group_size: int = 1
    group_finished: int = 0  # responses of the group that have finished
    group_longest_unfinished: int = 0  # most tokens so far of any unfinished response of the group

    @property
    def remaining(self) -> int:
        return self.max_tokens - self.generated


@dataclass(frozen=True)
class WorkerLoad:
    worker_id: str
    rank: int
    running_chunks: int
    reserved_kv_tokens: int  # sum over its leases of context + chunk budget
    max_chunks: int
    kv_capacity_tokens: int


@dataclass(frozen=True)
class Snapshot:
    now: float
    worker_id: str  # the worker asking for work; plans assign to it only
    wanted: int  # free sequence slots the worker reports
    workers: tuple[WorkerLoad, ...]  # every live worker, the asking one included
    queued: RequestQueue  # read-only for policies
    group_binding: Mapping[int, str]  # group_id -> worker_id (group policy)
    group_indices: Mapping[int, int]  # group_id -> group_index, for every unfinished group
    chunk_tokens: int
    growth: GrowthRatios = NO_GROWTH  # learned from this rollout's completed groups (seer)

    @cached_property
    def loads_by_id(self) -> dict[str, WorkerLoad]:
        return {load.worker_id: load for load in self.workers}

    def worker(self, worker_id: str) -> WorkerLoad:
        return self.loads_by_id[worker_id]


@dataclass(frozen=True)
class Assignment:
    request_id: int
    worker_id: str
    max_tokens: int  # this chunk's budget


@dataclass(frozen=True)
class Plan:
    assignments: tuple[Assignment, ...] = ()
    new_bindings: Mapping[int, str] = field(default_factory=dict)  # group_id -> worker_id


class Policy(Protocol):
    name: str

    def plan(self, snapshot: Snapshot) -> Plan: ...


def updated_estimate(finished_before: int, estimate: int, length: int) -> int:
    """A group's estimate after one of its responses finishes with `length` tokens.

    The paper's L_g: the longest finished response of the group. The first finish replaces the
    starting value (the group's max_tokens, or a prior from an earlier rollout); later ones can
    only raise it. One rule for the daemon's lease book and the simulator.
    """
    return length if finished_before == 0 else max(estimate, length)


def chunk_budget(request: QueuedRequest, chunk_tokens: int) -> int:
    """The paper's rule: max_tokens = min(chunk_size, original_max_tokens - generated)."""
    return min(chunk_tokens, request.remaining)


def kv_need(request: QueuedRequest, budget: int) -> int:
    """KV tokens a chunk can occupy at its end: the whole context plus its budget."""
    return request.prompt_len + request.generated + budget


def free_slots(snapshot: Snapshot) -> int:
    load = snapshot.worker(snapshot.worker_id)
    return min(snapshot.wanted, load.max_chunks - load.running_chunks)


DEFAULT_BALANCE_SPREAD = 32  # the paper's threshold: in-flight requests between instances
# A lease call looks at most this many requests past those it leaves to other workers: bounded
# work per call (otherwise a worker without room scans the whole queue on every call).
MAX_PASSED_OVER = 256


def balanced_slots(snapshot: Snapshot, spread: int = DEFAULT_BALANCE_SPREAD) -> int:
    """Free slots the asking worker may fill while staying within `spread` chunks in flight of
    the least loaded live worker that can still take a chunk (a free slot and KV room for one).

    The paper routes to the least loaded instance once the spread of in-flight requests passes
    32; workers here pull, so the same rule caps what one asking worker takes. Without it, the
    first worker to ask after start-up took every chunk its KV could hold while the others idled.
    """
    me = snapshot.worker(snapshot.worker_id)
    slots = free_slots(snapshot)
    lighter = [w.running_chunks for w in snapshot.workers
               if w.worker_id != me.worker_id and w.running_chunks < w.max_chunks
               and w.kv_capacity_tokens - w.reserved_kv_tokens >= snapshot.chunk_tokens]
    if lighter:
        slots = min(slots, min(lighter) + spread - me.running_chunks)
    return max(0, slots)


def admit(snapshot: Snapshot, ordered: Iterable[QueuedRequest],
          skip: Callable[[QueuedRequest], bool] = lambda _request: False, *, limit: int | None = None) -> Plan:
    """Give the asking worker requests in `ordered` order while it has free slots and KV room.

    A request's chunk needs KV for its whole context plus its budget, so admitted chunks never
    exceed the worker's KV (no preemption). A request that does not fit here but fits another
    live worker with a free slot is left for that one; one that fits no worker stops admission,
    so smaller ones never overtake a head that waits for room (the paper: "choose an instance
    with room; if none has room, schedule nothing"). `limit` caps the number of chunks.
    """
    load = snapshot.worker(snapshot.worker_id)
    slots = free_slots(snapshot) if limit is None else min(limit, free_slots(snapshot))
    kv_free = load.kv_capacity_tokens - load.reserved_kv_tokens
    room_elsewhere = max((w.kv_capacity_tokens - w.reserved_kv_tokens for w in snapshot.workers
                          if w.worker_id != load.worker_id and w.running_chunks < w.max_chunks), default=-1)
    assignments: list[Assignment] = []
    passed_over = 0
    for request in ordered:
        if len(assignments) >= slots or passed_over > MAX_PASSED_OVER:
            break
        if skip(request):
            passed_over += 1
            continue
        budget = chunk_budget(request, snapshot.chunk_tokens)
        need = kv_need(request, budget)
        if need > kv_free:
            if need <= room_elsewhere:
                passed_over += 1
                continue  # another worker has room for it and takes it when it asks
            break
        kv_free -= need
        assignments.append(Assignment(request.request_id, snapshot.worker_id, budget))
    return Plan(tuple(assignments))
