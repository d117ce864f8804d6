"""The lease book: the coordinator's one owner of rollout state, in memory and in SQLite.

Every mutation happens in one method, in one `BEGIN IMMEDIATE` transaction, and the in-memory
mirror changes only after that transaction commits. A worker's report is acknowledged (the method
returns) only after its commit, so every token is either durable or was never acknowledged.
Callers pass `now`: lease expiry is tested by moving time, never by sleeping.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field

from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from seerd.db import (
    Chunk, ChunkStatus, Group, Request, RequestStatus, Rollout, RolloutStatus, Worker, WorkerStatus,
    add_event, check_transition,
)
from seerd.io.codec import pack_floats, pack_ints, unpack_ints
from seerd.scheduler import Policy, QueuedRequest, Snapshot, WorkerLoad

FINISH_REASONS = frozenset({"stop", "length"})


class UnknownWorker(LookupError):
    """The worker is not registered with this coordinator (it must register again)."""


class BadReport(ValueError):
    """A report that cannot be right whatever the lease state (too many tokens, bad fields)."""


@dataclass
class GroupState:
    id: int
    index: int
    prompt_len: int
    n: int
    max_tokens: int
    estimate: int
    sampling: dict
    bound_worker: str | None
    finished: int


@dataclass
class RequestState:
    id: int
    group_id: int
    response_index: int
    status: RequestStatus
    is_probe: bool
    generated: int
    max_tokens: int
    num_chunks: int
    last_worker: str | None
    queued_at: float
    open_chunk_id: int | None = None  # a QUEUED chunk row left by an expired lease


@dataclass
class LeaseState:
    chunk_id: int
    request_id: int
    worker_id: str
    epoch: int
    seq: int
    max_tokens: int
    deadline: float
    kv_reserved: int


@dataclass
class WorkerState:
    id: str
    rank: int
    max_chunks: int
    kv_capacity_tokens: int
    status: WorkerStatus
    last_heartbeat: float
    leases: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class ChunkGrant:
    """What a worker needs to run one chunk."""

    chunk_id: int
    epoch: int
    request_id: int
    prompt_token_ids: list[int]  # the group's prompt + the request's tokens so far
    max_tokens: int
    sampling: dict
    deadline: float


@dataclass(frozen=True)
class ChunkReport:
    chunk_id: int
    epoch: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    cached_tokens: int | None = None


@dataclass(frozen=True)
class ReportOutcome:
    accepted: bool
    duplicate: bool = False
    reason: str = ""
    request_finished: bool = False


def chunk_seed(rollout_seed: int, group_index: int, response_index: int, seq: int) -> int:
    """A per-chunk seed from (rollout seed, request, chunk index): reproducible wherever it runs."""
    digest = hashlib.blake2b(f"{rollout_seed}:{group_index}:{response_index}:{seq}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") & 0x7FFF_FFFF


class LeaseBook:
    def __init__(self, sessions: sessionmaker[Session], rollout_id: int, policy: Policy,
                 *, chunk_tokens: int, lease_ttl_s: float, seed: int) -> None:
        self.sessions = sessions
        self.rollout_id = rollout_id
        self.policy = policy
        self.chunk_tokens = chunk_tokens
        self.lease_ttl_s = lease_ttl_s
        self.seed = seed
        self.groups: dict[int, GroupState] = {}
        self.requests: dict[int, RequestState] = {}
        self.leases: dict[int, LeaseState] = {}
        self.workers: dict[str, WorkerState] = {}
        self.output_tokens = 0
        self.first_lease_at: float | None = None  # this session's; generation starts here

    # ----------------------------------------------------------------- loading
    def load(self, now: float) -> None:
        """Read the rollout from the database; leases of a previous coordinator go back to the queue."""
        with self.sessions.begin() as session:
            for group in session.scalars(select(Group).where(Group.rollout_id == self.rollout_id)):
                self.groups[group.id] = GroupState(
                    group.id, group.group_index, group.prompt_len, group.n, group.max_tokens,
                    group.length_estimate, json.loads(group.sampling_json), group.bound_worker,
                    group.finished_requests,
                )
            for req in session.scalars(select(Request).where(Request.rollout_id == self.rollout_id)):
                self.requests[req.id] = RequestState(
                    req.id, req.group_id, req.response_index, req.status, req.is_probe,
                    req.generated_tokens, self.groups[req.group_id].max_tokens, req.num_chunks,
                    req.last_worker, req.queued_at,
                )
                self.output_tokens += req.generated_tokens
            orphaned = session.scalars(
                select(Chunk).join(Request).where(
                    Request.rollout_id == self.rollout_id, Chunk.status == ChunkStatus.LEASED)
            ).all()
            for chunk in orphaned:
                self._requeue_chunk(session, chunk, now, kind="lease_orphaned")
            for chunk in session.scalars(
                select(Chunk).join(Request).where(
                    Request.rollout_id == self.rollout_id, Chunk.status == ChunkStatus.QUEUED)
            ):
                self.requests[chunk.request_id].open_chunk_id = chunk.id
            session.execute(
                update(Worker).where(Worker.rollout_id == self.rollout_id, Worker.status != WorkerStatus.GONE)
                .values(status=WorkerStatus.GONE)
            )

    def _requeue_chunk(self, session: Session, chunk: Chunk, now: float, *, kind: str) -> None:
        check_transition(chunk.status, ChunkStatus.QUEUED)
        holder = chunk.lease_holder
        chunk.status = ChunkStatus.QUEUED
        chunk.lease_holder = None
        chunk.lease_deadline = None
        request = session.get(Request, chunk.request_id)
        check_transition(request.status, RequestStatus.QUEUED)
        request.status = RequestStatus.QUEUED
        state = self.requests[request.id]
        state.status = RequestStatus.QUEUED
        state.open_chunk_id = chunk.id
        add_event(session, self.rollout_id, now, kind, worker_id=holder, request_id=request.id,
                  chunk_id=chunk.id, data={"epoch": chunk.lease_epoch})

    # ----------------------------------------------------------------- workers
    def register(self, *, rank: int, address: str, max_chunks: int, kv_capacity_tokens: int,
                 worker_id: str, now: float) -> WorkerState:
        with self.sessions.begin() as session:
            row = session.get(Worker, worker_id)
            if row is None:
                row = Worker(id=worker_id, rollout_id=self.rollout_id, rank=rank, address=address,
                             max_chunks=max_chunks, kv_capacity_tokens=kv_capacity_tokens,
                             status=WorkerStatus.ALIVE, registered_at=now, last_heartbeat=now)
                session.add(row)
            elif row.status != WorkerStatus.ALIVE:
                # Same id again (a restarted coordinator, a worker back from a partition).
                row = Worker(id=f"{worker_id}+{int(now * 1000)}", rollout_id=self.rollout_id, rank=rank,
                             address=address, max_chunks=max_chunks, kv_capacity_tokens=kv_capacity_tokens,
                             status=WorkerStatus.ALIVE, registered_at=now, last_heartbeat=now)
                session.add(row)
            add_event(session, self.rollout_id, now, "worker_registered", worker_id=row.id,
                      data={"rank": rank, "address": address, "max_chunks": max_chunks,
                            "kv_capacity_tokens": kv_capacity_tokens})
        state = WorkerState(row.id, rank, max_chunks, kv_capacity_tokens, WorkerStatus.ALIVE, now)
        self.workers[row.id] = state
        return state

    def heartbeat(self, worker_id: str, running: Iterable[int], now: float) -> list[int]:
        """Extend the leases the worker still runs; return the chunks it must abort."""
        worker = self._worker(worker_id)
        running = set(running)
        with self.sessions.begin() as session:
            if worker.status == WorkerStatus.STALE:
                check_transition(worker.status, WorkerStatus.ALIVE)
                add_event(session, self.rollout_id, now, "worker_alive", worker_id=worker_id)
            session.execute(update(Worker).where(Worker.id == worker_id)
                            .values(last_heartbeat=now, status=WorkerStatus.ALIVE))
        worker.status = WorkerStatus.ALIVE
        worker.last_heartbeat = now
        for chunk_id in worker.leases & running:
            self.leases[chunk_id].deadline = now + self.lease_ttl_s
        return sorted(running - worker.leases)

    def _worker(self, worker_id: str) -> WorkerState:
        worker = self.workers.get(worker_id)
        if worker is None or worker.status == WorkerStatus.GONE:
            raise UnknownWorker(worker_id)
        return worker

    def live_workers(self) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.status == WorkerStatus.ALIVE]

    # ----------------------------------------------------------------- leasing
    def snapshot(self, worker_id: str, wanted: int, now: float) -> Snapshot:
        queued = tuple(
            QueuedRequest(
                r.id, r.group_id, self.groups[r.group_id].index, r.response_index,
                self.groups[r.group_id].prompt_len, r.generated, r.max_tokens, r.is_probe,
                self.groups[r.group_id].estimate, r.last_worker, r.queued_at,
            )
            for r in self.requests.values() if r.status == RequestStatus.QUEUED
        )
        loads = tuple(
            WorkerLoad(w.id, w.rank, len(w.leases), sum(self.leases[c].kv_reserved for c in w.leases),
                       w.max_chunks, w.kv_capacity_tokens)
            for w in self.live_workers()
        )
        unfinished = {g.id: g.index for g in self.groups.values() if g.finished < g.n}
        binding = {g.id: g.bound_worker for g in self.groups.values() if g.bound_worker}
        return Snapshot(now, worker_id, wanted, loads, queued, binding, unfinished, self.chunk_tokens)

    def lease(self, worker_id: str, wanted: int, now: float) -> list[ChunkGrant]:
        worker = self._worker(worker_id)
        if worker.status != WorkerStatus.ALIVE:
            return []
        plan = self.policy.plan(self.snapshot(worker_id, wanted, now))
        if not plan.assignments and not plan.new_bindings:
            return []
        grants: list[ChunkGrant] = []
        new_leases: list[LeaseState] = []
        with self.sessions.begin() as session:
            for group_id, bound in plan.new_bindings.items():
                session.execute(update(Group).where(Group.id == group_id).values(bound_worker=bound))
            for assignment in plan.assignments:
                if assignment.worker_id != worker_id:
                    raise RuntimeError(f"policy {self.policy.name} assigned to another worker")
                grant, lease = self._lease_one(session, worker_id, assignment.request_id,
                                               assignment.max_tokens, now)
                grants.append(grant)
                new_leases.append(lease)
        for group_id, bound in plan.new_bindings.items():
            self.groups[group_id].bound_worker = bound
        if new_leases and self.first_lease_at is None:
            self.first_lease_at = now
        for lease in new_leases:
            self.leases[lease.chunk_id] = lease
            worker.leases.add(lease.chunk_id)
            request = self.requests[lease.request_id]
            request.status = RequestStatus.RUNNING
            request.open_chunk_id = None
            request.last_worker = worker_id
        return grants

    def _lease_one(self, session: Session, worker_id: str, request_id: int, max_tokens: int,
                   now: float) -> tuple[ChunkGrant, LeaseState]:
        state = self.requests[request_id]
        group = self.groups[state.group_id]
        if not 0 < max_tokens <= state.max_tokens - state.generated:
            raise RuntimeError(f"policy gave request {request_id} an impossible budget {max_tokens}")
        request = session.get(Request, request_id)
        check_transition(request.status, RequestStatus.RUNNING)
        if state.open_chunk_id is not None:
            chunk = session.get(Chunk, state.open_chunk_id)
        else:
            chunk = Chunk(request_id=request_id, seq=state.num_chunks, status=ChunkStatus.QUEUED,
                          lease_epoch=0, attempt=0, created_at=now, max_tokens=max_tokens)
            session.add(chunk)
        check_transition(chunk.status, ChunkStatus.LEASED)
        deadline = now + self.lease_ttl_s
        chunk.status = ChunkStatus.LEASED
        chunk.max_tokens = max_tokens
        chunk.lease_holder = worker_id
        chunk.lease_deadline = deadline
        chunk.lease_epoch = (chunk.lease_epoch or 0) + 1
        chunk.attempt = (chunk.attempt or 0) + 1
        chunk.leased_at = now
        request.status = RequestStatus.RUNNING
        request.last_worker = worker_id
        if request.started_at is None:
            request.started_at = now
        session.flush()
        prompt = unpack_ints(session.scalar(select(Group.prompt_token_ids).where(Group.id == group.id)))
        if state.generated:
            for blob in session.scalars(
                select(Chunk.token_ids).where(Chunk.request_id == request_id, Chunk.status == ChunkStatus.DONE)
                .order_by(Chunk.seq)
            ):
                prompt.extend(unpack_ints(blob))
        add_event(session, self.rollout_id, now, "chunk_leased", worker_id=worker_id, request_id=request_id,
                  chunk_id=chunk.id, data={"seq": chunk.seq, "epoch": chunk.lease_epoch,
                                           "max_tokens": max_tokens})
        sampling = dict(group.sampling)
        if sampling.get("seed") is None:
            sampling["seed"] = chunk_seed(self.seed, group.index, state.response_index, chunk.seq)
        else:  # a row's own seed still differs per response and chunk
            sampling["seed"] = chunk_seed(int(sampling["seed"]), group.index, state.response_index, chunk.seq)
        lease = LeaseState(chunk.id, request_id, worker_id, chunk.lease_epoch, chunk.seq, max_tokens,
                           deadline, len(prompt) + max_tokens)
        grant = ChunkGrant(chunk.id, chunk.lease_epoch, request_id, prompt, max_tokens, sampling, deadline)
        return grant, lease

    # ----------------------------------------------------------------- reports
    def report(self, worker_id: str, report: ChunkReport, now: float) -> ReportOutcome:
        self._worker(worker_id)
        lease = self.leases.get(report.chunk_id)
        if lease is None or lease.epoch != report.epoch or lease.worker_id != worker_id:
            return self._judge_unleased(worker_id, report)
        self._validate(report, lease)
        state = self.requests[lease.request_id]
        group = self.groups[state.group_id]
        n_tokens = len(report.token_ids)
        total = state.generated + n_tokens
        finished = report.finish_reason == "stop" or total >= state.max_tokens or n_tokens < lease.max_tokens
        finish_reason = report.finish_reason if report.finish_reason == "stop" else "length"
        with self.sessions.begin() as session:
            updated = session.execute(
                update(Chunk).where(Chunk.id == lease.chunk_id, Chunk.lease_epoch == lease.epoch,
                                    Chunk.status == ChunkStatus.LEASED)
                .values(status=ChunkStatus.DONE, finished_at=now, num_tokens=n_tokens,
                        token_ids=pack_ints(report.token_ids), logprobs=pack_floats(report.logprobs),
                        finish_reason=report.finish_reason, cached_tokens=report.cached_tokens,
                        lease_deadline=None)
            ).rowcount
            if updated != 1:  # the mirror and the database disagree: refuse rather than double count
                raise RuntimeError(f"chunk {lease.chunk_id} epoch {lease.epoch} is not leased in the database")
            request = session.get(Request, lease.request_id)
            request.generated_tokens = total
            request.num_chunks = state.num_chunks + 1
            new_status = RequestStatus.FINISHED if finished else RequestStatus.QUEUED
            check_transition(request.status, new_status)
            request.status = new_status
            add_event(session, self.rollout_id, now, "chunk_done", worker_id=worker_id,
                      request_id=request.id, chunk_id=lease.chunk_id,
                      data={"tokens": n_tokens, "finish_reason": report.finish_reason,
                            "cached_tokens": report.cached_tokens})
            estimate = group.estimate
            if finished:
                request.finish_reason = finish_reason
                request.finished_at = now
                estimate = total if group.finished == 0 else max(group.estimate, total)
                session.execute(
                    update(Group).where(Group.id == group.id).values(
                        finished_requests=group.finished + 1, length_estimate=estimate,
                        finished_at=now if group.finished + 1 == group.n else None)
                )
                add_event(session, self.rollout_id, now, "request_finished", worker_id=worker_id,
                          request_id=request.id, data={"length": total, "finish_reason": finish_reason,
                                                       "group_estimate": estimate})
            else:
                request.queued_at = now
        # Committed: now the mirror follows.
        del self.leases[lease.chunk_id]
        self.workers[worker_id].leases.discard(lease.chunk_id)
        self.output_tokens += n_tokens
        state.generated = total
        state.num_chunks += 1
        if finished:
            state.status = RequestStatus.FINISHED
            group.finished += 1
            group.estimate = estimate
        else:
            state.status = RequestStatus.QUEUED
            state.queued_at = now
        return ReportOutcome(True, request_finished=finished)

    def _validate(self, report: ChunkReport, lease: LeaseState) -> None:
        if report.finish_reason not in FINISH_REASONS:
            raise BadReport(f"finish_reason must be one of {sorted(FINISH_REASONS)}, got {report.finish_reason!r}")
        if len(report.logprobs) != len(report.token_ids):
            raise BadReport(f"{len(report.token_ids)} token ids but {len(report.logprobs)} logprobs")
        if len(report.token_ids) > lease.max_tokens:
            raise BadReport(f"{len(report.token_ids)} tokens exceed the chunk budget {lease.max_tokens}")
        if not report.token_ids and report.finish_reason != "stop":
            raise BadReport("an empty chunk must end with finish_reason 'stop'")

    def _judge_unleased(self, worker_id: str, report: ChunkReport) -> ReportOutcome:
        """A report without a matching live lease: a harmless duplicate, or stale and rejected."""
        with self.sessions.begin() as session:
            chunk = session.get(Chunk, report.chunk_id)
            if chunk is None:
                return ReportOutcome(False, reason=f"unknown chunk {report.chunk_id}")
            if (chunk.status == ChunkStatus.DONE and chunk.lease_epoch == report.epoch
                    and chunk.lease_holder == worker_id):
                return ReportOutcome(True, duplicate=True)
            return ReportOutcome(False, reason=(
                f"stale lease: chunk {report.chunk_id} is {chunk.status.value} at epoch {chunk.lease_epoch}, "
                f"report is for epoch {report.epoch}"))

    def release(self, worker_id: str, chunk_id: int, epoch: int, reason: str, now: float) -> bool:
        """A worker gives a chunk back (engine error, shutdown): it runs again elsewhere."""
        lease = self.leases.get(chunk_id)
        if lease is None or lease.epoch != epoch or lease.worker_id != worker_id:
            return False
        self._expire([lease], now, kind="lease_released", reason=reason)
        return True

    # ----------------------------------------------------------------- expiry
    def expire(self, now: float) -> int:
        """Leases past their deadline go back to the queue; silent workers become stale."""
        expired = [lease for lease in self.leases.values() if lease.deadline < now]
        silent = [w for w in self.live_workers() if now - w.last_heartbeat > self.lease_ttl_s]
        if silent:
            with self.sessions.begin() as session:
                for worker in silent:
                    check_transition(worker.status, WorkerStatus.STALE)
                    session.execute(update(Worker).where(Worker.id == worker.id).values(status=WorkerStatus.STALE))
                    add_event(session, self.rollout_id, now, "worker_stale", worker_id=worker.id)
            for worker in silent:
                worker.status = WorkerStatus.STALE
        if expired:
            self._expire(expired, now, kind="lease_expired")
        return len(expired)

    def _expire(self, leases: list[LeaseState], now: float, *, kind: str, reason: str | None = None) -> None:
        with self.sessions.begin() as session:
            for lease in leases:
                chunk = session.get(Chunk, lease.chunk_id)
                self._requeue_chunk(session, chunk, now, kind=kind)
        for lease in leases:
            del self.leases[lease.chunk_id]
            worker = self.workers.get(lease.worker_id)
            if worker is not None:
                worker.leases.discard(lease.chunk_id)

    # ----------------------------------------------------------------- progress
    def counts(self) -> dict[str, int]:
        done = sum(1 for r in self.requests.values() if r.status == RequestStatus.FINISHED)
        return {
            "requests_total": len(self.requests),
            "requests_done": done,
            "groups_total": len(self.groups),
            "groups_done": sum(1 for g in self.groups.values() if g.finished >= g.n),
            "leases": len(self.leases),
            "output_tokens": self.output_tokens,
            "workers_alive": len(self.live_workers()),
        }

    def is_complete(self) -> bool:
        return all(r.status == RequestStatus.FINISHED for r in self.requests.values())

    def set_rollout_status(self, status: RolloutStatus, now: float, reason: str | None = None) -> None:
        with self.sessions.begin() as session:
            rollout = session.get(Rollout, self.rollout_id)
            if rollout.status == status:
                return
            check_transition(rollout.status, status)
            rollout.status = status
            rollout.status_reason = reason
            if status == RolloutStatus.RUNNING and rollout.started_at is None:
                rollout.started_at = now
            if status == RolloutStatus.FINISHED:
                rollout.finished_at = now
            add_event(session, self.rollout_id, now, f"rollout_{status.value}", data={"reason": reason})
