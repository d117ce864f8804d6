"""The coordinator's HTTP API for workers and monitors.

Every request, on every path, must be signed with a key derived from the run's secret (no secret
on the wire: `auth.py`, `seerd/signing.py`), or be Prometheus's `GET /metrics` with the metrics
token; anything else gets 401 before routing (a plain ASGI middleware), and a body larger than
the run's limit gets 413 before it is read. Handlers hand every call into the lease book to
one state thread (`control.py`) and await it: the book has a single owner, so its transactions
never interleave, and a commit's fsync never blocks the event loop. Bodies and replies are the
message types of `seerd.protocol`, decoded, validated and encoded with msgspec: token lists are
the bulk of the traffic and pydantic's per-element validation cost more than the database commit.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from seerd.book.book import LeaseBook, RetiredWorker, UnknownWorker
from seerd.book.records import ReportCall
from seerd.db.read import UnreadableDatabase
from seerd.drafts.host import DraftHost, append_items
from seerd.drafts.server import DraftError
from seerd.server.auth import BodyDigestMismatch, SignedCalls, body_mismatch
from seerd.server.control import CoordinatorControl
from seerd.server.guard import BodyLimitMiddleware, body_limit
from seerd.server.latency import WAITED_SCOPE_KEY
from seerd.server.metrics import RefusalCollector, RolloutCollector, metrics_registry
from seerd.settings import EngineConfig
from seerd.protocol import (
    CONFIG, DRAFTS_APPEND, DRAFTS_FETCH, DRAFTS_STATS, HEARTBEAT, LEASE, LONG_POLL_MAX_S, MAX_SNAPSHOT_TAIL_ROWS,
    REGISTER, RELEASE, REPORT, SNAPSHOT_TAIL_ROWS, STATUS, STATUS_SNAPSHOT, UNKNOWN_WORKER, WEIGHTS_MISMATCH,
    WORKER_RETIRED,
    ChunkGrant, DraftAppendReply, DraftStats, ErrorReply, HeartbeatBody, HeartbeatReply, LeaseReply,
    RegisterReply, ReleaseReply, ReportBatch, ReportReply, ReportResult, StatusReply, StatusSnapshot,
    decode_report, heartbeat_interval,
)


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


class Api:
    """The endpoints, one handler each, over the control's lease book and state thread. Every call
    into the book is handed to the state thread (`CoordinatorControl`) and awaited."""

    def __init__(self, control: CoordinatorControl, *, drafts: DraftHost | None = None,
                 snapshot: Callable[[int, StatusReply], dict] | None = None) -> None:
        if control.book is None:
            raise ValueError("the API needs a control that holds the lease book")
        self.control = control
        self.book: LeaseBook = control.book
        self.clock = control.clock
        self.drafts = drafts
        self.snapshot = snapshot
        self.app: Starlette | None = None  # the app these handlers serve in (its state: settings, pool, guard)
        self.registry = metrics_registry(
            RolloutCollector(self.book, control.worker_stats, lambda: control.accepting, self.clock),
            RefusalCollector(control.refused, lambda: getattr(self.app.state, "guard", None) if self.app else None))

    def routes(self) -> list[Route]:
        return [Route(path, handler, methods=[method]) for method, path, handler in (
            ("GET", CONFIG.path, self.engine_config), ("POST", REGISTER.path, self.register),
            ("POST", LEASE.path, self.lease), ("POST", REPORT.path, self.report),
            ("POST", RELEASE.path, self.release), ("POST", HEARTBEAT.path, self.heartbeat),
            ("POST", DRAFTS_APPEND.path, self.drafts_append), ("POST", DRAFTS_FETCH.path, self.drafts_fetch),
            ("GET", DRAFTS_STATS.path, self.drafts_stats), ("GET", "/metrics", self.metrics),
            ("GET", STATUS.path, self.status), ("GET", STATUS_SNAPSHOT.path, self.status_snapshot))]

    # ------------------------------------------------------------------ what handlers share
    def known(self, worker_id: str) -> None:
        if (reason := self.book.retired_reason(worker_id)) is not None:
            raise ApiError(410, f"worker {worker_id} was taken out: {reason}; exit", WORKER_RETIRED)
        if not self.book.known_worker(worker_id):
            raise ApiError(404, f"unknown worker {worker_id}; register again", UNKNOWN_WORKER)

    def done_for(self, worker_id: str) -> bool:
        """Whether the rollout is complete, noting that this worker has heard it."""
        if self.book.is_complete():
            self.control.told_done.add(worker_id)
            return True
        return False

    def heartbeat_reply(self, body: HeartbeatBody, abort: list[int]) -> HeartbeatReply:
        """The answer to a heartbeat applied by the book, on its own call or carried by a report."""
        self.control.worker_stats[body.worker_id] = body.stats
        if body.leaving:
            self.control.left.add(body.worker_id)
        return HeartbeatReply(abort, done=self.done_for(body.worker_id),
                              interval_s=heartbeat_interval(self.book.lease_ttl_s, self.book.live_count))

    # ------------------------------------------------------------------ workers
    async def engine_config(self, request: Request) -> Response:
        return _json(request.app.state.engine_settings)

    async def register(self, request: Request) -> Response:
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
        book = self.book
        worker = await self.control.join(
            book.register, rank=body.rank, address=body.address, max_chunks=body.max_chunks,
            kv_capacity_tokens=body.kv_capacity_tokens, worker_id=body.worker_id[:100],
            kv_block_tokens=body.kv_block_tokens, weights_version=body.weights_version,
            weights_loaded_s=body.weights_loaded_s, dtype=body.dtype[:32], now=self.clock())
        return _json(RegisterReply(worker.id, book.lease_ttl_s, heartbeat_interval(book.lease_ttl_s, book.live_count)))

    async def lease(self, request: Request) -> Response:
        body = await _decode(request, LEASE.body)
        control, book = self.control, self.book
        self.known(body.worker_id)
        if self.done_for(body.worker_id):
            return _json(LeaseReply([], done=True))
        if not control.accepting:
            return _json(LeaseReply([], done=False, retry_after_s=0.5))
        if not control.scheduling_gate():  # e.g. `group` waits for every worker: ask again soon
            return _json(LeaseReply([], done=False, retry_after_s=0.05))
        wanted = max(0, body.wanted)
        # An empty queue needs no state-thread call (a hint read here; the state thread decides).
        plans = 1 if len(book.state.queue) else 0
        grants = await control.lease(book, body.worker_id, wanted, self.clock()) if plans else []
        waited_s = 0.0
        if not grants and body.wait_s > 0 and not book.is_complete():
            answer = await self._wait_for_work(request, body.worker_id, wanted, body.wait_s)
            if isinstance(answer, Response):
                return answer
            grants, more_plans, waited_s = answer
            plans += more_plans
        control.lease_plans.add(plans, bool(grants))
        return _json(LeaseReply(grants, done=False, retry_after_s=0.0 if grants else 0.05, waited_s=waited_s))

    async def _wait_for_work(self, request: Request, worker_id: str, wanted: int,
                             wait_s: float) -> tuple[list[ChunkGrant], int, float] | Response:
        """Long poll: an idle worker hears of new work at once and costs nothing meanwhile. The
        state thread plans for it as work is queued and answers it when it gives it chunks
        (`LeaseLine.serve`); its wait for work ends when that work was queued, so that turn counts
        in its answer time. Woken because the rollout is over or the coordinator stops handing out
        work, it looks once more itself. (grants, plans made, seconds waited), or the answer."""
        control = self.control
        waiting = time.monotonic()
        waited = await control.line.wait(min(wait_s, LONG_POLL_MAX_S), worker_id, wanted)
        plans = waited.plans
        waited_s = max(0.0, (waited.ready_at if waited.grants else time.monotonic()) - waiting)
        request.scope[WAITED_SCOPE_KEY] = waited_s
        if waited.grants:
            return waited.grants, plans, waited_s
        self.known(worker_id)
        if self.done_for(worker_id):
            return _json(LeaseReply([], done=True, waited_s=waited_s))
        grants = []
        if waited.woken and control.accepting:
            grants = await control.lease(self.book, worker_id, wanted, self.clock())
            plans += 1
        return grants, plans, waited_s

    async def report(self, request: Request) -> Response:
        body = await _decode(request, ReportBatch)
        control, book = self.control, self.book
        try:  # each report on its own: a malformed one is rejected alone (`book.report_many`)
            reports = [decode_report(raw) for raw in body.reports]
        except msgspec.ValidationError as exc:
            raise ApiError(422, f"invalid body: a report without an integer chunk_id and epoch ({exc})") from None
        self.known(body.worker_id)
        beat = body.heartbeat
        if beat is not None and (beat.worker_id != body.worker_id or beat.leaving):
            raise ApiError(422, "a report carries its own worker's heartbeat, never a leaving one")
        outcomes, grants, abort = await control.report(book, ReportCall(
            body.worker_id, reports, may_lease=control.accepting and control.scheduling_gate(), wanted=body.wanted,
            heartbeat=beat), self.clock)
        # Work for lease calls waiting: a request to continue, a rejected chunk to run again, that
        # no lease of its group commit took (one continued in place never waited in the queue:
        # waking a worker for it made a plan in vain, most of the state thread's work at 512 workers).
        if book.is_complete():
            control.work_queued()
        elif queued := [o.queued_context for o in outcomes if o.queued_context is not None]:
            control.work_queued(len(queued), min(queued))
        results = [ReportResult(r.chunk_id, o.accepted, o.duplicate, o.reason) for r, o in zip(reports, outcomes)]
        return _json(ReportReply(results, done=book.is_complete(), grants=grants,
                                 heartbeat=None if abort is None else self.heartbeat_reply(beat, abort)))

    async def release(self, request: Request) -> Response:
        body = await _decode(request, RELEASE.body)
        self.known(body.worker_id)
        released = await self.control.run(self.book.release, body.worker_id, body.chunk_id, body.epoch, body.reason,
                                          self.clock(), failed=body.failed)
        if released:
            self.control.work_queued(1)
        return _json(ReleaseReply(released))

    async def heartbeat(self, request: Request) -> Response:
        body = await _decode(request, HEARTBEAT.body)
        self.known(body.worker_id)
        abort = await self.control.run(self.book.heartbeat, body.worker_id, body.running, self.clock(), body.stats,
                                       body.engine)
        return _json(self.heartbeat_reply(body, abort))

    # ------------------------------------------------------------------ the grouped draft server
    def draft_host(self) -> DraftHost:
        if self.drafts is None:
            raise ApiError(404, "this run has no grouped draft server (its --spec is not grouped)")
        return self.drafts

    async def drafts_append(self, request: Request) -> Response:
        host, body = self.draft_host(), await _decode(request, DRAFTS_APPEND.body)
        return _json(DraftAppendReply(await host.run(append_items, host.server, body.items)))

    async def drafts_fetch(self, request: Request) -> Response:
        host, body = self.draft_host(), await _decode(request, DRAFTS_FETCH.body)
        try:
            return _json(await host.run(host.server.fetch, body.cursors))
        except DraftError as exc:
            raise ApiError(422, str(exc)) from None

    async def drafts_stats(self, _request: Request) -> Response:
        host = self.draft_host()
        return _json(DraftStats(**await host.run(host.server.stats)))

    # ------------------------------------------------------------------ monitors
    async def metrics(self, _request: Request) -> Response:
        # Collected on the state thread: the book is read by its owner only.
        return Response(await self.control.run(generate_latest, self.registry), media_type=CONTENT_TYPE_LATEST)

    async def status_reply(self, app: Starlette) -> StatusReply:
        control, book = self.control, self.book
        counts = await control.run(book.counts)
        pool = getattr(app.state, "kv_pool", None)
        return StatusReply(rollout_id=book.rollout_id, policy=book.policy.name, **counts,
                           complete=book.is_complete(), accepting=control.accepting,
                           coordinator_busy_s=control.busy_s, api_calls=control.calls,
                           kv_pool=None if pool is None else pool.latest)

    async def status(self, request: Request) -> Response:
        return _json(await self.status_reply(request.app))

    async def status_snapshot(self, request: Request) -> Response:
        if self.snapshot is None:
            raise ApiError(404, "this coordinator serves no status snapshot")
        tail_rows = request.query_params.get(SNAPSHOT_TAIL_ROWS, "15")
        if not (tail_rows.isascii() and tail_rows.isdigit()) or int(tail_rows) > MAX_SNAPSHOT_TAIL_ROWS:
            raise ApiError(422, f"{SNAPSHOT_TAIL_ROWS} must be an integer in 0..{MAX_SNAPSHOT_TAIL_ROWS}")
        answer = await self.status_reply(request.app)
        try:
            taken = await self.control.read(self.snapshot, int(tail_rows), answer)
        except UnreadableDatabase as exc:  # locked past the reader's timeout, say
            raise ApiError(503, str(exc)) from None
        return _json(StatusSnapshot(taken))


async def _api_error(_request: Request, exc: ApiError) -> Response:
    return _json(ErrorReply(exc.detail, exc.code), exc.status)


async def _unknown_worker(_request: Request, exc: UnknownWorker) -> Response:  # retired after `known`
    if isinstance(exc, RetiredWorker):
        return _json(ErrorReply(f"worker {exc} was taken out: {exc.reason}; exit", WORKER_RETIRED), 410)
    return _json(ErrorReply(f"unknown worker {exc}; register again", UNKNOWN_WORKER), 404)


def create_app(control: CoordinatorControl, secret: str, *, drafts: DraftHost | None = None,
               max_body_bytes: int | None = None, address: str = "", metrics_token: str | None = None,
               snapshot: Callable[[int, StatusReply], dict] | None = None, signed: bool = True) -> Starlette:
    """The API over `control`'s lease book; `max_body_bytes` defaults to the `body_limit` of
    default engines. Calls are signed for `address` (the "host:port" clients reach it at);
    `metrics_token` opens `GET /metrics`. `signed=False` leaves the signature check to whoever
    mounts the app (`seerd serve`'s listener). `snapshot(tail_rows, status)` reads `seerd
    status`'s snapshot of the run on this host (the daemon's; without it, `STATUS_SNAPSHOT`
    answers 404).

    Plain Starlette routes: each handler takes the request and decodes its body itself, so
    FastAPI's dependency solving and its extra middleware layer (~0.1 ms a call, every report and
    lease) bought nothing here."""
    api = Api(control, drafts=drafts, snapshot=snapshot)
    signing = [Middleware(SignedCalls, secret=secret, control=control, address=address,
                          metrics_token=metrics_token)] if signed else []  # outermost: 401 first
    limit = max_body_bytes or body_limit(EngineConfig(), api.book.chunk_tokens)
    api.app = Starlette(routes=api.routes(),
                        exception_handlers={ApiError: _api_error, UnknownWorker: _unknown_worker,
                                            BodyDigestMismatch: body_mismatch},
                        middleware=[*signing, Middleware(BodyLimitMiddleware, limit=limit)])
    return api.app
