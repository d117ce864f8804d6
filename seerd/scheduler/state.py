"""The scheduler's state: what a policy plans over, kept once for the daemon and the simulator.

vLLM v1's scheduler contract in two halves:
- `snapshot(worker, wanted, now)`: what `plan()` sees, read-only (views.py);
- the updates: `apply_leases` (a plan was carried out), `prepare_results` then `apply_results`
  (chunks finished), `return_leases` (leases expired, released or orphaned: back to the queue).

The lease book wraps it with persistence and liveness: it checks a plan, prepares the update,
writes both to SQLite and applies them here only after the commit. The simulator wraps it with
modelled engines and applies at once. Nothing here knows of SQL, HTTP or a clock (`now` is passed
in), so one recorded stream of events gives the same state on both sides
(tests/unit/test_one_scheduler_state.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import NamedTuple

from seerd.scheduler.base import kv_need, updated_estimate
from seerd.scheduler.forecast import GrowthTable, group_forecast, replay_growth
from seerd.scheduler.queue import QueueView, RequestQueue, Submit
from seerd.scheduler.records import (
    ChunkResult, GroupOutcome, GroupRecord, LeaseRecord, PlanError, RequestOutcome, RequestRecord, ResultsUpdate,
    WorkerRecord,
)
from seerd.scheduler.views import OpenWorkers, Plan, QueuedRequest, Snapshot, WorkerLoad


NOWHERE: frozenset[str] = frozenset()
UNKNOWN_ROOM = 1 << 62  # `room_for` a worker the state does not know yet


class _ForecastInputs(NamedTuple):
    group_size: int
    group_finished: int
    group_estimate: int
    group_longest_unfinished: int
    max_tokens: int


FIRST_CHUNK_SPREAD = 0.5  # the first lease's chunks are up to this fraction shorter, by rank
_GOLDEN = (5 ** 0.5 - 1) / 2


def first_chunk_tokens(chunk_tokens: int, rank: int, spread: float = FIRST_CHUNK_SPREAD) -> int:
    """The chunk size of a worker's first lease: shorter by a fraction of up to `spread`, spread
    evenly over ranks (rank x the golden ratio, mod 1: any number of ranks covers the range).
    Engines started together otherwise reach their first chunk boundaries together: at 512
    workers every one of them reported its whole first fill within ~2 s, 16,000 reports in group
    commits of 150-190 ms back to back, and every call of those seconds waited behind them
    (tools/bench/load.py, docs/journal/2026-11-29.md). Shortened by rank, the first boundaries spread over half
    a chunk's time, and each worker's later ones keep the offset. Rank 0's is never shortened."""
    return max(1, chunk_tokens - int(chunk_tokens * spread * ((rank * _GOLDEN) % 1.0)))


def _load_of(worker: WorkerRecord) -> WorkerLoad:
    return WorkerLoad(worker.id, worker.rank, len(worker.chunks), worker.kv_reserved, worker.max_chunks,
                      worker.kv_capacity_tokens, worker.kv_block_tokens)


class SchedulerState:
    def __init__(self, *, chunk_tokens: int, growth: GrowthTable | None = None,
                 first_chunk_spread: float = FIRST_CHUNK_SPREAD, rekey_aside: Submit | None = None) -> None:
        """`rekey_aside`: where the queue's orders are re-keyed for a new growth table while the
        previous order serves (`RequestQueue`); None: in place (the simulator)."""
        if not 0.0 <= first_chunk_spread < 1.0:
            raise ValueError(f"first_chunk_spread must be in [0, 1), got {first_chunk_spread}")
        self.chunk_tokens = chunk_tokens
        self.first_chunk_spread = first_chunk_spread
        self.groups: dict[int, GroupRecord] = {}
        self.requests: dict[int, RequestRecord] = {}
        self.workers: dict[str, WorkerRecord] = {}
        self.live_count = 0  # workers offered to policies (read by the API, without the state thread)
        self.leases: dict[int, LeaseRecord] = {}
        self.queue = RequestQueue(rekey_aside)
        self.growth = growth if growth is not None else GrowthTable()  # seer's forecast ratios
        self.unfinished_groups: dict[int, int] = {}  # group id -> group index
        self.bindings: dict[int, str] = {}  # group id -> worker id (policies that bind whole groups)
        self.finished_requests = 0
        self.failed_requests = 0
        self.output_tokens = 0  # committed
        self._version = 0  # every change bumps it: a snapshot is good for one version
        # The live workers' loads as snapshots hold them: one entry rebuilt per worker whose load
        # changed (rebuilding all of them on every lease was a quarter of a lease at 512 workers).
        self._loads: tuple[WorkerLoad, ...] | None = None
        self._load_list: list[WorkerLoad] | None = None  # None: which workers are live changed
        self._load_slots: dict[str, int] = {}  # worker id -> its place in `_load_list`
        self._stale_loads: set[str] = set()
        self._loads_by_id: dict[str, WorkerLoad] = {}  # the same loads by worker, and their summary
        self._loads_view: Mapping[str, WorkerLoad] = MappingProxyType(self._loads_by_id)
        self._open = OpenWorkers()
        self._bindings_view = MappingProxyType(self.bindings)
        self._groups_view = MappingProxyType(self.unfinished_groups)
        self._forecast_dirty: set[int] = set()
        self._forecast_growth_version = 0
        self._forecasts_taken: dict[int, int] = {}

    # ------------------------------------------------------------- building
    def load(self, groups: Iterable[GroupRecord], requests: Iterable[RequestRecord],
             finish_order: Sequence[int] = (), bindings: dict[int, str] | None = None) -> None:
        """The state at the start of a run or a restarted coordinator's: every unfinished request
        queued; finished lengths and the growth table replayed from `finish_order`, the finished
        requests' ids in the order they finished."""
        if self.groups:
            raise RuntimeError("the scheduler state is loaded once")
        for group in groups:
            self.groups[group.id] = group
            group.request_ids.clear()
            group.finished_lengths.clear()
        for request in requests:
            self.requests[request.id] = request
            self.groups[request.group_id].request_ids.append(request.id)
            self.output_tokens += request.generated
            self.finished_requests += request.finished
            self.failed_requests += request.failed
            self.groups[request.group_id].failed += request.failed
        self.growth, lengths = replay_growth(
            ((self.requests[rid].group_id, self.requests[rid].generated) for rid in finish_order),
            {gid: group.n for gid, group in self.groups.items()}, self.growth)
        for group in self.groups.values():
            group.finished_lengths.extend(lengths.get(group.id, ()))
            if group.finished != len(group.finished_lengths):
                raise ValueError(f"group {group.id}: {group.finished} finished responses, "
                                 f"{len(group.finished_lengths)} in the finish order")
            if group.finished + group.failed < group.n:
                self.unfinished_groups[group.id] = group.index
        self.bindings.update(bindings or {})
        for request in self.requests.values():
            if not request.ended:
                self.queue.put(self._view(request))
        self._forecast_dirty.update(self.groups)  # the first `take_forecasts` gives every group's
        self._changed()

    # ------------------------------------------------------------- workers
    def add_worker(self, worker_id: str, *, rank: int, max_chunks: int, kv_capacity_tokens: int,
                   kv_block_tokens: int = 1) -> WorkerRecord:
        if worker_id in self.workers:
            raise ValueError(f"worker {worker_id} is already known")
        worker = self.workers[worker_id] = WorkerRecord(worker_id, rank, max_chunks, kv_capacity_tokens,
                                                        max(1, kv_block_tokens))
        self.live_count += 1
        if self._load_list is None:
            self._changed()
        else:  # joined last: its load appended, not every live worker's rebuilt (1 ms at 512, per
            # lease while workers join; a fill interleaves 512 registrations with their leases)
            self._load_slots[worker_id] = len(self._load_list)
            self._load_list.append(_load_of(worker))
            self._loads_by_id[worker_id] = self._load_list[-1]
            self._open.add(self._load_list[-1], self.chunk_tokens)
            self._changed(workers=[worker_id])
        return worker

    def set_live(self, worker_id: str, live: bool) -> None:
        """A worker that misses heartbeats is no longer offered to policies (its leases stay)."""
        worker = self.workers[worker_id]
        if worker.live != live:
            worker.live = live
            self.live_count += 1 if live else -1
            self._changed()

    def context_of(self, request_id: int) -> int:
        """A request's context: its prompt and the tokens it has generated."""
        request = self.requests[request_id]
        return self.groups[request.group_id].prompt_len + request.generated

    def could_take(self, worker_id: str, context_tokens: int) -> bool:
        """Whether a worker has a free slot and KV room for a chunk of one token past a context of
        `context_tokens`, in its whole blocks: without both, no policy's admission
        (`base.admit`) gives it a request of that context, so waking its lease call for one would
        make a plan in vain. Unknown workers: True (their call finds out)."""
        return self.room_for(worker_id, context_tokens) is not None

    def room_for(self, worker_id: str, context_tokens: int) -> int | None:
        """A worker's free KV tokens if it `could_take` a request of `context_tokens`, else None.
        Unknown workers: the most room there is (their call finds out)."""
        worker = self.workers.get(worker_id)
        if worker is None:
            return UNKNOWN_ROOM
        block = worker.kv_block_tokens
        room = worker.kv_capacity_tokens - worker.kv_reserved
        if len(worker.chunks) < worker.max_chunks and -(-(context_tokens + 1) // block) * block <= room:
            return room
        return None

    # ------------------------------------------------------------- the policy's side
    def snapshot(self, worker_id: str, wanted: int, now: float, continuing: frozenset[int] = frozenset()) -> Snapshot:
        # The loads' index and summary are the state's own, current as the queue view is: a
        # snapshot is good for one version.
        worker = self.workers.get(worker_id)
        chunk_tokens = self.chunk_tokens  # a worker's first lease: shorter, by rank (`first_chunk_tokens`)
        if worker is not None and not worker.has_leased:
            chunk_tokens = first_chunk_tokens(chunk_tokens, worker.rank, self.first_chunk_spread)
        return Snapshot(now, worker_id, wanted, self.worker_loads(), QueueView(self.queue, self.version),
                        self._bindings_view, self._groups_view, chunk_tokens, self.growth.current,
                        continuing, loads_index=self._loads_view, open_summary=self._open)

    def worker_loads(self) -> tuple[WorkerLoad, ...]:
        """Every live worker's load, in the order they joined."""
        if self._loads is None:  # rebuilt only after a change, and only where it changed
            if self._load_list is None:
                live = [w for w in self.workers.values() if w.live]
                self._load_list = [_load_of(w) for w in live]
                self._load_slots = {w.id: slot for slot, w in enumerate(live)}
                self._loads_by_id = {load.worker_id: load for load in self._load_list}
                self._loads_view = MappingProxyType(self._loads_by_id)
                self._open = OpenWorkers.of(self._load_list, self.chunk_tokens)
            else:
                for worker_id in self._stale_loads:
                    slot = self._load_slots.get(worker_id)
                    if slot is not None:
                        load = _load_of(self.workers[worker_id])
                        self._open.remove(self._load_list[slot], self.chunk_tokens)
                        self._open.add(load, self.chunk_tokens)
                        self._load_list[slot] = self._loads_by_id[worker_id] = load
            self._stale_loads.clear()
            self._loads = tuple(self._load_list)
        return self._loads

    def version(self) -> int:
        return self._version

    def check_plan(self, plan: Plan, worker_id: str) -> None:
        """Raise `PlanError` unless every assignment is to the asking worker, of a queued request,
        with a budget of at least one token and at most what the request has left."""
        seen = set()
        for a in plan.assignments:
            if a.worker_id != worker_id:
                raise PlanError(f"a plan for worker {worker_id} assigned request {a.request_id} to {a.worker_id}")
            if a.request_id not in self.queue or a.request_id in seen:
                raise PlanError(f"a plan assigned request {a.request_id}, which is not queued (or twice)")
            request = self.requests[a.request_id]
            if not 1 <= a.max_tokens <= request.max_tokens - request.generated:
                raise PlanError(f"a plan gave request {a.request_id} an impossible budget {a.max_tokens}")
            seen.add(a.request_id)

    # ------------------------------------------------------------- updates
    def apply_leases(self, worker_id: str, plan: Plan, chunk_ids: Sequence[int]) -> list[LeaseRecord]:
        """A checked plan was carried out: assignment i runs as chunk `chunk_ids[i]`."""
        if len(chunk_ids) != len(plan.assignments):
            raise ValueError(f"{len(plan.assignments)} assignments but {len(chunk_ids)} chunk ids")
        if not plan.assignments and not plan.new_bindings:
            return []  # nothing changed: snapshots (and the loads they hold) stay good
        self.bindings.update(plan.new_bindings)
        worker = self.workers[worker_id]
        leases = []
        for assignment, chunk_id in zip(plan.assignments, chunk_ids):
            view = self.queue.remove(assignment.request_id)
            request = self.requests[assignment.request_id]
            lease = LeaseRecord(chunk_id, request.id, worker_id, assignment.max_tokens,
                                kv_need(view, assignment.max_tokens, worker.kv_block_tokens), request.last_worker)
            request.last_worker = worker_id
            self.leases[chunk_id] = lease
            worker.chunks.add(chunk_id)
            worker.kv_reserved += lease.kv_reserved
            leases.append(lease)
        worker.has_leased = worker.has_leased or bool(leases)
        self._changed(workers=(worker_id,) if leases else ())
        return leases

    def prepare_results(self, results: Sequence[ChunkResult], now: float) -> ResultsUpdate:
        """What `results` will change, without changing anything (the book persists it first)."""
        requests, groups = [], {}
        seen = set()
        for result in results:
            lease = self.leases.get(result.chunk_id)
            if lease is None or result.chunk_id in seen:
                raise KeyError(f"chunk {result.chunk_id} is not leased (or reported twice)")
            if not 0 <= result.tokens <= lease.max_tokens:
                raise ValueError(f"chunk {result.chunk_id}: {result.tokens} tokens, budget {lease.max_tokens}")
            seen.add(result.chunk_id)
            request = self.requests[lease.request_id]
            generated = request.generated + result.tokens
            if result.finished:
                group = self.groups[request.group_id]
                finished, estimate = groups.get(group.id, (group.finished, group.estimate))
                estimate = updated_estimate(finished, estimate, generated)
                groups[group.id] = (finished + 1, estimate)
                requests.append(RequestOutcome(request.id, generated, True, estimate))
            else:
                requests.append(RequestOutcome(request.id, generated, False))
        return ResultsUpdate(now, tuple(results), tuple(requests), tuple(
            GroupOutcome(gid, finished, estimate, finished + self.groups[gid].failed >= self.groups[gid].n)
            for gid, (finished, estimate) in groups.items()))

    def apply_results(self, update: ResultsUpdate) -> None:
        """Apply a prepared update: leases end, tokens count, finished requests update their
        group's estimate (a completed group teaches the growth table), the rest wait again."""
        touched: dict[int, None] = {}  # groups whose queued views change, in order
        reporters = set()
        for result, outcome in zip(update.results, update.requests):
            lease = self.leases.pop(result.chunk_id)
            reporters.add(lease.worker_id)
            worker = self.workers[lease.worker_id]
            worker.chunks.discard(result.chunk_id)
            worker.kv_reserved -= lease.kv_reserved
            request = self.requests[lease.request_id]
            request.generated = outcome.generated
            self.output_tokens += result.tokens
            touched[request.group_id] = None
            if outcome.finished:
                request.finished = True
                self.finished_requests += 1
                group = self.groups[request.group_id]
                group.estimate = updated_estimate(group.finished, group.estimate, request.generated)
                group.finished += 1
                group.finished_lengths.append(request.generated)
                self._end_if_done(group)
            else:
                request.queued_at = update.now
        for gid in touched:  # queued views carry their group's progress: refresh those that changed
            self._refresh_views(self.groups[gid])
        for result, outcome in zip(update.results, update.requests):
            request = self.requests[outcome.request_id]
            if not outcome.finished:
                self.queue.put(self._view(request))
        self._forecast_dirty.update(touched)
        self._changed(workers=reporters)

    def update_from_results(self, results: Sequence[ChunkResult], now: float) -> ResultsUpdate:
        """Prepare and apply at once (the simulator: nothing to persist in between)."""
        update = self.prepare_results(results, now)
        self.apply_results(update)
        return update

    def fail_chunk(self, chunk_id: int, *, request_failed: bool) -> LeaseRecord:
        """The engine failed a leased chunk. Its request waits again, to be given to a worker that
        has not failed it where there is one (`base.admit`), or, with `request_failed`, ends failed."""
        lease = self.leases.pop(chunk_id)
        worker = self.workers[lease.worker_id]
        worker.chunks.discard(chunk_id)
        worker.kv_reserved -= lease.kv_reserved
        request = self.requests[lease.request_id]
        request.failed_on.add(lease.worker_id)
        if request_failed:
            request.failed = True
            self.failed_requests += 1
            group = self.groups[request.group_id]
            group.failed += 1
            self._end_if_done(group)
            self._refresh_views(group)  # its longest unfinished response may have been this one
            self._forecast_dirty.add(group.id)
        else:
            self.queue.put(self._view(request))
        self._changed(workers=(lease.worker_id,))
        return lease

    def return_leases(self, chunk_ids: Iterable[int]) -> list[LeaseRecord]:
        """Leases that ended without a result (expired, released, orphaned): their requests wait
        again, keeping their place (queued_at is when they first waited for this chunk)."""
        returned = []
        for chunk_id in chunk_ids:
            lease = self.leases.pop(chunk_id)
            worker = self.workers[lease.worker_id]
            worker.chunks.discard(chunk_id)
            worker.kv_reserved -= lease.kv_reserved
            self.queue.put(self._view(self.requests[lease.request_id]))
            returned.append(lease)
        if returned:
            self._changed(workers={lease.worker_id for lease in returned})
        return returned

    # ------------------------------------------------------------- reads
    def is_queued(self, request_id: int) -> bool:
        return request_id in self.queue

    def is_complete(self) -> bool:
        """Every request ended: finished, or failed."""
        return self.finished_requests + self.failed_requests == len(self.requests)

    def forecast(self, group_id: int) -> int:
        """The expected length of the group's longest response, as seer's order uses it."""
        group = self.groups[group_id]
        return group_forecast(_ForecastInputs(group.n, group.finished, group.estimate,
                                              self._longest_unfinished(group), group.max_tokens),
                              self.growth.current)

    def take_forecasts(self, limit: int | None = None) -> dict[int, int]:
        """The groups whose forecast changed since the last call, with the new value (for the book
        to persist, so that `seerd status` reads the coordinator's own figure). With `limit`, at
        most that many groups are looked at; the rest wait for the next call (a new growth table
        or a resumed run makes every group's forecast due at once)."""
        if self.growth.current.version != self._forecast_growth_version:
            self._forecast_growth_version = self.growth.current.version
            self._forecast_dirty.update(self.unfinished_groups)
        changed = {}
        dirty = self._forecast_dirty
        for _ in range(len(dirty) if limit is None else min(limit, len(dirty))):
            gid = dirty.pop()
            value = self.forecast(gid)
            if self._forecasts_taken.get(gid) != value:
                changed[gid] = self._forecasts_taken[gid] = value
        return changed

    # ------------------------------------------------------------- internals
    def _changed(self, *, workers: Iterable[str] | None = None) -> None:
        """A change the policies may see: `workers`, those whose load changed (an empty one: no
        load did); None: the live workers themselves may have (one joined, left, came back)."""
        self._version += 1
        if workers is None:
            self._load_list = self._loads = None
        else:
            self._stale_loads.update(workers)
            if self._stale_loads:
                self._loads = None

    def _end_if_done(self, group: GroupRecord) -> None:
        """A group whose every response ended leaves the unfinished ones; only a group whose every
        response finished teaches the growth table (a failed one's longest is unknown)."""
        if group.finished + group.failed == group.n:
            del self.unfinished_groups[group.id]
            if not group.failed:
                self.growth.observe_completed(group.finished_lengths)

    def _longest_unfinished(self, group: GroupRecord) -> int:
        return max((self.requests[rid].generated for rid in group.request_ids
                    if not self.requests[rid].ended), default=0)

    def _view(self, request: RequestRecord, longest_unfinished: int | None = None) -> QueuedRequest:
        group = self.groups[request.group_id]
        if longest_unfinished is None:
            longest_unfinished = self._longest_unfinished(group)
        return QueuedRequest(request.id, request.group_id, group.index, request.response_index, group.prompt_len,
                             request.generated, request.max_tokens, request.is_probe, group.estimate,
                             request.last_worker, request.queued_at, group.n, group.finished, longest_unfinished,
                             frozenset(request.failed_on) if request.failed_on else NOWHERE)

    def _refresh_views(self, group: GroupRecord) -> None:
        longest = self._longest_unfinished(group)
        for rid in group.request_ids:
            if rid in self.queue:
                fresh = self._view(self.requests[rid], longest)
                if fresh != self.queue.get(rid):
                    self.queue.put(fresh)
