"""`seerd serve`: one coordinator process and its workers across many batches.

The serve owns the run directory, its credentials (one secret per serve start), the listening
socket and the signals; its workers' engines start once. Batches arrive through the API
(`POST /v1/batches`, seerd/serve/batches.py) and run one after another, each a rollout in the
serve's database driven by a `Coordinator` of its own (`serve_batch`): its lease book, state
thread, draft server and API, mounted behind the serve's signature check (`Dispatch`) for as long as
the batch runs. Between batches, workers hear `batch: None` from `/v1/config` and wait; a worker
whose engine holds other weights than the next batch's loads them in place before it registers,
and the batch's API refuses a worker of other weights (strictly on-policy). A serve killed and
started again runs the unfinished batch first, as `seerd resume` would.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from functools import partial

import msgspec
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from seerd.config import RunConfig
from seerd.coordinator.daemon import Coordinator, CoordinatorResult, open_database
from seerd.coordinator.heap import HeapKeeper
from seerd.coordinator.model_identity import ModelChanged, fingerprint_json, model_fingerprint, weight_version
from seerd.db import Engine, queries
from seerd.db.read import UnreadableDatabase, reading
from seerd.kvpool.host import host_pool, run_tag
from seerd.launch.local import WorkerPool
from seerd.ownership import Ownership
from seerd.protocol import (
    BATCH_GROUPS_AFTER, BATCH_GROUPS_WAIT, BATCH_WAIT_MAX_S, BATCHES, CONFIG, CONFIG_AFTER_BATCH, BatchBody,
    EngineSettings, ErrorReply, GroupsReply,
)
from seerd.rundir import RunDir
from seerd.server.auth import BodyDigestMismatch, SignedCalls, body_mismatch
from seerd.server.control import CoordinatorControl
from seerd.server.guard import (
    BodyLimitMiddleware, ConnectionGuard, api_server, limits_for, listening_socket, raise_open_files_limit,
)
from seerd.serve.batches import BatchRefused, batch_dir, batch_state, create_batch, ended_groups, next_batch

log = logging.getLogger("seerd.serve")

IDLE_TICK_S = 0.5
BATCH_BODY_LIMIT = 64 << 10  # a batch names its prompt file: the body is small


def _json(payload: msgspec.Struct, status: int = 200) -> Response:
    return Response(msgspec.json.encode(payload), status, media_type="application/json")


class Dispatch:
    """The serve's API behind its signature check: batch calls to the serve's own routes, every
    other call to the running batch's API, or, between batches, `/v1/config` with no batch and a
    503 for the rest (a worker asks for its config before anything else)."""

    def __init__(self, batches: Starlette, idle_settings: EngineSettings) -> None:
        self.batches = batches
        self.idle = msgspec.json.encode(idle_settings)
        self.batch_app: Starlette | None = None
        self.batch: int | None = None
        self.changed = asyncio.Event()  # replaced (and set) at every change: batch mounted, group ended

    def mount(self, app: Starlette | None, batch: int | None = None) -> None:
        self.batch_app, self.batch = app, batch
        self.notify()

    def notify(self) -> None:
        """Wake the calls held for a change (on the event loop)."""
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()

    async def _wait_for_batch(self, scope) -> None:  # noqa: ANN001
        """A worker's `CONFIG_AFTER_BATCH` call: held until another batch is mounted, or its wait."""
        query = dict(pair.split("=", 1) for pair in scope["query_string"].decode().split("&") if "=" in pair)
        try:
            after, wait = int(query[CONFIG_AFTER_BATCH]), min(float(query.get(BATCH_GROUPS_WAIT, "0")), BATCH_WAIT_MAX_S)
        except (KeyError, ValueError):
            return
        deadline = time.monotonic() + wait
        while (self.batch_app is None or self.batch == after) and time.monotonic() < deadline:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.changed.wait(), deadline - time.monotonic())

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        if scope["type"] != "http":
            return None
        if scope["path"].startswith(BATCHES.path):
            return await self.batches(scope, receive, send)
        if scope["path"] == CONFIG.path and scope["query_string"]:
            await self._wait_for_batch(scope)
        app = self.batch_app
        if app is not None:
            return await app(scope, receive, send)
        if scope["path"] == CONFIG.path:
            reply = Response(self.idle, media_type="application/json")
        else:
            reply = _json(ErrorReply("no batch runs now: ask /v1/config until one does"), 503)
        return await reply(scope, receive, send)


class Server:
    def __init__(self, run_dir: RunDir, ownership: Ownership, base: RunConfig, *, workers: int,
                 host: str = "127.0.0.1", port: int = 0, pool: WorkerPool | None = None,
                 clock: Callable[[], float] = time.time, warning_signals: tuple[signal.Signals, ...] = ()) -> None:
        """`warning_signals` (Slurm's, before a time limit): stop as SIGTERM does, and say so in
        `warned`, for the launcher to requeue the job (the batch in flight resumes from the database)."""
        self.run_dir, self.ownership, self.base = run_dir, ownership, base
        self.warning_signals = warning_signals
        self.warned = False
        self.workers, self.host, self.port, self.clock = workers, host, port, clock
        self.pool = pool or WorkerPool(run_dir, workers, simulated=False)
        self.engine: Engine = open_database(run_dir)
        self.control = CoordinatorControl()  # the serve's own calls: creation on its state thread, reads
        self.heap = HeapKeeper()  # the process's collector, for every batch (coordinator/heap.py)
        self.batch_ready = asyncio.Event()
        self.current: Coordinator | None = None
        self.stop_reason: str | None = None
        self.batches_run = 0
        # The job's KV pool, when the serve has one, lives as long as the serve: each batch's
        # coordinator scopes it to the batch (the engines' keys name their chunk's batch).
        self.kv_pool = None if base.kv_pool.mode != "mooncake" else host_pool(
            run_dir, base.kv_pool, host=host, tag=run_tag(run_dir.path, clock()), model_path=base.model_path)
        fingerprint = fingerprint_json(model_fingerprint(base.model_dir))
        self.idle_settings = EngineSettings(base.model_path, base.engine, base.seed, base.spec,
                                            None if self.kv_pool is None else self.kv_pool.engine_settings,
                                            weights_version=weight_version(base.model_path, fingerprint),
                                            serving=True, batch=None)

    # ------------------------------------------------------------------ the API's batch routes
    def batch_routes(self) -> Starlette:
        async def submit(request: Request) -> Response:
            try:
                body = msgspec.json.decode(await request.body(), type=BatchBody)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                return _json(ErrorReply(f"invalid body: {exc}"), 422)
            if self.stop_reason is not None:
                return _json(ErrorReply(f"the serve is stopping ({self.stop_reason})"), 503)
            try:
                batch = await self.control.run(create_batch, self.engine, self.run_dir, self.base, body)
            except BatchRefused as exc:
                return _json(ErrorReply(str(exc)), 422)
            self.batch_ready.set()
            return await self._state(batch)

        async def state(request: Request) -> Response:
            return await self._state(request.path_params["batch"])

        async def groups(request: Request) -> Response:
            after, wait = request.query_params.get(BATCH_GROUPS_AFTER, "0"), request.query_params.get(BATCH_GROUPS_WAIT, "0")
            try:
                wait_s = min(float(wait), BATCH_WAIT_MAX_S)
            except ValueError:
                wait_s = -1.0
            if not (after.isascii() and after.isdigit()) or not wait_s >= 0:
                return _json(ErrorReply(f"{BATCH_GROUPS_AFTER} must be a non-negative integer, {BATCH_GROUPS_WAIT} "
                                        f"a number of seconds"), 422)
            deadline = time.monotonic() + wait_s
            while True:  # held while nothing new ended: the client hears of a group when it ends
                changed = self.dispatch.changed
                reply = await self._read(ended_groups, request.path_params["batch"], int(after))
                if reply is None:
                    return _json(ErrorReply(f"no batch {request.path_params['batch']}"), 404)
                if (not isinstance(reply, GroupsReply) or reply.groups or reply.cursor != int(after)
                        or reply.status in ("finished", "failed") or time.monotonic() >= deadline):
                    return _json(reply)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(changed.wait(), deadline - time.monotonic())

        return Starlette(routes=[Route(BATCHES.path, submit, methods=["POST"]),
                                 Route(BATCHES.path + "/{batch:int}", state, methods=["GET"]),
                                 Route(BATCHES.path + "/{batch:int}/groups", groups, methods=["GET"])],
                         exception_handlers={BodyDigestMismatch: body_mismatch},
                         middleware=[Middleware(BodyLimitMiddleware, limit=BATCH_BODY_LIMIT)])

    async def _state(self, batch: int) -> Response:
        state = await self._read(batch_state, self.run_dir, batch)
        if state is None:
            return _json(ErrorReply(f"no batch {batch}"), 404)
        return _json(state)

    async def _read(self, fn, *args):  # noqa: ANN001, ANN002, ANN202
        def read():  # noqa: ANN202
            with reading(self.run_dir.db_path, ownership=self.ownership) as conn:
                return fn(conn, *args)
        try:
            return await self.control.read(read)
        except UnreadableDatabase as exc:
            return ErrorReply(str(exc))

    # ------------------------------------------------------------------ the serve's life
    def _warned(self, reason: str) -> None:
        self.warned = True
        self.request_stop(reason)

    def request_stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
            log.warning("stopping: %s", reason)
        if self.current is not None:
            self.current.request_stop(reason)
        self.batch_ready.set()

    async def serve(self, on_ready: Callable[[str, int], None] | None = None) -> str:
        """Serve batches until stopped (a signal, or every worker gone); returns why it stopped."""
        secret, metrics_token = self.run_dir.rotate_secret(), self.run_dir.rotate_metrics_token()
        guard = ConnectionGuard(limits_for(self.workers, raise_open_files_limit(self.workers)))
        sock = listening_socket(self.host, self.port)
        host, port = sock.getsockname()[:2]
        address = f"{host}:{port}"
        self.dispatch = Dispatch(self.batch_routes(), self.idle_settings)
        app = SignedCalls(self.dispatch, secret=secret, control=self.control, address=address,
                          metrics_token=metrics_token)
        server = api_server(app, guard)
        loop = asyncio.get_running_loop()
        actions = {signum: partial(self.request_stop, f"signal {signum.name}")
                   for signum in (signal.SIGTERM, signal.SIGINT)}
        actions.update({signum: partial(self._warned, f"warning signal {signum.name}")
                        for signum in self.warning_signals})
        previous = {signum: signal.getsignal(signum) for signum in actions}
        for signum, action in actions.items():
            loop.add_signal_handler(signum, action)
        if self.kv_pool is not None:  # before the workers (and the pool's holders) learn the address
            pool_address = await loop.run_in_executor(None, self.kv_pool.start)
            log.info("KV pool: master %s, generation %d", pool_address.master, pool_address.generation)
        server_task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not server_task.done():
            await asyncio.sleep(0.01)
        self.run_dir.write_address(host, port, os.getpid())
        if on_ready:
            on_ready(host, port)
        self.heap.settle()  # once: the imports out of the collector's way
        try:
            while self.stop_reason is None:
                batch = await self._next_batch()
                if batch is not None:
                    await self._run(batch, secret, address)
        finally:
            server.should_exit = True
            await server_task
            self.control.close()
            self.heap.close()
            self.engine.dispose()
            if self.kv_pool is not None:  # every key of the serve's, then the master and metadata server
                await loop.run_in_executor(None, partial(self.kv_pool.close, run_finished=True))
            for signum, handler in previous.items():
                loop.remove_signal_handler(signum)
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
            if self.ownership.lost is None:
                self.run_dir.address_path.unlink(missing_ok=True)
        return self.stop_reason or "stopped"

    async def _next_batch(self) -> int | None:
        """The next batch to run, waiting for one (and looking after the workers meanwhile)."""
        while self.stop_reason is None:
            self.batch_ready.clear()
            with self.engine.connect() as conn:
                batch = next_batch(conn)
            if batch is not None:
                return batch
            self._supervise()
            if self.kv_pool is not None:
                await self.kv_pool.check()  # a dead master restarted between batches too
            if self.ownership.lost is not None:
                self.request_stop(f"this serve lost the run: {self.ownership.lost}")
            with contextlib.suppress(asyncio.TimeoutError):  # a tick: the workers looked after again
                await asyncio.wait_for(self.batch_ready.wait(), IDLE_TICK_S)
        return None

    def _supervise(self, counts: dict | None = None) -> None:
        """Look after the workers; `counts`: the running batch's (its output is their progress)."""
        reason = self.pool.supervise(rollout_complete=False, progress=counts["output_tokens"] if counts else None)
        for ended in self.pool.take_ended():  # between batches only the warning tells (no run to record in)
            if self.current is not None:
                self.current.note_event("worker_exited", ended.event_data())
        if reason:
            self.request_stop(reason)

    async def _run(self, batch: int, secret: str, address: str) -> CoordinatorResult | None:
        try:
            coordinator = Coordinator(self.run_dir, self.ownership, host=self.host, port=self.port,
                                      expected_workers=self.workers, clock=self.clock, rollout_id=batch,
                                      outputs=batch_dir(self.run_dir, batch), serving=True, heap=self.heap,
                                      pool=self.kv_pool)
        except ModelChanged as exc:  # the checkpoint was rewritten after the batch was submitted
            self._fail(batch, str(exc))
            return None
        self.current = coordinator
        if self.stop_reason is not None:
            coordinator.request_stop(self.stop_reason)
        loop = asyncio.get_running_loop()
        # A group ended (on the batch's state thread, after the commit): held group calls answer.
        coordinator.book.listeners.group_ended.append(lambda _group_id: loop.call_soon_threadsafe(self.dispatch.notify))
        try:
            result = await coordinator.serve_batch(partial(self._mount, batch), secret, address,
                                                   on_tick=self._supervise)
        except Exception as exc:
            log.exception("batch %d failed", batch)
            coordinator.mark_failed(f"{type(exc).__name__}: {exc}")
            return None
        finally:
            self.current = None
            self.dispatch.notify()  # its status changed: held group calls answer at once
        self.batches_run += 1
        if self.pool.exhausted:
            coordinator.mark_failed(result.reason or "workers exited")
        log.info("batch %d: %s", batch, result.status.value)
        return result

    def _mount(self, batch: int, app: Starlette | None) -> None:
        self.dispatch.mount(app, batch if app is not None else None)

    def _fail(self, batch: int, reason: str) -> None:
        log.error("batch %d cannot run: %s", batch, reason)
        with self.engine.begin() as conn:
            queries.rollouts.fail(conn, batch, reason, self.clock())
