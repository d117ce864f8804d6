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

import contextlib
import time
from collections.abc import Callable, Iterator

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
    DraftAppendReply, DraftStats, ErrorReply, HeartbeatBody, HeartbeatReply, LeaseReply,
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

    @contextlib.contextmanager
    def leasing_for_waiting() -> Iterator[Callable[[str, int], object]]:
        with book.leasing(clock()) as lease:
            yield lambda worker_id, wanted: (
                lease(worker_id, wanted) if control.accepting and not book.is_complete() else [])

    control.leasing_for_waiting = leasing_for_waiting

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
                                    weights_loaded_s=body.weights_loaded_s, dtype=body.dtype[:32], now=clock())
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
        grants = await control.lease(book, body.worker_id, max(0, body.wanted), clock()) if plans else []
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
                    grants = await control.lease(book, body.worker_id, max(0, body.wanted), clock())
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
