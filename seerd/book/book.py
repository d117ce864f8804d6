"""The lease book: the scheduler's state (`SchedulerState`) with persistence and liveness.

The coordinator's one owner of rollout state. What policies plan over (queue, estimates, growth,
loads, bindings) lives in `self.state`, the very object the simulator drives; the book adds what
only a real run has: SQLite, lease epochs and deadlines, heartbeats, prompts and tokens for
grants, target lengths. Every mutation happens in one method, in one `BEGIN IMMEDIATE`
transaction, every status write through `seerd/db/transitions.py`, and the in-memory state
changes only after that transaction commits (leases: as each is written, the commit last for
all of one `leasing` block). A worker's report is acknowledged (the method
returns) only after its durable commit, so every token is either durable or was never
acknowledged; what a restarted coordinator redoes anyway (leases, registrations, expiries,
heartbeats, forecasts) commits without waiting for the disk (`db.base.begin`).
Callers pass `now`: lease expiry is tested by moving time, never by sleeping.

Target lengths (benchmark rows) are kept apart from everything the scheduler sees: the book
holds them in `worker_only_targets`, read only to tell a worker where to stop
(`ChunkGrant.target_remaining`) and to check its report.

The report methods are a section of their own (`book_reports.BookReports`, inherited).

Hot paths (lease, report) use Core statements with executemany and keep prompts and the tokens
of unfinished requests in memory; the ORM models still define the schema.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from seerd.book.leases import grant_leases, write_leases
from seerd.book.listeners import BookListeners
from seerd.book.liveness import WorkerLiveness, chunk_failed
from seerd.book.report_calls import BookReports
from seerd.book.records import (
    BookBroken, Failure, GroupInputs, RequestProgress, Requeue, RetiredWorker, UnknownWorker,
)
from seerd.book.saved import read_saved_rollout
from seerd.cpu import CpuSnapshot
from seerd.db import ChunkStatus, Connection, Engine, RolloutStatus, Session, WorkerStatus, queries, sessionmaker
from seerd.db.base import Writer
from seerd.db.event import event_row
from seerd.protocol import ChunkGrant, EngineProgress
from seerd.scheduler.state import FIRST_CHUNK_SPREAD, SchedulerState
from seerd.scheduler.views import Policy

# Failed chunks of one request before the request ends failed (a poison request: every engine
# refuses it, or its output is never right). The retries go to other workers' engines where there are.
MAX_FAILED_ATTEMPTS = 3
# Groups whose forecast the daemon's tick works out and writes per call (`persist_soft_state`):
# a new growth table makes every unfinished group's due at once, 12,500 at 100,000 requests:
# 0.1-0.3 s of one state-thread turn, every call queued behind it (tools/bench/load.py).
FORECASTS_PER_TICK = 2048


class LeaseBook(BookReports):
    def __init__(self, sessions: sessionmaker[Session], rollout_id: int, policy: Policy,
                 *, chunk_tokens: int, lease_ttl_s: float, seed: int, vocab_size: int,
                 in_place: bool = False, first_chunk_spread: float = FIRST_CHUNK_SPREAD,
                 rekey_in_place: bool = False) -> None:
        self.sessions = sessions
        self.engine: Engine = sessions.kw["bind"]
        self.writer = Writer(self.engine)  # every write transaction of the book, on a kept connection
        self.rollout_id = rollout_id
        self.policy = policy
        self.lease_ttl_s = lease_ttl_s
        self.seed = seed
        self.vocab_size = vocab_size  # the model's: a reported token id outside it is rejected
        self.in_place = in_place  # grants may run on past their budget (`report_and_continue`)
        # The queue's orders are re-keyed for a new growth table on a thread of their own while
        # the previous order serves (`RequestQueue`): in place, each held the state thread 0.1-0.2 s
        # at 100,000 queued requests. `rekey_in_place`: as the simulator does (tests that compare).
        self._rekeys = ThreadPoolExecutor(max_workers=1, thread_name_prefix="seerd-rekey")
        self.state = SchedulerState(chunk_tokens=chunk_tokens, first_chunk_spread=first_chunk_spread,
                                    rekey_aside=None if rekey_in_place else self._rekeys.submit)
        self.inputs: dict[int, GroupInputs] = {}  # group id ->
        self.progress: dict[int, RequestProgress] = {}  # request id ->
        self.workers: dict[str, WorkerLiveness] = {}
        self.unwritten_heartbeats: dict[str, dict] = {}  # worker id -> its last heartbeat (time, figures)
        self._revoked_unannounced = 0  # requests re-queued by taking workers out, until `expire` tells
        # request_id -> target length; never part of the scheduler's state (module docstring).
        self.worker_only_targets: dict[int, int] = {}
        self.first_lease_at: float | None = None  # this session's; generation starts here
        self.first_lease_cpu: CpuSnapshot | None = None  # this process's CPU time then
        self.broken: str | None = None  # why the book refuses every change (`BookBroken`)
        self.reports_synced_later = False  # True: the caller fsyncs reports before acknowledging (wal_sync)
        self.completed_at: float | None = None  # the report that finished the last request; generation ends
        self.completed_cpu: CpuSnapshot | None = None  # this process's CPU time then (the export comes after)
        self.listeners = BookListeners()  # the draft server's, the KV pool's, a serve's dispatch

    @property
    def chunk_tokens(self) -> int:
        return self.state.chunk_tokens

    def close(self) -> None:
        """Give back the connections the book keeps for its writes (`db.base.Writer`), its re-key thread."""
        self.writer.close()
        self._rekeys.shutdown(wait=False, cancel_futures=True)

    # ----------------------------------------------------------------- loading
    def load(self, now: float) -> None:
        """Read the rollout from the database; leases of a previous coordinator go back to the queue."""
        with self.writer.begin(durable=True) as conn:
            saved = read_saved_rollout(conn, self.rollout_id)
            self.inputs.update(saved.inputs)
            self.progress.update(saved.progress)
            self.worker_only_targets = saved.targets
            orphaned = [Requeue(c.id, c.request_id, c.lease_holder, c.lease_epoch)
                        for c in saved.unfinished_chunks if c.status == ChunkStatus.LEASED]
            self._write_requeue(conn, orphaned, now, kind="lease_orphaned")
            self._retire_all(conn)
        self.state.load(saved.groups, saved.requests, saved.finish_order, saved.bindings)
        for chunk in saved.unfinished_chunks:
            self.progress[chunk.request_id].open_chunk = (chunk.id, chunk.lease_epoch)
        prepare = getattr(self.policy, "prepare", None)  # what its first plan would build (`SeerPolicy.prepare`)
        if prepare is not None:
            prepare(self.state.snapshot("", 0, now))

    def _write_requeue(self, conn: Connection, chunks: Sequence[Requeue], now: float,
                       *, kind: str, reason: str | None = None) -> None:
        """Chunks go from LEASED back to QUEUED, their requests from RUNNING, in the caller's transaction."""
        if not chunks:
            return
        queries.chunks.requeue(conn, [(c.chunk_id, c.epoch) for c in chunks])
        queries.requests.requeue(conn, [c.request_id for c in chunks])
        queries.events.append(conn, [event_row(self.rollout_id, now, kind, c.holder, c.request_id, c.chunk_id,
                                               {"epoch": c.epoch, **({"reason": reason} if reason else {})})
                                     for c in chunks])

    # ----------------------------------------------------------------- workers
    def register(self, *, rank: int, address: str, max_chunks: int, kv_capacity_tokens: int,
                 worker_id: str, now: float, kv_block_tokens: int = 1, weights_version: str = "",
                 weights_loaded_s: float = 0.0, dtype: str = "") -> WorkerLiveness:
        with self.writer.begin(durable=False) as conn:
            if queries.workers.exists(conn, worker_id):
                # Same id again (a restarted coordinator, a worker back from a partition): a new
                # identity, so reports of its old leases can never pass as the new one's.
                worker_id = f"{worker_id}+{int(now * 1000)}"
            queries.workers.insert_alive(conn, {
                "id": worker_id, "rollout_id": self.rollout_id, "rank": rank, "address": address,
                "max_chunks": max_chunks, "kv_capacity_tokens": kv_capacity_tokens, "registered_at": now,
                "last_heartbeat": now})
            queries.events.append(conn, [event_row(
                self.rollout_id, now, "worker_registered", worker_id,
                data={"rank": rank, "address": address, "max_chunks": max_chunks,
                      "kv_capacity_tokens": kv_capacity_tokens, "kv_block_tokens": kv_block_tokens,
                      "weights_version": weights_version, "weights_loaded_s": weights_loaded_s,
                      "dtype": dtype})])
        self.state.add_worker(worker_id, rank=rank, max_chunks=max_chunks, kv_capacity_tokens=kv_capacity_tokens,
                              kv_block_tokens=kv_block_tokens)
        worker = self.workers[worker_id] = WorkerLiveness(worker_id, WorkerStatus.ALIVE, now, now)
        return worker

    def heartbeat(self, worker_id: str, running: Iterable[int], now: float, stats: dict | None = None,
                  engine: EngineProgress | None = None) -> list[int]:
        """Extend the leases the worker still runs, when its engine shows progress (`liveness.py`);
        return the chunks it must abort. `stats` (seerd/worker/stats.py): kept for `seerd status`."""
        worker = self._worker(worker_id)
        running = set(running)
        figures = {"last_heartbeat": now, "stats": stats}  # encoded when written: most are overwritten first
        if worker.status == WorkerStatus.STALE:
            with self.writer.begin(durable=False) as conn:
                queries.workers.revive(conn, worker_id, now=now, stats=stats)
                queries.events.append(conn, [event_row(self.rollout_id, now, "worker_alive", worker_id)])
            self.unwritten_heartbeats.pop(worker_id, None)
        else:  # soft state: written with the next `persist_soft_state`, not one commit per heartbeat
            self.unwritten_heartbeats[worker_id] = figures
        worker.status = WorkerStatus.ALIVE
        self.state.set_live(worker_id, True)
        held = self.state.workers[worker_id].chunks
        if worker.observe(engine, bool(held & running), now):
            deadline = now + worker.stall_bound(self.lease_ttl_s)
            for chunk_id in held & running:
                self.state.leases[chunk_id].deadline = deadline
        return sorted(running - held)

    def retire_workers(self) -> None:
        """The coordinator stops: its workers exit with it (told done, or their leases void), so
        none is alive any more, whatever their last heartbeat said. Their last figures (the
        goodbye heartbeat among them) are written first: they are what status shows from now on."""
        self.persist_soft_state()
        with self.writer.begin(durable=True) as conn:
            self._retire_all(conn)
        for worker in self.workers.values():
            worker.status = WorkerStatus.GONE
            self.state.set_live(worker.id, False)

    def _retire_all(self, conn: Connection) -> None:
        """Every worker row of the rollout that is not gone becomes gone (in the caller's transaction)."""
        queries.workers.retire(conn, queries.workers.not_gone(conn, self.rollout_id))

    def _worker(self, worker_id: str) -> WorkerLiveness:
        worker = self.workers.get(worker_id)
        if worker is not None and worker.retired is not None:
            raise RetiredWorker(worker_id, worker.retired)
        if worker is None or worker.status == WorkerStatus.GONE:
            raise UnknownWorker(worker_id)
        return worker

    def retired_reason(self, worker_id: str) -> str | None:
        worker = self.workers.get(worker_id)
        return None if worker is None else worker.retired

    def _retire(self, workers: Sequence[WorkerLiveness], now: float, reason_of: Callable[[WorkerLiveness], str]) -> None:
        """Take workers out: gone, their leases back to the queue, told why at their next call."""
        reasons = {w.id: reason_of(w) for w in workers}
        ending = self._ending([cid for w in workers for cid in self.state.workers[w.id].chunks])
        with self.writer.begin(durable=False) as conn:
            queries.workers.retire(conn, {status: [w.id for w in workers if w.status == status]
                                          for status in (WorkerStatus.ALIVE, WorkerStatus.STALE)})
            queries.events.append(conn, [event_row(self.rollout_id, now, "worker_retired", w.id,
                                                   data={"reason": reasons[w.id]}) for w in workers])
            self._write_requeue(conn, ending, now, kind="lease_revoked", reason="worker retired")
        self._forget_leases(ending)
        self._revoked_unannounced += len(ending)  # told to the daemon by the next `expire`
        for worker in workers:
            worker.status, worker.retired = WorkerStatus.GONE, reasons[worker.id]
            self.state.set_live(worker.id, False)

    def known_worker(self, worker_id: str) -> bool:
        worker = self.workers.get(worker_id)
        return worker is not None and worker.status != WorkerStatus.GONE

    @property
    def live_count(self) -> int:
        """Live workers now: what their heartbeat interval follows (`protocol.heartbeat_interval`)."""
        return self.state.live_count

    def live_workers(self) -> list[WorkerLiveness]:
        return [w for w in self.workers.values() if w.status == WorkerStatus.ALIVE]

    # ----------------------------------------------------------------- leasing
    def lease(self, worker_id: str, wanted: int, now: float, *,
              continuing: Collection[int] = ()) -> list[ChunkGrant]:
        """Up to `wanted` chunks for `worker_id`, as its policy plans them. `continuing`: requests whose
        engine requests run on here (`report_and_continue`): their grants continue them in place."""
        (grants,) = self.lease_calls([(worker_id, wanted, continuing)], now)
        if isinstance(grants, UnknownWorker):
            raise grants
        return grants

    def lease_calls(self, calls: Sequence[tuple[str, int, Collection[int]]], now: float
                    ) -> list[list[ChunkGrant] | UnknownWorker]:
        """`lease` for each (worker, wanted, continuing) in turn, in one transaction (`leasing`)."""
        with self.leasing(now) as lease:
            return [lease(worker_id, wanted, continuing) for worker_id, wanted, continuing in calls]

    @contextlib.contextmanager
    def leasing(self, now: float) -> Iterator[Callable[..., list[ChunkGrant] | UnknownWorker]]:
        """Leases in one transaction, committed as the block ends (one each was a fifth of the state
        thread at 1,000 workers: py-spy, tools/bench/load.py). Yields `lease(worker_id, wanted,
        continuing=())`: the grants, or the `UnknownWorker` its worker is; hand them out only after
        the block. Each plan sees the leases before it, applied as written: a write failing after
        one was applied leaves the book ahead of the database (`BookBroken`). An error in the
        block rolls every lease of it back."""
        self.refuse_if_broken()
        applied = False
        with contextlib.ExitStack() as transaction:
            conn: Connection | None = None  # begun by the first lease that plans

            def lease(worker_id: str, wanted: int, continuing: Collection[int] = ()) -> list[ChunkGrant] | UnknownWorker:
                nonlocal applied, conn
                self.refuse_if_broken()
                try:
                    worker = self._worker(worker_id)
                except UnknownWorker as exc:
                    return exc
                # A call that asks for nothing gets nothing, whatever the policy would hand out.
                if wanted <= 0 or not len(self.state.queue) or worker.status != WorkerStatus.ALIVE:
                    return []
                if conn is None:
                    conn = transaction.enter_context(self.writer.begin(durable=False))
                grants = self._lease_in(conn, worker_id, wanted, now, continuing)
                applied = applied or grants is not None
                return grants or []

            try:
                yield lease
                transaction.close()  # the commit, inside the try: a failed one breaks the book too
            except Exception as exc:
                if applied:
                    self.broken = f"a lease transaction failed after its leases were applied: {exc!r}"
                    raise BookBroken(self.broken) from exc
                raise

    def stop_for(self, reason: str) -> None:
        """Refuse every change from now on (`BookBroken`): the run resumes from its database."""
        self.broken = self.broken or reason

    def refuse_if_broken(self) -> None:
        if self.broken is not None:
            raise BookBroken(self.broken)

    def _lease_in(self, conn: Connection, worker_id: str, wanted: int, now: float,
                  continuing: Collection[int]) -> list[ChunkGrant] | None:
        """One lease in the caller's transaction (`leasing`): its grants, None if it changed nothing."""
        plan = self.policy.plan(self.state.snapshot(worker_id, wanted, now, frozenset(continuing)))
        if not plan.assignments and not plan.new_bindings:
            return None
        self.state.check_plan(plan, worker_id)
        deadline = now + self.lease_ttl_s
        chunk_ids, epochs = write_leases(conn, self.rollout_id, self.progress, worker_id, plan, now, deadline,
                                         continuing)
        leases = self.state.apply_leases(worker_id, plan, chunk_ids)  # before the commit: `leasing`
        if self.first_lease_at is None:
            self.first_lease_at = now
            self.first_lease_cpu = CpuSnapshot.now()
        return grant_leases(self, leases, epochs, deadline, continuing)

    def release(self, worker_id: str, chunk_id: int, epoch: int, reason: str, now: float,
                *, failed: bool = False) -> bool:
        """A worker gives a chunk back: unrun (shutdown), it runs again elsewhere; `failed` by its
        engine, it is a failed chunk (`_write_failure`)."""
        lease = self.state.leases.get(chunk_id)
        if lease is None or lease.epoch != epoch or lease.worker_id != worker_id:
            return False
        if not failed:
            self._end_leases([chunk_id], now, kind="lease_released", reason=reason)
            return True
        with self.writer.begin(durable=False) as conn:
            failure = self._write_failure(conn, chunk_id, reason, now)
        self._apply_failure(failure)
        return True

    def _write_failure(self, conn: Connection, chunk_id: int, reason: str, now: float,
                       *, kind: str = "chunk_failed") -> Failure:
        """A leased chunk failed (its engine refused it, or its report was rejected), in the
        caller's transaction. It counts toward its request's `MAX_FAILED_ATTEMPTS`: before that,
        the chunk goes back to be leased again, on another worker's engine where there is one
        (`base.failed_here`); at that, the request ends `failed` with `reason`."""
        lease = self.state.leases[chunk_id]
        attempts = self.progress[lease.request_id].failed_attempts + 1
        failure = Failure(Requeue(chunk_id, lease.request_id, lease.worker_id, lease.epoch), attempts,
                           attempts >= MAX_FAILED_ATTEMPTS)
        if failure.fatal:
            queries.chunks.fail(conn, chunk_id, now)
            queries.requests.fail(conn, lease.request_id, attempts=attempts, error=reason, now=now)
            queries.events.append(conn, [event_row(self.rollout_id, now, "request_failed", lease.worker_id,
                                                   lease.request_id, chunk_id, {"reason": reason, "attempts": attempts})])
        else:
            self._write_requeue(conn, [failure.lease], now, kind=kind, reason=reason)
            queries.requests.set_failed_attempts(conn, lease.request_id, attempts)
        return failure

    def _apply_failure(self, failure: Failure) -> None:
        """After the commit of `_write_failure`: the state and the book follow."""
        lease = failure.lease
        self.state.fail_chunk(lease.chunk_id, request_failed=failure.fatal)
        if lease.holder in self.workers:
            chunk_failed(self.workers[lease.holder], lease.request_id)
        progress = self.progress[lease.request_id]
        progress.failed_attempts = failure.attempts
        if not failure.fatal:
            progress.open_chunk = (lease.chunk_id, lease.epoch)
            return
        progress.tokens = None
        request = self.state.requests[lease.request_id]
        self.listeners.request_done(request.group_id, request.id)  # ended: listeners forget it
        if request.group_id not in self.state.unfinished_groups:  # and its group once all ended
            self.listeners.group_done(request.group_id)

    # ----------------------------------------------------------------- expiry
    def expire(self, now: float) -> int:
        """Stuck workers are taken out (`coordinator.liveness`), leases past their deadline go back
        to the queue, silent workers become stale. Returns how many requests went back to the
        queue since the last call: leases expired here, and those of workers taken out here or by
        a report since (the daemon's tick hands them to the waiting lease calls; counting only the
        expired ones left a stuck worker's requests unseen by the waiting calls until their polls
        ended)."""
        self.refuse_if_broken()
        stuck = {w.id: why for w in self.live_workers()
                 if (why := w.stuck(bool(self.state.workers[w.id].chunks), now, self.lease_ttl_s))}
        if stuck:
            self._retire([self.workers[wid] for wid in stuck], now, lambda w: stuck[w.id])
        expired = [chunk_id for chunk_id, lease in self.state.leases.items() if lease.deadline < now]
        silent = [w for w in self.live_workers() if now - w.last_heartbeat > self.lease_ttl_s]
        if silent:
            with self.writer.begin(durable=False) as conn:
                queries.workers.mark_stale(conn, [w.id for w in silent])
                queries.events.append(conn, [event_row(self.rollout_id, now, "worker_stale", w.id) for w in silent])
            for worker in silent:
                worker.status = WorkerStatus.STALE
                self.state.set_live(worker.id, False)
        if expired:
            self._end_leases(expired, now, kind="lease_expired")
        requeued, self._revoked_unannounced = len(expired) + self._revoked_unannounced, 0
        return requeued

    def _end_leases(self, chunk_ids: list[int], now: float, *, kind: str, reason: str | None = None) -> None:
        ending = self._ending(chunk_ids)
        with self.writer.begin(durable=False) as conn:
            self._write_requeue(conn, ending, now, kind=kind, reason=reason)
        self._forget_leases(ending)

    def _ending(self, chunk_ids: list[int]) -> list[Requeue]:
        leases = self.state.leases
        return [Requeue(cid, leases[cid].request_id, leases[cid].worker_id, leases[cid].epoch) for cid in chunk_ids]

    def _forget_leases(self, ending: list[Requeue]) -> None:
        """After the commit of `_write_requeue`: the state and the book follow."""
        self.state.return_leases([lease.chunk_id for lease in ending])
        for lease in ending:
            self.progress[lease.request_id].open_chunk = (lease.chunk_id, lease.epoch)

    # ----------------------------------------------------------------- progress
    def counts(self) -> dict[str, int]:
        state = self.state
        return {
            "requests_total": len(state.requests),
            "requests_done": state.finished_requests,
            "groups_total": len(state.groups),
            "groups_done": len(state.groups) - len(state.unfinished_groups),
            "leases": len(state.leases),
            "output_tokens": state.output_tokens,
            "workers_alive": len(self.live_workers()),
        }

    def is_complete(self) -> bool:
        return self.state.is_complete()

    def persist_soft_state(self, forecasts_limit: int | None = None) -> int:
        """Write what `seerd status` reads but no acknowledgement depends on, as it changed since
        the last call: the groups' forecasts (the coordinator's own figure, so status need not
        import the scheduler) and the workers' last heartbeats (time and figures). Called on the
        daemon's tick in one commit that does not wait for the disk (`db.base.begin`), not on
        the hot path: a forecast depends on the state after a report's commit, and a figure half
        a second old costs no commit per heartbeat. At most `forecasts_limit` groups' forecasts
        a call (None: every one due; the tick passes `FORECASTS_PER_TICK`). Returns the rows written."""
        changed = self.state.take_forecasts(forecasts_limit)
        heartbeats, self.unwritten_heartbeats = self.unwritten_heartbeats, {}
        if changed or heartbeats:
            with self.writer.begin(durable=False) as conn:
                queries.groups.set_forecasts(conn, changed)
                queries.workers.set_figures(conn, heartbeats)
        return len(changed) + len(heartbeats)

    def set_rollout_status(self, status: RolloutStatus, now: float, reason: str | None = None) -> None:
        with self.writer.begin(durable=True) as conn:
            current, started_at = queries.rollouts.status_and_start(conn, self.rollout_id)
            if current == status:
                return
            values: dict = {"status_reason": reason}
            if status == RolloutStatus.RUNNING and started_at is None:
                values["started_at"] = now
            if status == RolloutStatus.FINISHED:
                values["finished_at"] = now
            queries.rollouts.change(conn, self.rollout_id, current, status, **values)
            queries.events.append(conn, [event_row(self.rollout_id, now, f"rollout_{status.value}",
                                                   data={"reason": reason})])
