"""The coordinator's HTTP API for workers and monitors.

Every request, on every path, must be signed with a key derived from the run's secret (no secret
on the wire: `auth.py`, `seerd/signing.py`), or be Prometheus's `GET /metrics` with the metrics
token; anything else gets 401 before routing (a plain ASGI middleware), and a body larger than
the run's limit gets 413 before it is read. Handlers hand every call into the
lease book to one state thread (`CoordinatorControl.run`) and await it: the book has a single
owner, so its transactions never interleave, and a commit's fsync never blocks the event loop. Bodies and replies are the message types of `seerd.protocol`, decoded, validated
and encoded with msgspec: token lists are the bulk of the traffic and pydantic's per-element
validation cost more than the database commit.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from seerd.config import EngineConfig
from seerd.coordinator.auth import BodyDigestMismatch, SignedCalls, body_mismatch
from seerd.coordinator.book import LeaseBook, ReportCall, RetiredWorker, UnknownWorker
from seerd.coordinator.drafts import DraftHost, append_items
from seerd.coordinator.guard import BodyLimitMiddleware, body_limit
from seerd.coordinator.latency import (
    WAITED_SCOPE_KEY, CallLatencies, Laps, PlansPerCall, SlowTurns,
)
from seerd.coordinator.metrics import RefusalCollector, RolloutCollector, metrics_registry
from seerd.coordinator.reports import ReportOutcome
from seerd.coordinator.waiting import LeaseLine
from seerd.db.base import CommitTimes
from seerd.db.read import UnreadableDatabase
from seerd.drafts.server import DraftError
from seerd.protocol import (
    CONFIG, DRAFTS_APPEND, DRAFTS_FETCH, DRAFTS_STATS, HEARTBEAT, LEASE, LONG_POLL_MAX_S, MAX_SNAPSHOT_TAIL_ROWS,
    REGISTER, RELEASE, REPORT, SNAPSHOT_TAIL_ROWS, STATUS, STATUS_SNAPSHOT, UNKNOWN_WORKER, WEIGHTS_MISMATCH,
    WORKER_RETIRED,
    ChunkGrant, DraftAppendReply, DraftStats, ErrorReply, HeartbeatBody, HeartbeatReply, LeaseReply,
    RegisterReply, ReleaseReply, ReportBatch, ReportReply, ReportResult, StatusReply, StatusSnapshot,
    decode_report, heartbeat_interval,
)

log = logging.getLogger(__name__)


class CoordinatorControl:
    """What the API needs from the daemon besides the book: whether to hand out work at all, and
    the state thread.

    Every call into the lease book runs on one dedicated thread (`run`): the book stays single-
    owner, and a commit's fsync (milliseconds on a loaded disk) never blocks the event loop that
    parses the other workers' requests. Report calls are committed in groups (`report`).
    """

    def __init__(self) -> None:
        self._state_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="seerd-state")
        # Status snapshots read for other hosts (`seerd status` of a run on a network filesystem):
        # never on the state thread, and one at a time however many watch.
        self._reader_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="seerd-reader")
        self.accepting = True  # false while draining (shutdown, preemption)
        self.scheduling_gate: Callable[[], bool] = lambda: True  # e.g. wait for every worker
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
        self.lease_plans = PlansPerCall()  # plans made for each lease call (long polls planned for in vain)
        self._calls_since = self._reports_since = 0.0  # when the oldest queued call was queued
        self.refused: dict[str, int] = {}  # calls refused by the signature check (auth.py), by reason
        self.line = LeaseLine()  # lease calls long-polling for work (`work_queued` serves them)
        # Work queued since the state thread last served the line: how many requests, the
        # shortest context among them, and when the first of them was queued.
        self._owed = 0
        self._owed_context = NO_CONTEXT
        self._owed_since = 0.0
        # The book's lease for a waiting call (`LeaseLine.serve`), set by `create_app`.
        self.lease_for_waiting: Callable[[str, int], list] = lambda _worker_id, _wanted: []
        self._reports: list[tuple[ReportCall, asyncio.Future]] = []  # waiting for the next group commit
        self._reports_lock = threading.Lock()  # the loop appends, the state thread takes
        self._commit_queued = False
        self._calls: list[tuple[Callable[[], object], asyncio.Future]] = []  # other calls, likewise (`run`)
        self._joins: collections.deque[tuple[Callable[[], object], asyncio.Future]] = collections.deque()  # (`join`)
        self._calls_lock = threading.Lock()  # guards both lists and the flag
        self._calls_queued = False  # a `_run_calls` is submitted and has not taken its calls yet
        self._joins_passed = 0  # turns in a row that ended with joins waiting, for calls queued meanwhile
        self.report_commits = 0  # group commits of report calls, and the calls they held
        self.reports_committed = 0

    async def run(self, fn, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201
        """Run `fn` on the state thread and wait for it without blocking the loop. Calls that
        queue while the state thread is busy run in one turn of it and are answered with one
        wake-up of the loop: a hand-over each (an executor future, a self-pipe write) was a
        tenth of the loop's CPU with 512 workers (py-spy, tools/load.py)."""
        return await self._queued(partial(fn, *args, **kwargs), joining=False)

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
        cpu_at_start = time.thread_time()
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
            ran += 1
            began = time.perf_counter()
            try:
                answers.append((future, (call(), False)))
            except BaseException as exc:  # noqa: BLE001 - the caller's to handle, as if it ran there
                answers.append((future, (exc, True)))
            ended = time.perf_counter()
            spent = held.setdefault(getattr(call.func, "__name__", "?"), [0, 0.0])
            spent[0] += 1
            spent[1] += ended - began
            if ended - handed > ANSWERS_EVERY_S:
                loop.call_soon_threadsafe(_settle_all, answers)
                answers, handed = [], ended
        self._turn_ran("calls", started, ran, held, cpu_at_start)
        loop.call_soon_threadsafe(_settle_all, answers)
        if requeue:
            self._state_thread.submit(self._run_calls, loop)

    def _turn_ran(self, kind: str, started: float, calls: int, held: dict[str, list],
                  cpu_at_start: float) -> None:
        ran = time.perf_counter() - started
        # Of the turn's wall time, the thread's CPU: the rest it waited (the GIL, a core, the
        # disk), which tells a turn with too much work from one kept waiting. (The run-queue wait
        # from /proc/thread-self/schedstat too cost an eighth of the state thread's samples:
        # opening a procfs file is slow.)
        held["thread cpu"] = [1, time.thread_time() - cpu_at_start]
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
        (tools/load.py). Its answer comes once that commit is done; the order of the calls is
        kept. Raises `UnknownWorker` for a worker the book does not know (that call alone).
        Returns the outcomes, the grants, and the chunks to abort of the heartbeat the call
        carried (None without one)."""
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        with self._reports_lock:
            self._reports.append((call, answer))
            start, self._commit_queued = not self._commit_queued, True
            if start:
                self._reports_since = time.perf_counter()
        if start:
            self._state_thread.submit(self._commit_reports, book, clock, loop)
        result = await answer
        if isinstance(result, BaseException):
            raise result
        return result

    def _commit_reports(self, book: LeaseBook, clock: Callable[[], float], loop: asyncio.AbstractEventLoop) -> None:
        """On the state thread: every report call queued by now, in one group commit."""
        with self._reports_lock:
            batch, self._reports = self._reports, []
            self._commit_queued = False
            started = time.perf_counter()
            self.turns.add("reports waited", started - self._reports_since)
        transactions = CommitTimes.durable + CommitTimes.relaxed, CommitTimes.total_s
        cpu_at_start = time.thread_time()
        held: dict[str, list] = {}  # the phases of `report_calls`, then the whole
        now = clock()
        calls = [call for call, _ in batch]
        try:
            beats = [_beat(book, call, now) for call in calls]
            answers = book.report_calls(calls, now, laps=Laps(held))
            answers = [a if isinstance(a, BaseException) else (*a, beat) for a, beat in zip(answers, beats)]
        except Exception as exc:  # noqa: BLE001 - the commit failed (disk): every call of it answers 5xx
            answers = [exc] * len(batch)
        self.report_commits += 1
        self.reports_committed += len(batch)
        held["report_calls"] = [len(batch), time.perf_counter() - started]
        # Of the turn, its transactions (begin to commit: the fsync among them): the disk's share.
        held["transactions"] = [CommitTimes.durable + CommitTimes.relaxed - transactions[0],
                                CommitTimes.total_s - transactions[1]]
        self._turn_ran("reports", started, len(batch), held, cpu_at_start)
        loop.call_soon_threadsafe(_settle_all, [(future, answer) for (_, future), answer in zip(batch, answers)])

    def close(self) -> None:
        self._reader_thread.shutdown(wait=True)
        self._state_thread.shutdown(wait=True)

    def work_queued(self, requests: int | None = None, smallest_context: int = 0) -> None:
        """Work for lease calls waiting (a chunk was re-queued, a lease expired): `requests` newly
        queued, the shortest with `smallest_context` tokens; the state thread plans for waiting
        calls in its next turn (`LeaseLine.serve`), once however many calls of this turn of the
        event loop queued work. None: every waiting call answers now (the rollout is done, or
        the coordinator stops handing out work).

        What each rule cut (tools/load.py, 512 workers, 100,000 requests): waking every waiting
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
        served = asyncio.ensure_future(self.run(self.line.serve, requests, context, since, self.lease_for_waiting))
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


def _log_failure(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("serving the waiting lease calls failed", exc_info=task.exception())


def _settle(future: asyncio.Future, answer: object) -> None:
    if not future.done():  # else its call went away (the client disconnected)
        future.set_result(answer)


def _settle_all(answers: list[tuple[asyncio.Future, object]]) -> None:
    for future, answer in answers:
        _settle(future, answer)


class ApiError(Exception):
    def __init__(self, status: int, detail: str, code: str = "") -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.code = code  # a `seerd.protocol` error code the worker acts on


def _json(payload: msgspec.Struct, status: int = 200, *, close: bool = False) -> Response:
    return Response(msgspec.json.encode(payload), status, media_type="application/json",
                    headers={"connection": "close"} if close else None)


async def _decode(request: Request, body_type: type):  # noqa: ANN202
    try:
        return msgspec.json.decode(await request.body(), type=body_type)
    except msgspec.ValidationError as exc:
        raise ApiError(422, f"invalid body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"malformed JSON: {exc}") from None


def create_app(book: LeaseBook, secret: str, control: CoordinatorControl,
               clock: Callable[[], float] = time.time, drafts: DraftHost | None = None, *,
               max_body_bytes: int | None = None, address: str = "",
               metrics_token: str | None = None,
               snapshot: Callable[[int, StatusReply], dict] | None = None, signed: bool = True) -> Starlette:
    """The API; `max_body_bytes` defaults to the `body_limit` of default engines. Calls are signed
    for `address` (the "host:port" clients reach it at); `metrics_token` opens `GET /metrics`.
    `signed=False` leaves the signature check to whoever mounts the app (`seerd serve`'s listener).
    `snapshot(tail_rows, status)` reads `seerd status`'s snapshot of the run on this host (the
    daemon's; without it, `STATUS_SNAPSHOT` answers 404).

    Plain Starlette routes: each handler takes the request and decodes its body itself, so
    FastAPI's dependency solving and its extra middleware layer (~0.1 ms a call, every report and
    lease) bought nothing here."""
    routes: list[Route] = []

    def route(method: str, path: str) -> Callable:
        def add(handler: Callable) -> Callable:
            routes.append(Route(path, handler, methods=[method]))
            return handler
        return add

    async def api_error(_request: Request, exc: ApiError) -> Response:
        return _json(ErrorReply(exc.detail, exc.code), exc.status)

    async def unknown_worker(_request: Request, exc: UnknownWorker) -> Response:  # retired after `known`
        if isinstance(exc, RetiredWorker):
            return _json(ErrorReply(f"worker {exc} was taken out: {exc.reason}; exit", WORKER_RETIRED), 410)
        return _json(ErrorReply(f"unknown worker {exc}; register again", UNKNOWN_WORKER), 404)

    control.line.room_for = book.state.room_for
    control.lease_for_waiting = lambda worker_id, wanted: (
        book.lease(worker_id, wanted, clock()) if control.accepting and not book.is_complete() else [])

    def known(worker_id: str) -> None:
        if (reason := book.retired_reason(worker_id)) is not None:
            raise ApiError(410, f"worker {worker_id} was taken out: {reason}; exit", WORKER_RETIRED)
        if not book.known_worker(worker_id):
            raise ApiError(404, f"unknown worker {worker_id}; register again", UNKNOWN_WORKER)

    def done_for(worker_id: str) -> bool:
        """Whether the rollout is complete, noting that this worker has heard it."""
        if book.is_complete():
            control.told_done.add(worker_id)
            return True
        return False

    @route("GET", CONFIG.path)
    async def engine_config(request: Request) -> Response:
        return _json(request.app.state.engine_settings)

    @route("POST", REGISTER.path)
    async def register(request: Request) -> Response:
        body = await _decode(request, REGISTER.body)
        settings = getattr(request.app.state, "engine_settings", None)  # the daemon's; tests' apps may have none
        weights = settings.weights_version if settings is not None else ""
        if body.weights_version != weights:  # strictly on-policy: no chunk under other weights
            raise ApiError(409, f"this rollout samples from {weights}, the worker holds "
                                f"{body.weights_version or 'unnamed weights'}: load them and register again",
                           WEIGHTS_MISMATCH)
        if (body.rank < 0 or body.max_chunks < 1 or body.kv_capacity_tokens < 1 or not body.worker_id
                or not 1 <= body.kv_block_tokens <= body.kv_capacity_tokens):
            raise ApiError(422, "rank >= 0, max_chunks >= 1, kv_capacity_tokens >= 1, kv_block_tokens in "
                                "1..kv_capacity_tokens and a worker_id are required")
        worker = await control.join(book.register, rank=body.rank, address=body.address, max_chunks=body.max_chunks,
                                    kv_capacity_tokens=body.kv_capacity_tokens, worker_id=body.worker_id[:100],
                                    kv_block_tokens=body.kv_block_tokens, weights_version=body.weights_version,
                                    weights_loaded_s=body.weights_loaded_s, now=clock())
        return _json(RegisterReply(worker.id, book.lease_ttl_s, heartbeat_interval(book.lease_ttl_s, book.live_count)))

    @route("POST", LEASE.path)
    async def lease(request: Request) -> Response:
        body = await _decode(request, LEASE.body)
        known(body.worker_id)
        if done_for(body.worker_id):
            return _json(LeaseReply([], done=True))
        if not control.accepting:
            return _json(LeaseReply([], done=False, retry_after_s=0.5))
        if not control.scheduling_gate():  # e.g. `group` waits for every worker: ask again soon
            return _json(LeaseReply([], done=False, retry_after_s=0.05))
        # An empty queue needs no state-thread call (a hint read here; the state thread decides).
        plans = 1 if len(book.state.queue) else 0
        grants = await control.run(book.lease, body.worker_id, max(0, body.wanted), clock()) if plans else []
        waited_s = 0.0
        if not grants and body.wait_s > 0 and not book.is_complete():
            # Long poll: an idle worker hears of new work at once and costs nothing meanwhile. The
            # state thread plans for it as work is queued and answers it when it gives it chunks
            # (`LeaseLine.serve`); its wait for work ends when that work was queued, so that turn
            # counts in its answer time. Woken because the rollout is over or the coordinator stops
            # handing out work, it looks once more itself.
            waiting = time.monotonic()
            waited = await control.line.wait(min(body.wait_s, LONG_POLL_MAX_S), body.worker_id, max(0, body.wanted))
            plans += waited.plans
            waited_s = max(0.0, (waited.ready_at if waited.grants else time.monotonic()) - waiting)
            request.scope[WAITED_SCOPE_KEY] = waited_s
            if waited.grants:
                grants = waited.grants
            else:
                known(body.worker_id)
                if done_for(body.worker_id):
                    return _json(LeaseReply([], done=True, waited_s=waited_s))
                if waited.woken and control.accepting:
                    grants = await control.run(book.lease, body.worker_id, max(0, body.wanted), clock())
                    plans += 1
        control.lease_plans.add(plans, bool(grants))
        return _json(LeaseReply(grants, done=False, retry_after_s=0.0 if grants else 0.05, waited_s=waited_s))

    @route("POST", REPORT.path)
    async def report(request: Request) -> Response:
        body = await _decode(request, ReportBatch)
        try:  # each report on its own: a malformed one is rejected alone (`book.report_many`)
            reports = [decode_report(raw) for raw in body.reports]
        except msgspec.ValidationError as exc:
            raise ApiError(422, f"invalid body: a report without an integer chunk_id and epoch ({exc})") from None
        known(body.worker_id)
        beat = body.heartbeat
        if beat is not None and (beat.worker_id != body.worker_id or beat.leaving):
            raise ApiError(422, "a report carries its own worker's heartbeat, never a leaving one")
        outcomes, grants, abort = await control.report(book, ReportCall(
            body.worker_id, reports, may_lease=control.accepting and control.scheduling_gate(), wanted=body.wanted,
            heartbeat=beat), clock)
        # Work for lease calls waiting: a request to continue, a rejected chunk to run again, that
        # no lease of its group commit took (one continued in place never waited in the queue:
        # waking a worker for it made a plan in vain, most of the state thread's work at 512 workers).
        if book.is_complete():
            control.work_queued()
        elif queued := [o.queued_context for o in outcomes if o.queued_context is not None]:
            control.work_queued(len(queued), min(queued))
        results = [ReportResult(r.chunk_id, o.accepted, o.duplicate, o.reason) for r, o in zip(reports, outcomes)]
        return _json(ReportReply(results, done=book.is_complete(), grants=grants,
                                 heartbeat=None if abort is None else heartbeat_reply(beat, abort)))

    @route("POST", RELEASE.path)
    async def release(request: Request) -> Response:
        body = await _decode(request, RELEASE.body)
        known(body.worker_id)
        released = await control.run(book.release, body.worker_id, body.chunk_id, body.epoch, body.reason, clock(),
                                     failed=body.failed)
        if released:
            control.work_queued(1)
        return _json(ReleaseReply(released))

    @route("POST", HEARTBEAT.path)
    async def heartbeat(request: Request) -> Response:
        body = await _decode(request, HEARTBEAT.body)
        known(body.worker_id)
        abort = await control.run(book.heartbeat, body.worker_id, body.running, clock(), body.stats, body.engine)
        return _json(heartbeat_reply(body, abort))

    def heartbeat_reply(body: HeartbeatBody, abort: list[int]) -> HeartbeatReply:
        """The answer to a heartbeat applied by the book, on its own call or carried by a report."""
        control.worker_stats[body.worker_id] = body.stats
        if body.leaving:
            control.left.add(body.worker_id)
        return HeartbeatReply(abort, done=done_for(body.worker_id),
                              interval_s=heartbeat_interval(book.lease_ttl_s, book.live_count))

    def draft_host() -> DraftHost:
        if drafts is None:
            raise ApiError(404, "this run has no grouped draft server (its --spec is not grouped)")
        return drafts

    @route("POST", DRAFTS_APPEND.path)
    async def drafts_append(request: Request) -> Response:
        host, body = draft_host(), await _decode(request, DRAFTS_APPEND.body)
        return _json(DraftAppendReply(await host.run(append_items, host.server, body.items)))

    @route("POST", DRAFTS_FETCH.path)
    async def drafts_fetch(request: Request) -> Response:
        host, body = draft_host(), await _decode(request, DRAFTS_FETCH.body)
        try:
            return _json(await host.run(host.server.fetch, body.cursors))
        except DraftError as exc:
            raise ApiError(422, str(exc)) from None

    @route("GET", DRAFTS_STATS.path)
    async def drafts_stats(_request: Request) -> Response:
        host = draft_host()
        return _json(DraftStats(**await host.run(host.server.stats)))

    rollout = RolloutCollector(book, control.worker_stats, lambda: control.accepting, clock)
    refusals = RefusalCollector(control.refused, lambda: getattr(app.state, "guard", None))
    registry = metrics_registry(rollout, refusals)

    @route("GET", "/metrics")
    async def metrics(_request: Request) -> Response:
        # Collected on the state thread: the book is read by its owner only.
        return Response(await control.run(generate_latest, registry), media_type=CONTENT_TYPE_LATEST)

    async def status_reply() -> StatusReply:
        counts = await control.run(book.counts)
        pool = getattr(app.state, "kv_pool", None)
        return StatusReply(rollout_id=book.rollout_id, policy=book.policy.name, **counts,
                           complete=book.is_complete(), accepting=control.accepting,
                           coordinator_busy_s=control.busy_s, api_calls=control.calls,
                           kv_pool=None if pool is None else pool.latest)

    @route("GET", STATUS.path)
    async def status(_request: Request) -> Response:
        return _json(await status_reply())

    @route("GET", STATUS_SNAPSHOT.path)
    async def status_snapshot(request: Request) -> Response:
        if snapshot is None:
            raise ApiError(404, "this coordinator serves no status snapshot")
        tail_rows = request.query_params.get(SNAPSHOT_TAIL_ROWS, "15")
        if not (tail_rows.isascii() and tail_rows.isdigit()) or int(tail_rows) > MAX_SNAPSHOT_TAIL_ROWS:
            raise ApiError(422, f"{SNAPSHOT_TAIL_ROWS} must be an integer in 0..{MAX_SNAPSHOT_TAIL_ROWS}")
        answer = await status_reply()
        try:
            taken = await control.read(snapshot, int(tail_rows), answer)
        except UnreadableDatabase as exc:  # locked past the reader's timeout, say
            raise ApiError(503, str(exc)) from None
        return _json(StatusSnapshot(taken))

    signing = [Middleware(SignedCalls, secret=secret, control=control, address=address,
                          metrics_token=metrics_token)] if signed else []  # outermost: 401 first
    app = Starlette(routes=routes, exception_handlers={ApiError: api_error, UnknownWorker: unknown_worker,
                                                       BodyDigestMismatch: body_mismatch},
                    middleware=[*signing, Middleware(BodyLimitMiddleware, limit=max_body_bytes or body_limit(
                        EngineConfig(), book.chunk_tokens))])
    return app
