"""The coordinator's state thread and what the API needs from the daemon (`CoordinatorControl`).

Every call into the lease book runs on one thread: the book has a single owner, its transactions
never interleave, and a commit's fsync never blocks the event loop that parses the workers'
requests. Calls that queue while the thread is busy run in one turn of it (`run`, `join`); lease
calls that queue together share one transaction (`lease`), report calls one durable group commit
(`report`); the line of long-polling lease calls is served there as work is queued (`work_queued`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import NamedTuple

from seerd.book.book import LeaseBook, UnknownWorker
from seerd.book.records import ReportCall
from seerd.book.report_rules import ReportOutcome
from seerd.cpu import Laps, ThreadClock
from seerd.db.base import CommitTimes
from seerd.db.wal_sync import WalSyncer
from seerd.protocol import ChunkGrant
from seerd.server.latency import CallLatencies, PlansPerCall, SlowTurns
from seerd.server.waiting import LeaseLine

log = logging.getLogger(__name__)


class CoordinatorControl:
    """What the API needs from the daemon besides the book: whether to hand out work at all, and
    the state thread.

    Every call into the lease book runs on one dedicated thread (`run`): the book stays single-
    owner, and a commit's fsync (milliseconds on a loaded disk) never blocks the event loop that
    parses the other workers' requests. Report calls are committed in groups (`report`), lease
    calls queued together in one transaction (`lease`).
    """

    def __init__(self, book: LeaseBook | None = None, *, clock: Callable[[], float] = time.time,
                 scheduling_gate: Callable[[], bool] = lambda: True) -> None:
        """`book`: the lease book the API's calls go to (None: a control for the state thread alone,
        as `seerd serve` keeps between batches); `scheduling_gate`: whether leases may be handed out
        yet (e.g. `group` waits for every worker)."""
        self.book = book
        self.clock = clock
        self._state_clock: ThreadClock | None = None  # the state thread's CPU and run-queue wait
        self._state_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="seerd-state",
                                                initializer=self._open_state_clock)
        # Status snapshots read for other hosts (`seerd status` of a run on a network filesystem):
        # never on the state thread, and one at a time however many watch.
        self._reader_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="seerd-reader")
        self.accepting = True  # false while draining (shutdown, preemption)
        self.scheduling_gate = scheduling_gate
        self.worker_stats: dict[str, dict] = {}
        self.told_done: set[str] = set()  # workers that have heard the rollout is complete
        self.left: set[str] = set()  # workers that said goodbye (`HeartbeatBody.leaving`) with their final figures
        self.busy_s = 0.0  # wall time inside API calls (overlapping calls count twice)
        self.calls = 0
        self.latencies = CallLatencies()  # the coordinator's own answer times (long-poll waits out)
        # The state thread's turns: how long the oldest call of each waited for it, how long the
        # turn ran, and how many calls it held ("reports": group commits; "calls": the rest).
        self.turns = CallLatencies()
        self.largest_turn = {"reports": 0, "calls": 0}
        self.slow_turns = SlowTurns()  # what the slowest turns held, call by call
        # Seconds of the state thread's turns, by kind: [wall, its CPU, waiting for a core], and
        # the times it was put on a core in them (each after blocking or being preempted). What
        # is left of the wall it was blocked: on the GIL, which the event loop shares.
        self.turn_seconds = {"reports": [0.0, 0.0, 0.0, 0], "calls": [0.0, 0.0, 0.0, 0]}
        self.lease_plans = PlansPerCall()  # plans made for each lease call (long polls planned for in vain)
        self._calls_since = self._reports_since = 0.0  # when the oldest queued call was queued
        self.refused: dict[str, int] = {}  # calls refused by the signature check (auth.py), by reason
        # Lease calls long-polling for work (`work_queued` serves them with the book's leases).
        self.line = LeaseLine(book.state.room_for) if book is not None else LeaseLine()
        # Work queued since the state thread last served the line: how many requests, the
        # shortest context among them, and when the first of them was queued.
        self._owed = 0
        self._owed_context = NO_CONTEXT
        self._owed_since = 0.0
        # Waiting for the next group commit: each call, its answer, and when it was queued.
        self._reports: list[tuple[ReportCall, asyncio.Future, float]] = []
        self._reports_lock = threading.Lock()  # the loop appends, the state thread takes
        self._commit_queued = False
        self._calls: list[tuple[Callable[[], object] | QueuedLease, asyncio.Future]] = []  # other calls (`run`, `lease`)
        self._joins: collections.deque[tuple[Callable[[], object], asyncio.Future]] = collections.deque()  # (`join`)
        self._calls_lock = threading.Lock()  # guards both lists and the flag
        self._calls_queued = False  # a `_run_calls` is submitted and has not taken its calls yet
        self._joins_passed = 0  # turns in a row that ended with joins waiting, for calls queued meanwhile
        self.report_commits = 0  # group commits of report calls, and the calls they held
        self.reports_committed = 0
        # Set by the daemon (with `LeaseBook.reports_synced_later`): report answers wait for its
        # fsync of the WAL, which runs while the state thread goes on (`_commit_reports`).
        self.wal_syncer: WalSyncer | None = None

    @contextlib.contextmanager
    def _leasing_for_waiting(self) -> Iterator[Callable[[str, int], object]]:
        """The book's leases of one transaction for the waiting calls (`LeaseLine.serve`), none
        while the coordinator hands out no work or the rollout is complete."""
        book = self.book
        if book is None:
            yield lambda _worker_id, _wanted: []
            return
        with book.leasing(self.clock()) as lease:
            yield lambda worker_id, wanted: (
                lease(worker_id, wanted) if self.accepting and not book.is_complete() else [])

    async def run(self, fn, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201
        """Run `fn` on the state thread and wait for it without blocking the loop. Calls that
        queue while the state thread is busy run in one turn of it and are answered with one
        wake-up of the loop: a hand-over each (an executor future, a self-pipe write) was a
        tenth of the loop's CPU with 512 workers (py-spy, tools/bench/load.py)."""
        return await self._queued(partial(fn, *args, **kwargs), joining=False)

    async def lease(self, book: LeaseBook, worker_id: str, wanted: int, now: float) -> list[ChunkGrant]:
        """`run` of `book.lease`: the lease calls that queue together run in one transaction
        (`LeaseBook.leasing`) and are answered once it committed."""
        return await self._queued(QueuedLease(book, worker_id, wanted, now), joining=False)

    async def join(self, fn, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201
        """`run` for a worker joining (its registration): it waits behind the calls of workers
        already registered, a few milliseconds of joins a turn (`JOINS_EVERY_S`). When 512
        workers register and lease in the same second, the first leases of those registered
        queued behind everyone's registration in arrival order, 0.6-0.9 s each; a running job's
        leases and heartbeats likewise waited behind a burst of replacements registering."""
        return await self._queued(partial(fn, *args, **kwargs), joining=True)

    async def _queued(self, call: Callable[[], object], *, joining: bool):  # noqa: ANN202
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        with self._calls_lock:
            # The list read under the lock: a turn swaps `_calls` for a new one when it takes its
            # calls, and a call added to the list it took would never run (a heartbeat waited for
            # ever, and the coordinator's shutdown with it, once in a 100,000-request load run).
            (self._joins if joining else self._calls).append((call, answer))
            start, self._calls_queued = not self._calls_queued, True
            if start:
                self._calls_since = time.perf_counter()
        if start:
            self._state_thread.submit(self._run_calls, loop)
        outcome, failed = await answer
        if failed:
            raise outcome
        return outcome

    def _run_calls(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the state thread: every call queued by now, in order, then joins (`join`) for up to
        `JOINS_EVERY_S`, another turn queued for those left; the answers handed to the loop
        together, every `ANSWERS_EVERY_S` of a long turn (the first fill's turns of 256 first
        leases ran 0.4 s: the first of them waited for the last)."""
        with self._calls_lock:
            batch, self._calls = self._calls, []
            self._calls_queued = False
            started = time.perf_counter()
            self.turns.add("calls waited", started - self._calls_since)
        clock_at_start = (time.thread_time(), self._state_clock.read()[1], self._state_clock.slices)
        answers = []
        handed = started
        held: dict[str, list] = {}  # what the turn ran: call name -> [count, seconds]
        ran = 0
        joins_began: float | None = None  # when this turn ran its first join
        while True:
            if ran < len(batch):
                call, future = batch[ran]
            else:
                with self._calls_lock:
                    # Calls queued meanwhile go first (their turn is submitted), unless the joins
                    # were passed over `JOINS_MAY_WAIT_TURNS` turns in a row: none waits for ever.
                    overtaken = bool(self._calls) and self._joins_passed < JOINS_MAY_WAIT_TURNS
                    if not self._joins or overtaken or (
                            joins_began is not None and time.perf_counter() - joins_began > JOINS_EVERY_S):
                        if overtaken and self._joins:
                            self._joins_passed += 1
                        requeue = bool(self._joins) and not self._calls_queued
                        if requeue:  # the joins left: after whatever queued meanwhile (reports too)
                            self._calls_queued = True
                            self._calls_since = time.perf_counter()
                        break
                    self._joins_passed = 0
                    call, future = self._joins.popleft()
                    if joins_began is None:
                        joins_began = time.perf_counter()
            began = time.perf_counter()
            if isinstance(call, QueuedLease):  # with the lease calls queued right after it
                together = [batch[ran]]
                while ran + len(together) < len(batch) and isinstance(batch[ran + len(together)][0], QueuedLease):
                    together.append(batch[ran + len(together)])
                answers.extend(_lease_together(together))
                ran += len(together)
                name, count = "lease", len(together)
            else:
                ran += 1
                try:
                    answers.append((future, (call(), False)))
                except BaseException as exc:  # noqa: BLE001 - the caller's to handle, as if it ran there
                    answers.append((future, (exc, True)))
                name, count = getattr(call.func, "__name__", "?"), 1
            ended = time.perf_counter()
            spent = held.setdefault(name, [0, 0.0])
            spent[0] += count
            spent[1] += ended - began
            if ended - handed > ANSWERS_EVERY_S:
                loop.call_soon_threadsafe(_settle_all, answers)
                answers, handed = [], ended
        self._turn_ran("calls", started, ran, held, clock_at_start)
        loop.call_soon_threadsafe(_settle_all, answers)
        if requeue:
            self._state_thread.submit(self._run_calls, loop)

    def _open_state_clock(self) -> None:
        self._state_clock = ThreadClock()  # opened in the thread it measures

    def _turn_ran(self, kind: str, started: float, calls: int, held: dict[str, list],
                  clock_at_start: tuple[float, float, int]) -> None:
        # Of the turn's wall time, the thread's CPU (thread_time: schedstat's runtime is brought
        # up to date only at a tick or a switch and read 0 for a short turn) and its wait for a
        # core (schedstat, one pread): the rest it was blocked, on the GIL or the disk. Tells a
        # turn with too much work from one kept waiting. Read before the wall time ends, so that
        # both fit inside it.
        clock = self._state_clock
        cpu = time.thread_time() - clock_at_start[0]
        run_queue = clock.read()[1] - clock_at_start[1]
        ran = time.perf_counter() - started
        slices = clock.slices - clock_at_start[2]
        held["thread cpu"] = [slices, cpu]
        held["run queue"] = [1, run_queue]
        total = self.turn_seconds[kind]
        total[0] += ran
        total[1] += cpu
        total[2] += run_queue
        total[3] += slices
        self.turns.add(f"{kind} ran", ran)
        self.largest_turn[kind] = max(self.largest_turn[kind], calls)
        self.slow_turns.add(started, ran, held)

    async def read(self, fn, *args):  # noqa: ANN001, ANN002, ANN201
        """Run the database reader `fn` on the reader thread and wait for it."""
        return await asyncio.get_running_loop().run_in_executor(self._reader_thread, partial(fn, *args))

    async def report(self, book: LeaseBook, call: ReportCall, clock: Callable[[], float]
                     ) -> tuple[list[ReportOutcome], list[ChunkGrant], list[int] | None]:
        """One worker's report call, committed with every other that queues while the state
        thread is busy (a commit's fsync, say): one durable transaction and one fsync for all of
        them (`LeaseBook.report_calls`), where one each made the disk the coordinator's limit
        (tools/bench/load.py). Its answer comes once that commit is done; the order of the calls is
        kept. Raises `UnknownWorker` for a worker the book does not know (that call alone).
        Returns the outcomes, the grants, and the chunks to abort of the heartbeat the call
        carried (None without one)."""
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        queued = time.perf_counter()
        with self._reports_lock:
            self._reports.append((call, answer, queued))
            start, self._commit_queued = not self._commit_queued, True
            if start:
                self._reports_since = queued
        if start:
            self._state_thread.submit(self._commit_reports, book, clock, loop)
        result = await answer
        # Per call, where its time in the state thread's hands went (`_commit_reports`): queued
        # to its turn, to its answer set on the loop, to this coroutine running again.
        self.turns.add("report call resumed", time.perf_counter() - queued)
        if isinstance(result, BaseException):
            raise result
        return result

    def _commit_reports(self, book: LeaseBook, clock: Callable[[], float], loop: asyncio.AbstractEventLoop) -> None:
        """On the state thread: every report call queued by now, in one group commit, answered
        once it is durable: after its fsync (here, or with a `wal_syncer` on that thread, while
        this one goes on). The calls' leases commit in slices, each slice answered as it is done
        (`LeaseBook.report_calls`)."""
        with self._reports_lock:
            batch, self._reports = self._reports, []
            self._commit_queued = False
            started = time.perf_counter()
            self.turns.add("reports waited", started - self._reports_since)
        for _, _, queued in batch:
            self.turns.add("report call waited", started - queued)
        transactions = CommitTimes.durable + CommitTimes.relaxed, CommitTimes.total_s
        clock_at_start = (time.thread_time(), self._state_clock.read()[1], self._state_clock.slices)
        held: dict[str, list] = {}  # the phases of `report_calls`, then the whole
        now = clock()
        calls = [call for call, _, _ in batch]
        answered = 0  # the calls handed out so far, in order

        def hand_out(first: int, replies: list) -> None:
            nonlocal answered
            self._answer(book, loop, batch[first:first + len(replies)],
                         [r if isinstance(r, BaseException) else (*r, beat) for r, beat in zip(replies, beats[first:])])
            answered = first + len(replies)

        try:
            beats = [_beat(book, call, now) for call in calls]
            book.report_calls(calls, now, laps=Laps(held), hand_out=hand_out)
        except Exception as exc:  # noqa: BLE001 - a commit failed (disk): every call not answered yet answers 5xx
            self._answer(book, loop, batch[answered:], [exc] * (len(batch) - answered))
        self.report_commits += 1
        self.reports_committed += len(batch)
        held["report_calls"] = [len(batch), time.perf_counter() - started]
        # Of the turn, its transactions (begin to commit: the fsync among them): the disk's share.
        held["transactions"] = [CommitTimes.durable + CommitTimes.relaxed - transactions[0],
                                CommitTimes.total_s - transactions[1]]
        self._turn_ran("reports", started, len(batch), held, clock_at_start)

    def _answer(self, book: LeaseBook, loop: asyncio.AbstractEventLoop,
                queued: list[tuple[ReportCall, asyncio.Future, float]], answers: list) -> None:
        """Hand committed report calls their answers: at once, or with a `wal_syncer` once an fsync
        that began after their commit is done (a failed one answers them with its error and stops
        the book: nothing of it may be acknowledged, nor anything after)."""
        if self.wal_syncer is None:
            loop.call_soon_threadsafe(self._settle_reports, queued, answers)
            return
        committed = time.perf_counter()

        def synced(failure: BaseException | None) -> None:  # on the syncer's thread
            self.turns.add("reports synced", time.perf_counter() - committed)
            answered = answers if failure is None else [failure] * len(answers)
            with contextlib.suppress(RuntimeError):  # the loop is gone: so are the callers
                loop.call_soon_threadsafe(self._settle_reports, queued, answered)
            if failure is not None:
                reason = f"an fsync of the database's WAL failed: {failure!r}"
                try:
                    self._state_thread.submit(book.stop_for, reason)  # the book's owner
                except RuntimeError:  # the state thread has stopped: nobody else changes the book
                    book.stop_for(reason)

        self.wal_syncer.after_next_sync(synced)

    def _settle_reports(self, queued: list[tuple[ReportCall, asyncio.Future, float]], answers: list) -> None:
        settled = time.perf_counter()
        for (_, future, at), answer in zip(queued, answers):
            self.turns.add("report call answered", settled - at)
            _settle(future, answer)

    def close(self) -> None:
        self._reader_thread.shutdown(wait=True)
        self._state_thread.shutdown(wait=True)
        if self._state_clock is not None:
            self._state_clock.close()

    def work_queued(self, requests: int | None = None, smallest_context: int = 0) -> None:
        """Work for lease calls waiting (a chunk was re-queued, a lease expired): `requests` newly
        queued, the shortest with `smallest_context` tokens; the state thread plans for waiting
        calls in its next turn (`LeaseLine.serve`), once however many calls of this turn of the
        event loop queued work. None: every waiting call answers now (the rollout is done, or
        the coordinator stops handing out work).

        What each rule cut (tools/bench/load.py, 512 workers, 100,000 requests): waking every waiting
        call for each report made hundreds of empty lease calls queue on the state thread ahead
        of the reports; four extra per report call, when a group commit answered dozens at once,
        made turns of up to 427 plans (~1 s); waking workers without room for any of the work
        (most of them, KV-bound, under load) made 3.6 plans in vain per lease call; woken calls
        that planned for themselves waited for a state-thread turn per plan, up to 45 of them."""
        if requests is None:
            self.line.wake_all()
            return
        if not self._owed:
            self._owed_since = time.monotonic()
            asyncio.get_running_loop().call_soon(self._serve_owed)
        self._owed += requests
        self._owed_context = min(self._owed_context, smallest_context)

    def _serve_owed(self) -> None:
        requests, context, since = self._owed, self._owed_context, self._owed_since
        self._owed, self._owed_context = 0, NO_CONTEXT
        if not len(self.line) or not self.accepting:
            return
        served = asyncio.ensure_future(self.run(self.line.serve, requests, context, since, self._leasing_for_waiting))
        served.add_done_callback(_log_failure)

    @property
    def waiting_lease_calls(self) -> int:
        return len(self.line)


# How long a state-thread turn runs calls before it hands the answers so far to the loop (`_run_calls`).
ANSWERS_EVERY_S = 0.02
# How long a turn runs joins (`join`) once its other calls are done, from its first join.
JOINS_EVERY_S = 0.01
JOINS_MAY_WAIT_TURNS = 4
NO_CONTEXT = 1 << 62  # no work queued since the line was last served: nothing to fit


def _beat(book: LeaseBook, call: ReportCall, now: float) -> list[int] | None:
    """The heartbeat a report call carries, before its reports (their chunks, still held, are
    renewed, not aborted): the chunks to abort, or None without one or for an unknown worker
    (its reports answer for it)."""
    beat = call.heartbeat
    if beat is None:
        return None
    try:
        return book.heartbeat(beat.worker_id, beat.running, now, beat.stats, beat.engine)
    except UnknownWorker:
        return None


class QueuedLease(NamedTuple):
    """A lease call waiting for the state thread (`CoordinatorControl.lease`)."""

    book: LeaseBook
    worker_id: str
    wanted: int
    now: float


def _lease_together(queued: list[tuple[QueuedLease, asyncio.Future]]) -> list[tuple[asyncio.Future, tuple]]:
    """Lease calls one after another in one transaction (`LeaseBook.lease_calls`), as `run`'s
    answers: an unknown worker's call raises alone, a failed transaction in every call of it."""
    calls = [lease for lease, _ in queued]
    try:
        outcomes = calls[0].book.lease_calls([(c.worker_id, c.wanted, ()) for c in calls], max(c.now for c in calls))
    except Exception as exc:  # noqa: BLE001 - the callers' to handle, as if each ran there
        return [(future, (exc, True)) for _, future in queued]
    return [(future, (outcome, isinstance(outcome, BaseException))) for (_, future), outcome in zip(queued, outcomes)]


def _log_failure(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("serving the waiting lease calls failed", exc_info=task.exception())


def _settle(future: asyncio.Future, answer: object) -> None:
    if not future.done():  # else its call went away (the client disconnected)
        future.set_result(answer)


def _settle_all(answers: list[tuple[asyncio.Future, object]]) -> None:
    for future, answer in answers:
        _settle(future, answer)
