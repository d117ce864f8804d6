"""The lease book: the coordinator's one owner of rollout state, in memory and in SQLite.

Every mutation happens in one method, in one `BEGIN IMMEDIATE` transaction, and the in-memory
mirror changes only after that transaction commits. A worker's report is acknowledged (the method
returns) only after its commit, so every token is either durable or was never acknowledged.
Callers pass `now`: lease expiry is tested by moving time, never by sleeping.

Target lengths (benchmark rows) are kept apart from everything the scheduler sees: `RequestState`
and `QueuedRequest` have no such field; the book holds them in `worker_only_targets`, read only
to tell a worker where to stop (`ChunkGrant.target_remaining`) and to check its report.

Hot paths (lease, report) use Core statements with executemany and keep prompts and the tokens
of unfinished requests in memory; the ORM models still define the schema.
"""

from __future__ import annotations

import hashlib
import json
import time
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from sqlalchemy import Connection, Engine, bindparam, insert, select, update
from sqlalchemy.orm import Session, sessionmaker

from seerd.db import (
    Chunk, ChunkStatus, Event, Group, Request, RequestStatus, RequestTarget, Rollout, RolloutStatus, Worker,
    WorkerStatus, add_event, check_transition,
)
from seerd.io.codec import pack_floats, pack_ints, unpack_ints
from seerd.protocol import ChunkGrant, ChunkReport
from seerd.scheduler import Policy, QueuedRequest, RequestQueue, Snapshot, WorkerLoad
from seerd.scheduler.base import updated_estimate
from seerd.scheduler.forecast import GrowthTable, replay_growth

# "length_target": the worker ended the response at its target length (benchmark rows).
FINISH_REASONS = frozenset({"stop", "length", "length_target"})
CHUNKS, REQUESTS, GROUPS, EVENTS = Chunk.__table__, Request.__table__, Group.__table__, Event.__table__
TARGETS = RequestTarget.__table__


class UnknownWorker(LookupError):
    """The worker is not registered with this coordinator (it must register again)."""


class BadReport(ValueError):
    """A report that cannot be right whatever the lease state (too many tokens, bad fields)."""


@dataclass
class GroupState:
    id: int
    index: int
    prompt: array  # int32 prompt token ids
    n: int
    max_tokens: int
    estimate: int
    sampling: dict
    bound_worker: str | None
    finished: int
    request_ids: list[int] = field(default_factory=list)
    finished_lengths: list[int] = field(default_factory=list)  # in the order the responses finished


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
    open_chunk: tuple[int, int] | None = None  # (chunk id, epoch) of a QUEUED row left by an expired lease
    tokens: array | None = None  # generated tokens while unfinished (None: not loaded yet)


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
    kv_reserved: int = 0


class WaitingRequest(NamedTuple):
    """A queued request as `LeaseBook.queued_longest` names it (for the KV pool's trimming)."""

    group_id: int
    request_id: int
    queued_at: float


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


def _event(rollout_id: int, ts: float, kind: str, worker_id: str | None = None, request_id: int | None = None,
           chunk_id: int | None = None, data: dict | None = None) -> dict:
    return {"rollout_id": rollout_id, "ts": ts, "kind": kind, "worker_id": worker_id, "request_id": request_id,
            "chunk_id": chunk_id, "data_json": json.dumps(data, separators=(",", ":")) if data else None}


class LeaseBook:
    def __init__(self, sessions: sessionmaker[Session], rollout_id: int, policy: Policy,
                 *, chunk_tokens: int, lease_ttl_s: float, seed: int) -> None:
        self.sessions = sessions
        self.engine: Engine = sessions.kw["bind"]
        self.rollout_id = rollout_id
        self.policy = policy
        self.chunk_tokens = chunk_tokens
        self.lease_ttl_s = lease_ttl_s
        self.seed = seed
        self.groups: dict[int, GroupState] = {}
        self.requests: dict[int, RequestState] = {}
        self.leases: dict[int, LeaseState] = {}
        self.workers: dict[str, WorkerState] = {}
        self.queue = RequestQueue()
        self.growth = GrowthTable()  # seer's forecast ratios, learned from completed groups
        self.unfinished_groups: dict[int, int] = {}  # group_id -> group_index
        self.bindings: dict[int, str] = {}  # group_id -> worker_id (group policy)
        # request_id -> target length; never part of a snapshot (see the module docstring).
        self.worker_only_targets: dict[int, int] = {}
        self.finished_requests = 0
        self.output_tokens = 0
        self.first_lease_at: float | None = None  # this session's; generation starts here
        self.first_lease_cpu: float | None = None  # this process's CPU time then
        # Called on this (the state) thread after each commit: (group, request, offset, tokens) per
        # accepted chunk, and a group's id once all its responses are done. The draft host listens.
        self.on_committed_tokens: Callable[[int, int, int, Sequence[int]], None] | None = None
        self.on_group_finished: Callable[[int], None] | None = None
        self.on_request_finished: Callable[[int, int], None] | None = None  # (group, request), e.g. the KV pool

    # ----------------------------------------------------------------- loading
    def load(self, now: float) -> None:
        """Read the rollout from the database; leases of a previous coordinator go back to the queue."""
        with self.engine.begin() as conn:
            for row in conn.execute(select(GROUPS).where(GROUPS.c.rollout_id == self.rollout_id)):
                prompt = array("i", unpack_ints(row.prompt_token_ids))
                self.groups[row.id] = GroupState(
                    row.id, row.group_index, prompt, row.n, row.max_tokens, row.length_estimate,
                    json.loads(row.sampling_json), row.bound_worker, row.finished_requests)
                if row.finished_requests < row.n:
                    self.unfinished_groups[row.id] = row.group_index
                if row.bound_worker:
                    self.bindings[row.id] = row.bound_worker
            for row in conn.execute(select(REQUESTS).where(REQUESTS.c.rollout_id == self.rollout_id)):
                self.requests[row.id] = RequestState(
                    row.id, row.group_id, row.response_index, RequestStatus(row.status), row.is_probe,
                    row.generated_tokens, self.groups[row.group_id].max_tokens, row.num_chunks,
                    row.last_worker, row.queued_at)
                self.groups[row.group_id].request_ids.append(row.id)
                self.output_tokens += row.generated_tokens
                self.finished_requests += row.status == RequestStatus.FINISHED
            self._replay_finishes(conn)
            self.worker_only_targets = {rid: target for rid, target in conn.execute(
                select(TARGETS.c.request_id, TARGETS.c.target_length)
                .join(REQUESTS, REQUESTS.c.id == TARGETS.c.request_id)
                .where(REQUESTS.c.rollout_id == self.rollout_id))}
            unfinished_chunks = conn.execute(
                select(CHUNKS.c.id, CHUNKS.c.request_id, CHUNKS.c.status, CHUNKS.c.lease_epoch,
                       CHUNKS.c.lease_holder)
                .join(REQUESTS, REQUESTS.c.id == CHUNKS.c.request_id)
                .where(REQUESTS.c.rollout_id == self.rollout_id, CHUNKS.c.status != ChunkStatus.DONE.value)
            ).all()
            orphaned = [c for c in unfinished_chunks if c.status == ChunkStatus.LEASED.value]
            self._write_requeue(conn, [(c.id, c.request_id, c.lease_holder, c.lease_epoch) for c in orphaned],
                                now, kind="lease_orphaned")
            conn.execute(update(Worker).where(Worker.rollout_id == self.rollout_id,
                                              Worker.status != WorkerStatus.GONE).values(status=WorkerStatus.GONE))
        for chunk in unfinished_chunks:
            request = self.requests[chunk.request_id]
            request.status = RequestStatus.QUEUED
            request.open_chunk = (chunk.id, chunk.lease_epoch)
        for request in self.requests.values():
            if request.status == RequestStatus.QUEUED:
                self._enqueue(request)

    def _replay_finishes(self, conn: Connection) -> None:
        """Finished lengths per group in finish order, and the growth table learned from them, as
        the previous coordinator had them (responses finished in one report share a time and
        replay in request id order, which may differ from the order the report listed them)."""
        rows = conn.execute(
            select(REQUESTS.c.group_id, REQUESTS.c.generated_tokens)
            .where(REQUESTS.c.rollout_id == self.rollout_id, REQUESTS.c.status == RequestStatus.FINISHED.value)
            .order_by(REQUESTS.c.finished_at, REQUESTS.c.id))
        self.growth, lengths = replay_growth(((r.group_id, r.generated_tokens) for r in rows),
                                             {gid: group.n for gid, group in self.groups.items()})
        for gid, finished_lengths in lengths.items():
            self.groups[gid].finished_lengths = finished_lengths

    def _longest_unfinished(self, group: GroupState) -> int:
        return max((self.requests[rid].generated for rid in group.request_ids
                    if self.requests[rid].status != RequestStatus.FINISHED), default=0)

    def _queued_view(self, request: RequestState, longest_unfinished: int | None = None) -> QueuedRequest:
        group = self.groups[request.group_id]
        if longest_unfinished is None:
            longest_unfinished = self._longest_unfinished(group)
        return QueuedRequest(request.id, request.group_id, group.index, request.response_index, len(group.prompt),
                             request.generated, request.max_tokens, request.is_probe, group.estimate,
                             request.last_worker, request.queued_at, group.n, group.finished, longest_unfinished)

    def _enqueue(self, request: RequestState) -> None:
        self.queue.put(self._queued_view(request))

    def _write_requeue(self, conn: Connection, chunks: Sequence[tuple[int, int, str | None, int]], now: float,
                       *, kind: str, reason: str | None = None) -> None:
        """Chunks (id, request id, holder, epoch) go from LEASED back to QUEUED, in the caller's transaction."""
        if not chunks:
            return
        conn.execute(update(CHUNKS).where(CHUNKS.c.id == bindparam("cid")).values(
            status=ChunkStatus.QUEUED.value, lease_holder=None, lease_deadline=None),
            [{"cid": c[0]} for c in chunks])
        conn.execute(update(REQUESTS).where(REQUESTS.c.id == bindparam("rid")).values(
            status=RequestStatus.QUEUED.value), [{"rid": c[1]} for c in chunks])
        conn.execute(insert(EVENTS), [_event(self.rollout_id, now, kind, c[2], c[1], c[0],
                                             {"epoch": c[3], **({"reason": reason} if reason else {})})
                                      for c in chunks])

    # ----------------------------------------------------------------- workers
    def register(self, *, rank: int, address: str, max_chunks: int, kv_capacity_tokens: int,
                 worker_id: str, now: float) -> WorkerState:
        with self.sessions.begin() as session:
            if session.get(Worker, worker_id) is not None:
                # Same id again (a restarted coordinator, a worker back from a partition): a new
                # identity, so reports of its old leases can never pass as the new one's.
                worker_id = f"{worker_id}+{int(now * 1000)}"
            session.add(Worker(id=worker_id, rollout_id=self.rollout_id, rank=rank, address=address,
                               max_chunks=max_chunks, kv_capacity_tokens=kv_capacity_tokens,
                               status=WorkerStatus.ALIVE, registered_at=now, last_heartbeat=now))
            add_event(session, self.rollout_id, now, "worker_registered", worker_id=worker_id,
                      data={"rank": rank, "address": address, "max_chunks": max_chunks,
                            "kv_capacity_tokens": kv_capacity_tokens})
        state = WorkerState(worker_id, rank, max_chunks, kv_capacity_tokens, WorkerStatus.ALIVE, now)
        self.workers[worker_id] = state
        return state

    def heartbeat(self, worker_id: str, running: Iterable[int], now: float, stats: dict | None = None) -> list[int]:
        """Extend the leases the worker still runs; return the chunks it must abort. `stats`, the
        worker's own figures (seerd/worker/stats.py), are kept for `seerd status` as they come."""
        worker = self._worker(worker_id)
        running = set(running)
        with self.engine.begin() as conn:
            if worker.status == WorkerStatus.STALE:
                check_transition(worker.status, WorkerStatus.ALIVE)
                conn.execute(insert(EVENTS), [_event(self.rollout_id, now, "worker_alive", worker_id)])
            conn.execute(update(Worker).where(Worker.id == worker_id).values(
                last_heartbeat=now, status=WorkerStatus.ALIVE,
                stats_json=json.dumps(stats, separators=(",", ":")) if stats else None))
        worker.status = WorkerStatus.ALIVE
        worker.last_heartbeat = now
        for chunk_id in worker.leases & running:
            self.leases[chunk_id].deadline = now + self.lease_ttl_s
        return sorted(running - worker.leases)

    def retire_workers(self) -> None:
        """The coordinator stops: its workers exit with it (told done, or their leases void), so
        none is alive any more, whatever their last heartbeat said."""
        with self.engine.begin() as conn:
            conn.execute(update(Worker).where(Worker.rollout_id == self.rollout_id,
                                              Worker.status != WorkerStatus.GONE).values(status=WorkerStatus.GONE))
        for worker in self.workers.values():
            worker.status = WorkerStatus.GONE

    def _worker(self, worker_id: str) -> WorkerState:
        worker = self.workers.get(worker_id)
        if worker is None or worker.status == WorkerStatus.GONE:
            raise UnknownWorker(worker_id)
        return worker

    def known_worker(self, worker_id: str) -> bool:
        worker = self.workers.get(worker_id)
        return worker is not None and worker.status != WorkerStatus.GONE

    def live_workers(self) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.status == WorkerStatus.ALIVE]

    # ----------------------------------------------------------------- leasing
    def snapshot(self, worker_id: str, wanted: int, now: float) -> Snapshot:
        loads = tuple(WorkerLoad(w.id, w.rank, len(w.leases), w.kv_reserved, w.max_chunks, w.kv_capacity_tokens)
                      for w in self.live_workers())
        return Snapshot(now, worker_id, wanted, loads, self.queue, self.bindings, self.unfinished_groups,
                        self.chunk_tokens, self.growth.current)

    def lease(self, worker_id: str, wanted: int, now: float) -> list[ChunkGrant]:
        worker = self._worker(worker_id)
        if worker.status != WorkerStatus.ALIVE or not self.queue:
            return []
        plan = self.policy.plan(self.snapshot(worker_id, wanted, now))
        if not plan.assignments and not plan.new_bindings:
            return []
        leases: list[LeaseState] = []
        grants: list[ChunkGrant] = []
        deadline = now + self.lease_ttl_s
        with self.engine.begin() as conn:
            if plan.new_bindings:
                conn.execute(update(GROUPS).where(GROUPS.c.id == bindparam("gid")).values(
                    bound_worker=bindparam("worker")),
                    [{"gid": gid, "worker": w} for gid, w in plan.new_bindings.items()])
            reused, fresh = [], []
            for assignment in plan.assignments:
                request = self.requests[assignment.request_id]
                if assignment.worker_id != worker_id:
                    raise RuntimeError(f"policy {self.policy.name} assigned to another worker")
                if not 0 < assignment.max_tokens <= request.max_tokens - request.generated:
                    raise RuntimeError(f"policy gave request {request.id} an impossible budget {assignment.max_tokens}")
                check_transition(request.status, RequestStatus.RUNNING)
                if request.tokens is None:
                    request.tokens = self._read_tokens(conn, request.id)
                if request.open_chunk is not None:
                    chunk_id, epoch = request.open_chunk[0], request.open_chunk[1] + 1
                    reused.append({"cid": chunk_id, "mt": assignment.max_tokens})
                else:
                    chunk_id = conn.execute(insert(CHUNKS).values(
                        request_id=request.id, seq=request.num_chunks, max_tokens=assignment.max_tokens,
                        status=ChunkStatus.LEASED.value, lease_holder=worker_id, lease_deadline=deadline,
                        lease_epoch=1, attempt=1, created_at=now, leased_at=now, num_tokens=0)
                    ).inserted_primary_key[0]
                    epoch = 1
                    fresh.append(chunk_id)
                context = len(self.groups[request.group_id].prompt) + request.generated
                leases.append(LeaseState(chunk_id, request.id, worker_id, epoch, request.num_chunks,
                                         assignment.max_tokens, deadline, context + assignment.max_tokens))
            if reused:
                conn.execute(update(CHUNKS).where(CHUNKS.c.id == bindparam("cid")).values(
                    status=ChunkStatus.LEASED.value, max_tokens=bindparam("mt"), lease_holder=worker_id,
                    lease_deadline=deadline, lease_epoch=CHUNKS.c.lease_epoch + 1, attempt=CHUNKS.c.attempt + 1,
                    leased_at=now), reused)
            conn.execute(update(REQUESTS).where(REQUESTS.c.id == bindparam("rid")).values(
                status=RequestStatus.RUNNING.value, last_worker=worker_id), [{"rid": l.request_id} for l in leases])
            conn.execute(update(REQUESTS).where(REQUESTS.c.id == bindparam("rid"), REQUESTS.c.started_at.is_(None))
                         .values(started_at=now), [{"rid": l.request_id} for l in leases])
            conn.execute(insert(EVENTS), [
                _event(self.rollout_id, now, "chunk_leased", worker_id, l.request_id, l.chunk_id,
                       {"seq": l.seq, "epoch": l.epoch, "max_tokens": l.max_tokens}) for l in leases])
        # Committed: now the mirror follows.
        self.bindings.update(plan.new_bindings)
        for group_id, bound in plan.new_bindings.items():
            self.groups[group_id].bound_worker = bound
        if self.first_lease_at is None:
            self.first_lease_at = now
            self.first_lease_cpu = time.process_time()
        for lease in leases:
            request = self.requests[lease.request_id]
            self.queue.remove(request.id)
            request.status = RequestStatus.RUNNING
            request.open_chunk = None
            request.last_worker = worker_id
            self.leases[lease.chunk_id] = lease
            worker.leases.add(lease.chunk_id)
            worker.kv_reserved += lease.kv_reserved
            grants.append(self._grant(lease))
        return grants

    def _read_tokens(self, conn: Connection, request_id: int) -> array:
        tokens = array("i")
        for blob in conn.execute(select(CHUNKS.c.token_ids).where(
                CHUNKS.c.request_id == request_id, CHUNKS.c.status == ChunkStatus.DONE.value).order_by(CHUNKS.c.seq)
        ).scalars():
            tokens.extend(unpack_ints(blob))
        return tokens

    def _grant(self, lease: LeaseState) -> ChunkGrant:
        request = self.requests[lease.request_id]
        group = self.groups[request.group_id]
        sampling = dict(group.sampling)
        # A row's own seed still differs per response and chunk; otherwise the rollout's seed.
        base_seed = self.seed if sampling.get("seed") is None else int(sampling["seed"])
        sampling["seed"] = chunk_seed(base_seed, group.index, request.response_index, lease.seq)
        context = group.prompt.tolist()
        context.extend(request.tokens)
        target = self.worker_only_targets.get(request.id)
        return ChunkGrant(lease.chunk_id, lease.epoch, request.id, context, lease.max_tokens, sampling,
                          lease.deadline, None if target is None else target - request.generated,
                          group_id=request.group_id, prompt_len=len(group.prompt), is_probe=request.is_probe)

    # ----------------------------------------------------------------- reports
    def report(self, worker_id: str, report: ChunkReport, now: float) -> ReportOutcome:
        return self.report_many(worker_id, [report], now)[0]

    def report_many(self, worker_id: str, reports: Sequence[ChunkReport], now: float) -> list[ReportOutcome]:
        """Commit every acceptable report of one call in one transaction, then acknowledge."""
        self._worker(worker_id)
        outcomes: list[ReportOutcome | None] = [None] * len(reports)
        accepted: list[tuple[int, ChunkReport, LeaseState]] = []
        seen: set[int] = set()
        for i, report in enumerate(reports):
            lease = self.leases.get(report.chunk_id)
            if (lease is None or lease.epoch != report.epoch or lease.worker_id != worker_id
                    or report.chunk_id in seen):
                continue  # judged below, against the database
            self._validate(report, lease)
            seen.add(report.chunk_id)
            accepted.append((i, report, lease))
        chunk_rows, request_rows, events, effects = [], [], [], []
        group_updates: dict[int, list[int]] = {}  # group id -> [finished requests, estimate]
        for i, report, lease in accepted:
            request = self.requests[lease.request_id]
            n_tokens = len(report.token_ids)
            total = request.generated + n_tokens
            # A worker that stopped at the target but called it "length" must not get a 0-token chunk next.
            at_target = total == self.worker_only_targets.get(request.id)
            finished = (report.finish_reason in ("stop", "length_target") or total >= request.max_tokens
                        or n_tokens < lease.max_tokens  # a short "length": the model's context is full
                        or at_target)
            new_status = RequestStatus.FINISHED if finished else RequestStatus.QUEUED
            check_transition(request.status, new_status)
            finish_reason = ("length_target" if at_target and report.finish_reason == "length"
                             else report.finish_reason)
            chunk_rows.append({"cid": lease.chunk_id, "ep": lease.epoch, "fin": now, "n": n_tokens,
                               "tok": pack_ints(report.token_ids), "lp": pack_floats(report.logprobs),
                               "fr": report.finish_reason, "cached": report.cached_tokens})
            request_rows.append({"rid": request.id, "gen": total, "nc": request.num_chunks + 1,
                                 "st": new_status.value, "fr": finish_reason if finished else None,
                                 "fa": now if finished else None, "qa": request.queued_at if finished else now})
            events.append(_event(self.rollout_id, now, "chunk_done", worker_id, request.id, lease.chunk_id,
                                 {"tokens": n_tokens, "finish_reason": report.finish_reason,
                                  "cached_tokens": report.cached_tokens}))
            if finished:
                group = self.groups[request.group_id]
                update_ = group_updates.setdefault(group.id, [group.finished, group.estimate])
                update_[1] = updated_estimate(update_[0], update_[1], total)
                update_[0] += 1
                events.append(_event(self.rollout_id, now, "request_finished", worker_id, request.id, None,
                                     {"length": total, "finish_reason": finish_reason, "group_estimate": update_[1]}))
            effects.append((i, request, finished, lease, report.token_ids))
        group_rows = [{"gid": gid, "fr": done, "est": estimate, "fa": now if done == self.groups[gid].n else None}
                      for gid, (done, estimate) in group_updates.items()]
        if accepted:
            with self.engine.begin() as conn:
                result = conn.execute(update(CHUNKS).where(
                    CHUNKS.c.id == bindparam("cid"), CHUNKS.c.lease_epoch == bindparam("ep"),
                    CHUNKS.c.status == ChunkStatus.LEASED.value).values(
                    status=ChunkStatus.DONE.value, finished_at=bindparam("fin"), num_tokens=bindparam("n"),
                    token_ids=bindparam("tok"), logprobs=bindparam("lp"), finish_reason=bindparam("fr"),
                    cached_tokens=bindparam("cached"), lease_deadline=None), chunk_rows)
                if result.rowcount != len(chunk_rows):  # mirror and database disagree: refuse, never double count
                    raise RuntimeError(f"{len(chunk_rows) - result.rowcount} reported chunks are not leased "
                                       "in the database")
                conn.execute(update(REQUESTS).where(REQUESTS.c.id == bindparam("rid")).values(
                    generated_tokens=bindparam("gen"), num_chunks=bindparam("nc"), status=bindparam("st"),
                    finish_reason=bindparam("fr"), finished_at=bindparam("fa"), queued_at=bindparam("qa")),
                    request_rows)
                if group_rows:
                    conn.execute(update(GROUPS).where(GROUPS.c.id == bindparam("gid")).values(
                        finished_requests=bindparam("fr"), length_estimate=bindparam("est"),
                        finished_at=bindparam("fa")), group_rows)
                conn.execute(insert(EVENTS), events)
        # Committed: now the mirror follows.
        worker = self.workers[worker_id]
        for i, request, finished, lease, token_ids in effects:
            del self.leases[lease.chunk_id]
            worker.leases.discard(lease.chunk_id)
            worker.kv_reserved -= lease.kv_reserved
            self.output_tokens += len(token_ids)
            request.generated += len(token_ids)
            request.num_chunks += 1
            if self.on_committed_tokens is not None:  # e.g. the grouped draft server's copy
                self.on_committed_tokens(request.group_id, request.id, request.generated - len(token_ids), token_ids)
            if finished:
                request.status = RequestStatus.FINISHED
                request.tokens = None  # durable in the database; the coordinator needs them no more
                self.finished_requests += 1
                self.groups[request.group_id].finished_lengths.append(request.generated)
                if self.on_request_finished is not None:
                    self.on_request_finished(request.group_id, request.id)
            else:
                request.tokens.extend(token_ids)
                request.status = RequestStatus.QUEUED
                request.queued_at = now
            outcomes[i] = ReportOutcome(True, request_finished=finished)
        for gid, (done, estimate) in group_updates.items():
            group = self.groups[gid]
            group.finished, group.estimate = done, estimate
            if done >= group.n:
                self.unfinished_groups.pop(gid, None)
                if self.on_group_finished is not None:
                    self.on_group_finished(gid)
                self.growth.observe_completed(group.finished_lengths)
        # The queue's views carry their group's estimate and progress: refresh those that changed.
        for gid in {request.group_id for _, request, _, _, _ in effects}:
            group = self.groups[gid]
            longest = self._longest_unfinished(group)
            for rid in group.request_ids:
                request = self.requests[rid]
                if request.status == RequestStatus.QUEUED:
                    fresh = self._queued_view(request, longest)
                    if rid not in self.queue or fresh != self.queue.get(rid):
                        self.queue.put(fresh)
        for i, report in enumerate(reports):
            if outcomes[i] is None:
                outcomes[i] = self._judge_unleased(worker_id, report)
        return outcomes

    def _validate(self, report: ChunkReport, lease: LeaseState) -> None:
        if report.finish_reason not in FINISH_REASONS:
            raise BadReport(f"finish_reason must be one of {sorted(FINISH_REASONS)}, got {report.finish_reason!r}")
        if len(report.logprobs) != len(report.token_ids):
            raise BadReport(f"{len(report.token_ids)} token ids but {len(report.logprobs)} logprobs")
        if len(report.token_ids) > lease.max_tokens:
            raise BadReport(f"{len(report.token_ids)} tokens exceed the chunk budget {lease.max_tokens}")
        if not report.token_ids and report.finish_reason != "stop":
            raise BadReport("an empty chunk must end with finish_reason 'stop'")
        target = self.worker_only_targets.get(lease.request_id)
        total = self.requests[lease.request_id].generated + len(report.token_ids)
        if target is not None and total > target:
            raise BadReport(f"{total} tokens pass the response's target length {target}")
        if report.finish_reason == "length_target" and target is None:
            raise BadReport("finish_reason 'length_target' for a request without a target length")
        if report.finish_reason == "length_target" and total != target:
            raise BadReport(f"finish_reason 'length_target' at {total} tokens, but the target is {target}")

    def _judge_unleased(self, worker_id: str, report: ChunkReport) -> ReportOutcome:
        """A report without a matching live lease: a harmless duplicate, or stale and rejected."""
        with self.engine.connect() as conn:
            chunk = conn.execute(select(CHUNKS.c.status, CHUNKS.c.lease_epoch, CHUNKS.c.lease_holder)
                                 .where(CHUNKS.c.id == report.chunk_id)).first()
        if chunk is None:
            return ReportOutcome(False, reason=f"unknown chunk {report.chunk_id}")
        if (chunk.status == ChunkStatus.DONE.value and chunk.lease_epoch == report.epoch
                and chunk.lease_holder == worker_id):
            return ReportOutcome(True, duplicate=True)
        return ReportOutcome(False, reason=(
            f"stale lease: chunk {report.chunk_id} is {chunk.status} at epoch {chunk.lease_epoch}, "
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
            with self.engine.begin() as conn:
                for worker in silent:
                    check_transition(worker.status, WorkerStatus.STALE)
                    conn.execute(update(Worker).where(Worker.id == worker.id).values(status=WorkerStatus.STALE))
                conn.execute(insert(EVENTS), [_event(self.rollout_id, now, "worker_stale", w.id) for w in silent])
            for worker in silent:
                worker.status = WorkerStatus.STALE
        if expired:
            self._expire(expired, now, kind="lease_expired")
        return len(expired)

    def _expire(self, leases: list[LeaseState], now: float, *, kind: str, reason: str | None = None) -> None:
        for lease in leases:
            check_transition(self.requests[lease.request_id].status, RequestStatus.QUEUED)
        with self.engine.begin() as conn:
            self._write_requeue(conn, [(l.chunk_id, l.request_id, l.worker_id, l.epoch) for l in leases], now,
                                kind=kind, reason=reason)
        for lease in leases:
            del self.leases[lease.chunk_id]
            worker = self.workers.get(lease.worker_id)
            if worker is not None:
                worker.leases.discard(lease.chunk_id)
                worker.kv_reserved -= lease.kv_reserved
            request = self.requests[lease.request_id]
            request.status = RequestStatus.QUEUED
            request.open_chunk = (lease.chunk_id, lease.epoch)
            self._enqueue(request)  # keeps its place: queued_at is when it first waited for this chunk

    # ----------------------------------------------------------------- progress
    def counts(self) -> dict[str, int]:
        return {
            "requests_total": len(self.requests),
            "requests_done": self.finished_requests,
            "groups_total": len(self.groups),
            "groups_done": len(self.groups) - len(self.unfinished_groups),
            "leases": len(self.leases),
            "output_tokens": self.output_tokens,
            "workers_alive": len(self.live_workers()),
        }

    def queued_longest(self, limit: int, after: WaitingRequest | None = None) -> list[WaitingRequest]:
        """Up to `limit` requests waiting in the queue, queued longest first (ties by request id),
        those after `after` only when given. Only requests that have run on a worker: the others
        hold no blocks of their own in the KV pool. Leased (running) requests are never queued."""
        start = None if after is None else (after.queued_at, after.request_id)
        waiting = []
        for queued in self.queue.fcfs(start):
            if len(waiting) == limit:
                break
            if queued.last_worker is not None:
                waiting.append(WaitingRequest(queued.group_id, queued.request_id, queued.queued_at))
        return waiting

    def is_complete(self) -> bool:
        return self.finished_requests == len(self.requests)

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
