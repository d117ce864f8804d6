"""What a policy sees and what it returns: the data of `Policy.plan(snapshot) -> Plan`.

Frozen values only. `SchedulerState.snapshot()` builds a `Snapshot` whose queue is a read-only
view that refuses to be read once the state has changed (`StaleSnapshot`), so a policy can
neither change the state it plans over nor plan over a state that is gone.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

from seerd.scheduler.forecast import NO_GROWTH, GrowthRatios


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
    failed_on: frozenset[str] = frozenset()  # workers whose engine failed one of its chunks

    @property
    def remaining(self) -> int:
        return self.max_tokens - self.generated


class QueueReader(Protocol):
    """The request buffer as a policy may read it (`queue.RequestQueue` and its read-only view)."""

    def fcfs(self, after: tuple[float, int] | None = None) -> Iterator[QueuedRequest]: ...

    def ordered(self, name: str, key: Callable[[QueuedRequest], Any], version: Any = None
                ) -> Iterator[QueuedRequest]: ...

    def get(self, request_id: int) -> QueuedRequest: ...

    def __iter__(self) -> Iterator[QueuedRequest]: ...

    def __len__(self) -> int: ...

    def __contains__(self, request_id: object) -> bool: ...

    def shortest_context(self) -> int | None: ...

    def oldest_queued_at(self) -> float | None: ...


@dataclass(frozen=True)
class WorkerLoad:
    worker_id: str
    rank: int
    running_chunks: int
    reserved_kv_tokens: int  # sum over its leases of context + chunk budget, in whole blocks
    max_chunks: int
    kv_capacity_tokens: int
    kv_block_tokens: int = 1  # the engine allocates KV in blocks of this many tokens


def can_take_a_chunk(load: WorkerLoad, chunk_tokens: int) -> bool:
    """A free slot and KV room for a chunk: what `base.balanced_slots` compares the asker with."""
    return load.running_chunks < load.max_chunks and load.kv_capacity_tokens - load.reserved_kv_tokens >= chunk_tokens


@dataclass
class OpenWorkers:
    """The live workers that can take a chunk (`can_take_a_chunk`): how many run each number of
    chunks, and their free slots in all; and the KV room of every live worker with a free slot.
    `SchedulerState` keeps one up to date as loads change, so that a lease call does not scan
    every worker (`base.balanced_slots`, `base.most_room_elsewhere`)."""

    running: dict[int, int] = field(default_factory=dict)  # chunks running -> workers running that many
    free_slots: int = 0
    room: dict[str, int] = field(default_factory=dict)  # worker with a free slot -> its free KV tokens
    # `room` as a max-heap of (-room, worker id), stale entries dropped when they reach the top.
    _by_room: list[tuple[int, str]] = field(default_factory=list, compare=False, repr=False)

    @classmethod
    def of(cls, loads: Iterable[WorkerLoad], chunk_tokens: int) -> OpenWorkers:
        summary = cls()
        for load in loads:
            summary.add(load, chunk_tokens)
        return summary

    def add(self, load: WorkerLoad, chunk_tokens: int, sign: int = 1) -> None:
        if can_take_a_chunk(load, chunk_tokens):
            count = self.running.get(load.running_chunks, 0) + sign
            if count:
                self.running[load.running_chunks] = count
            else:
                del self.running[load.running_chunks]
            self.free_slots += sign * (load.max_chunks - load.running_chunks)
        if load.running_chunks < load.max_chunks:
            if sign < 0:
                self.room.pop(load.worker_id, None)
            else:
                room = self.room[load.worker_id] = load.kv_capacity_tokens - load.reserved_kv_tokens
                heapq.heappush(self._by_room, (-room, load.worker_id))
                if len(self._by_room) > 2 * len(self.room) + 1024:  # mostly stale: start it over
                    self._by_room = [(-r, w) for w, r in self.room.items()]
                    heapq.heapify(self._by_room)

    def remove(self, load: WorkerLoad, chunk_tokens: int) -> None:
        self.add(load, chunk_tokens, sign=-1)

    def others(self, load: WorkerLoad, chunk_tokens: int) -> tuple[int, int | None]:
        """(free slots, fewest chunks running) of the open workers but `load`'s (None: no other)."""
        mine = can_take_a_chunk(load, chunk_tokens)
        free = self.free_slots - (load.max_chunks - load.running_chunks if mine else 0)
        fewest = min((running for running, count in self.running.items()
                      if count > (1 if mine and running == load.running_chunks else 0)), default=None)
        return free, fewest

    def most_room_but(self, worker_id: str) -> int:
        """The most free KV tokens of a live worker with a free slot other than `worker_id`; -1 if none."""
        heap, room = self._by_room, self.room
        held = None  # `worker_id`'s own entry, put back after
        most = -1
        while heap:
            negative, top = heap[0]
            if room.get(top) != -negative:
                heapq.heappop(heap)  # stale: that worker's room changed or its slots filled
            elif top == worker_id:
                held = heapq.heappop(heap)
            else:
                most = -negative
                break
        if held is not None:
            heapq.heappush(heap, held)
        return most


@dataclass(frozen=True)
class Snapshot:
    now: float
    worker_id: str  # the worker asking for work; plans assign to it only
    wanted: int  # free sequence slots the worker reports
    workers: tuple[WorkerLoad, ...]  # every live worker, the asking one included
    queued: QueueReader
    group_binding: Mapping[int, str]  # group_id -> worker_id (policies that bind groups)
    group_indices: Mapping[int, int]  # group_id -> group_index, for every unfinished group
    chunk_tokens: int
    growth: GrowthRatios = NO_GROWTH  # learned from this rollout's completed groups (seer)
    # Queued requests whose engine request still runs on the asking worker past the chunk it just
    # reported (in-place continuation): continuing one costs nothing, stopping it costs a prefill
    # of its whole context when it runs again. Policies keep them before other queued requests
    # of their class (`base.continuing_first`), so a boundary is not a rotation.
    continuing: frozenset[int] = frozenset()
    # Given by `SchedulerState` (kept as loads change); worked out from `workers` when not.
    loads_index: Mapping[str, WorkerLoad] | None = None
    open_summary: OpenWorkers | None = None

    @cached_property
    def loads_by_id(self) -> Mapping[str, WorkerLoad]:
        if self.loads_index is not None:
            return self.loads_index
        return {load.worker_id: load for load in self.workers}

    @cached_property
    def open_workers(self) -> OpenWorkers:
        if self.open_summary is not None:
            return self.open_summary
        return OpenWorkers.of(self.workers, self.chunk_tokens)

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
    """Also, optionally, `prepare(snapshot)`: build what its first plan would (an index of the
    queue) before any worker asks; the lease book calls it once its state is loaded."""

    name: str

    def plan(self, snapshot: Snapshot) -> Plan: ...


def response_ended(total: int, max_tokens: int, *, stopped: bool) -> bool:
    """Whether a response is complete after a chunk brought it to `total` tokens: it `stopped`
    (EOS or a stop token, its target length, a chunk cut short by the model's context), or it
    reached its `max_tokens`. The lease book judges a worker's report by it, the simulator a
    modelled chunk."""
    return stopped or total >= max_tokens
