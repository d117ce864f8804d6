"""The discrete-event simulator: the daemon's scheduler driven by a simulated clock.

The simulator plays the coordinator's part over the very `SchedulerState` the lease book wraps
(`seerd/scheduler/state.py`): a `snapshot()` and a `Policy.plan()` call when a worker asks for
work, `apply_leases` for the plan, `update_from_results` when chunks end. Workers ask as the
daemon's do: after their chunks finish, and, while they have free slots, whenever new work is
queued (the daemon wakes its long-polling workers then, the longest waiting first). Only the
engines are modelled (`SimInstance`).
The lengths are known to the engines alone, as a model's EOS is; policies never see them, except
the simulation-only oracles, which are given them at construction.
Deterministic for a seed: events are ordered by (time, sequence number) and all randomness
comes from one seeded generator.
With `speculation` every engine drafts (`seerd/sim/spec.py`): its planner re-plans at each of
the engine's scheduling points, and when a request finishes, the engines running its siblings
re-plan at once (a refresh event), because their acceptance depends on the finished siblings.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from dataclasses import dataclass

from seerd.protocol import LEASE_LONG_POLL_S, LONG_POLL_MAX_S
from seerd.scheduler import make_sim_policy
from seerd.scheduler.forecast import GrowthTable
from seerd.scheduler.state import FIRST_CHUNK_SPREAD, SchedulerState
from seerd.scheduler.records import ChunkResult, GroupRecord, RequestRecord
from seerd.scheduler.views import Policy, response_ended
from seerd.scheduler.wake import WaitingCall, wake_order
from seerd.sim.costs import InstanceCosts
from seerd.sim.engine import WATERMARK_FRACTION, SimInstance, SimSeq
from seerd.sim.spec import DepthPlanner, Speculation
from seerd.sim.workload import Workload
from seerd.tail import tail_start


# A worker's lease call waits this long for work (the coordinator caps what it asks for).
LONG_POLL_S = min(LEASE_LONG_POLL_S, LONG_POLL_MAX_S)
REPORT_EVENT = -1  # the version field of an event that delivers a report, not a segment end


@dataclass
class SimRequest:
    """What the simulation knows of a request besides the scheduler's state (its true length)."""

    request_id: int
    group_index: int
    response_index: int
    true_length: int
    finished_at: float | None = None
    first_leased_at: float | None = None
    chunks: int = 0


@dataclass
class SimResult:
    policy: str
    total_time_s: float
    output_tokens: int
    requests: int
    finish_times: list[float]
    instance_busy_s: list[float]
    preemptions: int
    recomputed_tokens: int
    pool_loads: int
    local_continuations: int
    chunks: int
    plan_calls: int
    wall_s: float
    timelines: list[list[tuple[float, int, int]]]
    kv_capacity: int
    peak_kv: list[int]
    mean_batch: float  # sequences per decode step, over all steps of all instances
    moved_chunks: int = 0  # continued chunks that ran on another instance than the one before
    decode_steps: int = 0
    sequence_steps: int = 0  # over all decode steps, the sequences each one advanced
    spec_steps: int = 0  # decode steps that verified drafts
    drafted_tokens: int = 0
    accepted_tokens: float = 0.0  # expected accepted drafts

    @property
    def tokens_per_sequence_step(self) -> float:
        """1 without drafts; 1 + accepted drafts per sequence and step with them."""
        return 1.0 + self.accepted_tokens / self.sequence_steps if self.sequence_steps else 1.0

    @property
    def draft_acceptance(self) -> float | None:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    @property
    def throughput_tok_s(self) -> float:
        return self.output_tokens / self.total_time_s if self.total_time_s > 0 else 0.0

    @property
    def tail_time_s(self) -> float:
        """Time spent only on the last 10% of requests: the end minus when 90% had finished."""
        start = tail_start(self.finish_times)
        return self.total_time_s - start if start is not None else 0.0

    @property
    def idle_fraction(self) -> float:
        if self.total_time_s <= 0:
            return 0.0
        return sum(1.0 - min(1.0, b / self.total_time_s) for b in self.instance_busy_s) / len(self.instance_busy_s)


class Simulation:
    def __init__(self, workload: Workload, policy: Policy | str, costs: InstanceCosts, *, instances: int,
                 chunk_tokens: int, max_num_seqs: int, seed: int, pool_hit_rate: float = 1.0,
                 priors: dict[int, int] | None = None, kv_capacity: int | None = None,
                 record_timeline: bool = True, chunk_gap_s: float = 0.0,
                 growth_quantile: float | None = None, speculation: Speculation | None = None,
                 first_chunk_spread: float = FIRST_CHUNK_SPREAD) -> None:
        if instances < 1 or chunk_tokens < 1 or max_num_seqs < 1:
            raise ValueError("instances, chunk_tokens and max_num_seqs must be positive")
        if chunk_gap_s < 0:
            raise ValueError(f"chunk_gap_s must not be negative, got {chunk_gap_s}")
        # Control-plane time between a chunk's end in the engine and the coordinator acting on
        # it (report, then the worker's next lease): the lease and its slot stay held meanwhile.
        self.chunk_gap_s = chunk_gap_s
        self._reports: dict[int, list[SimSeq]] = {}
        if not 0.0 <= pool_hit_rate <= 1.0:
            raise ValueError(f"pool_hit_rate must be in [0, 1], got {pool_hit_rate}")
        self.rng = random.Random(seed)
        capacity = kv_capacity if kv_capacity is not None else costs.kv_capacity_tokens()
        self.kv_capacity = capacity
        self.speculation = speculation
        self.instances = [SimInstance(i, costs, kv_capacity=capacity, max_num_seqs=max_num_seqs,
                                      pool_hit_rate=pool_hit_rate, rng=self.rng, record_timeline=record_timeline,
                                      planner=None if speculation is None else
                                      DepthPlanner(speculation, costs, self._finished_in_group))
                          for i in range(instances)]
        self._running_chunk: dict[int, tuple[int, int]] = {}  # request -> (instance, chunk) while leased
        self._refreshing: set[int] = set()  # instances whose pending event is a re-plan
        # What a worker registers: its KV less the engine's watermark, so that chunks admitted
        # within it are always admitted by the engine too.
        self.worker_kv = int(capacity * (1.0 - WATERMARK_FRACTION))
        self.max_chunks = max_num_seqs
        self.worker_ids = [f"sim-{i}" for i in range(instances)]
        self.instance_of = {wid: i for i, wid in enumerate(self.worker_ids)}
        # When each worker's pending long-poll lease call began, as (time, order of the calls);
        # None while it has no free slot (it waits for a chunk to end, not for work).
        self.waiting_since: list[tuple[float, int] | None] = [None] * instances
        self._asks = 0
        self.state = SchedulerState(chunk_tokens=chunk_tokens, first_chunk_spread=first_chunk_spread,
                                    growth=None if growth_quantile is None else GrowthTable(growth_quantile))
        self.requests: dict[int, SimRequest] = {}
        self._next_chunk = 0
        self._events: list[tuple[float, int, int, int]] = []
        self._event_seq = 0
        self.plan_calls = 0
        priors = priors or {}
        groups, requests = [], []
        for g in workload.groups:
            if any(length > g.max_tokens for length in g.lengths):
                raise ValueError(f"group {g.index} has a length above its max_tokens {g.max_tokens}")
            # Like `seerd run --prior`: the prior is the starting estimate, replaced at the first finish.
            estimate = min(g.max_tokens, priors.get(g.index, g.max_tokens))
            groups.append(GroupRecord(g.index, g.index, g.prompt_len, len(g.lengths), g.max_tokens, estimate))
            for k, length in enumerate(g.lengths):
                rid = len(self.requests)
                self.requests[rid] = SimRequest(rid, g.index, k, length)
                requests.append(RequestRecord(rid, g.index, k, k == 0, g.max_tokens))
        self.state.load(groups, requests)
        for i, wid in enumerate(self.worker_ids):
            self.state.add_worker(wid, rank=i, max_chunks=max_num_seqs, kv_capacity_tokens=self.worker_kv)
        # A name builds the policy here: the simulation-only oracles need the true lengths.
        self.policy = (make_sim_policy(policy, self.true_lengths(), {rid: r.group_index for rid, r in self.requests.items()})
                       if isinstance(policy, str) else policy)

    def _finished_in_group(self, group_index: int) -> int:
        return self.state.groups[group_index].finished

    def true_lengths(self) -> dict[int, int]:
        """For the simulation-only oracles."""
        return {rid: r.true_length for rid, r in self.requests.items()}

    # ------------------------------------------------------------- the coordinator's part
    def running_chunks(self, i: int) -> int:
        return len(self.state.workers[self.worker_ids[i]].chunks)

    def lease(self, i: int, now: float) -> list[SimSeq]:
        """Worker i asks for work (a lease call); returns the chunks it was leased."""
        wanted = self.max_chunks - self.running_chunks(i)
        if wanted <= 0 or not len(self.state.queue):
            return []
        self.plan_calls += 1
        worker_id = self.worker_ids[i]
        plan = self.policy.plan(self.state.snapshot(worker_id, wanted, now))
        self.state.check_plan(plan, worker_id)
        chunk_ids = range(self._next_chunk, self._next_chunk + len(plan.assignments))
        self._next_chunk += len(plan.assignments)
        seqs = []
        for lease in self.state.apply_leases(worker_id, plan, chunk_ids):
            r, request = self.requests[lease.request_id], self.state.requests[lease.request_id]
            r.chunks += 1
            if r.first_leased_at is None:
                r.first_leased_at = now
            previous = None if lease.previous_worker is None else self.instance_of[lease.previous_worker]
            generated = request.generated
            seqs.append(SimSeq(lease.chunk_id, r.request_id, r.group_index, self.state.groups[r.group_index].prompt_len,
                               generated, min(lease.max_tokens, r.true_length - generated), previous,
                               is_probe=request.is_probe))
            self._running_chunk[r.request_id] = (i, lease.chunk_id)
        return seqs

    def report(self, i: int, finished: list[SimSeq], now: float) -> bool:
        """Chunks reported by instance i; returns whether any request went back to the queue."""
        results = []
        for seq in finished:
            r, request = self.requests[seq.request_id], self.state.requests[seq.request_id]
            total = request.generated + seq.target
            results.append(ChunkResult(seq.chunk_id, seq.target,
                                       response_ended(total, request.max_tokens, stopped=total >= r.true_length)))
        applied = self.state.update_from_results(results, now)
        finishes: dict[int, int] = {}  # group -> responses finished by this report
        for outcome in applied.requests:
            self._running_chunk.pop(outcome.request_id, None)
            if outcome.finished:
                self.requests[outcome.request_id].finished_at = now
                group = self.requests[outcome.request_id].group_index
                finishes[group] = finishes.get(group, 0) + 1
        if self.speculation is not None and self.speculation.grouped:
            for group in applied.groups:
                self._refresh_siblings(group.group_id, group.finished - finishes.get(group.group_id, 0),
                                       group.finished, now)
        return not all(outcome.finished for outcome in applied.requests)

    def _refresh_siblings(self, group_index: int, before: int, after: int, now: float) -> None:
        """A group's finished count went from `before` to `after`: the engines running its other
        responses re-plan now, if that changes their acceptance."""
        table = self.speculation.acceptance
        if table.tokens_per_step(before) == table.tokens_per_step(after):
            return
        for request_id in self.state.groups[group_index].request_ids:
            where = self._running_chunk.get(request_id)
            if where is None or where[0] in self._refreshing or where[1] not in self.instances[where[0]].running:
                continue
            instance = self.instances[where[0]]
            instance.version += 1  # replaces its pending segment end
            self._refreshing.add(where[0])
            self._event_seq += 1
            heapq.heappush(self._events, (now, self._event_seq, where[0], instance.version))

    def return_leases(self, chunk_ids: list[int]) -> None:
        """Leases that end without a result (the daemon's expiry or release): their requests wait
        again. The event loop never loses a lease; the replay test feeds expiries through here."""
        self.state.return_leases(chunk_ids)

    # ------------------------------------------------------------- the event loop
    def _reschedule(self, i: int) -> None:
        instance = self.instances[i]
        instance.version += 1
        self._refreshing.discard(i)
        end = instance.schedule()
        if end is not None:
            self._event_seq += 1
            heapq.heappush(self._events, (end, self._event_seq, i, instance.version))

    def _engine_finished(self, i: int, finished: list[SimSeq]) -> None:
        """Chunks that just ended in engine i: reported now, or after the control-plane gap."""
        if not finished:
            return
        clock = self.instances[i].clock
        if self.chunk_gap_s <= 0:
            self.report(i, finished, clock)
            return
        self._event_seq += 1
        self._reports[self._event_seq] = finished
        heapq.heappush(self._events, (clock + self.chunk_gap_s, self._event_seq, i, REPORT_EVENT))

    def _hand_out(self, now: float, reporter: int | None, *, wake: bool) -> None:
        """Lease calls answered at `now`, in the daemon's order, after `reporter`'s chunks ended
        (None: the start, when every worker makes its first call, in index order).

        With `wake` (a report re-queued work) the coordinator plans for the long-polling calls,
        the workers with the most KV room first (`_waiting_in_wake_order`). Then come the calls
        made now: the reporter's, unless it was already waiting (a full worker asks once its
        report is answered, after the woken calls). A worker that got chunks calls again at once
        (it still has free slots), in rounds until a round hands out nothing."""
        woken = self._waiting_in_wake_order(now) if wake else []
        was_woken = set(woken)
        if reporter is None:
            calling = list(range(len(self.instances)))
            touched = set(calling)
        else:
            # A waiting reporter that was not woken would see new room at its poll's renewal;
            # asking now spares modelling poll timeouts.
            calling = [] if reporter in was_woken else [reporter]
            touched = {reporter}  # engines already at `now`: they get rescheduled below
        turned_away = []  # woken calls answered empty: the worker asks again after the reply's retry pause
        order = woken + calling
        first_round = True
        while order:
            again = []
            for j in order:
                seqs = self.lease(j, now)
                if not seqs:
                    if first_round and j in was_woken:
                        turned_away.append(j)
                    elif self.waiting_since[j] is None:
                        self._start_waiting(j, now)  # a call that finds nothing long-polls
                    continue
                self.waiting_since[j] = None  # its call returned
                again.append(j)
                instance = self.instances[j]
                if j not in touched:
                    touched.add(j)
                    self._engine_finished(j, instance.sync(now))
                for seq in seqs:
                    instance.submit(seq)
            order, first_round = again, False
        for j in turned_away:
            self._start_waiting(j, now)
        for j in touched:
            self._reschedule(j)

    def _start_waiting(self, i: int, now: float) -> None:
        """Worker i's lease call starts long-polling now, if it has a free slot to ask for."""
        self._asks += 1
        self.waiting_since[i] = (now, self._asks) if self.running_chunks(i) < self.max_chunks else None

    def _waiting_in_wake_order(self, now: float) -> list[int]:
        """The long-polling workers in the order the coordinator plans for them as work is queued
        (`seerd.scheduler.wake.wake_order`, as `LeaseLine.serve` sorts them): the most KV room
        first, then by when their current poll began. This model counts no plans in vain and plans
        for every waiting call, where the daemon stops after the requests queued plus
        `waiting.EXTRA_PLANS` plans (docs/benchmarks.md, "The daemon beside the simulator"). A
        poll times out after LONG_POLL_S and the worker asks again (a new wait)."""
        calls = []
        for i, since in enumerate(self.waiting_since):
            if since is not None:
                began, ask = since
                renewed = began + LONG_POLL_S * math.floor((now - began) / LONG_POLL_S)  # the current poll's start
                calls.append(WaitingCall(i, 0, self.state.room_for(self.worker_ids[i], 0), (renewed, ask)))
        return wake_order(calls)

    def run(self) -> SimResult:
        started = time.perf_counter()
        self._hand_out(0.0, None, wake=False)
        while self._events:
            t, event_id, i, version = heapq.heappop(self._events)
            instance = self.instances[i]
            if version == REPORT_EVENT:  # a report reaches the coordinator after the gap
                self._engine_finished(i, instance.sync(t))  # the engine to a step boundary first
                requeued = self.report(i, self._reports.pop(event_id), t)
                self._hand_out(t, i, wake=requeued)
                continue
            if version != instance.version:
                continue
            finished = instance.sync(t)
            if self.chunk_gap_s > 0:
                self._engine_finished(i, finished)
                self._reschedule(i)  # the engine goes on with its other sequences meanwhile
                continue
            if not finished and i in self._refreshing:  # a re-plan only: nothing to report or lease
                self._reschedule(i)
                continue
            requeued = self.report(i, finished, instance.clock)
            self._hand_out(instance.clock, i, wake=requeued)
        if not self.state.is_complete():
            stuck = len(self.requests) - self.state.finished_requests
            raise RuntimeError(f"policy {self.policy.name} left {stuck} requests unfinished "
                               f"({len(self.state.queue)} queued, {len(self.state.leases)} leased)")
        finish_times = [r.finished_at for r in self.requests.values()]
        total = max(finish_times)
        stats = [inst.stats for inst in self.instances]
        return SimResult(
            policy=self.policy.name, total_time_s=total,
            output_tokens=sum(r.true_length for r in self.requests.values()), requests=len(self.requests),
            finish_times=finish_times, instance_busy_s=[s.busy_s for s in stats],
            preemptions=sum(s.preemptions for s in stats), recomputed_tokens=sum(s.recomputed_tokens for s in stats),
            pool_loads=sum(s.pool_loads for s in stats), local_continuations=sum(s.local_continuations for s in stats),
            chunks=self._next_chunk, plan_calls=self.plan_calls, wall_s=time.perf_counter() - started,
            timelines=[inst.timeline for inst in self.instances], kv_capacity=self.kv_capacity,
            peak_kv=[s.peak_kv for s in stats],
            mean_batch=sum(s.sequence_steps for s in stats) / max(1, sum(s.decode_steps for s in stats)),
            moved_chunks=sum(s.moved_continuations for s in stats),
            decode_steps=sum(s.decode_steps for s in stats), sequence_steps=sum(s.sequence_steps for s in stats),
            spec_steps=sum(s.spec_steps for s in stats),
            drafted_tokens=sum(s.drafted_tokens for s in stats), accepted_tokens=sum(s.accepted_tokens for s in stats))
