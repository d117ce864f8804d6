"""The coordinator daemon: opens the run's database, serves the API, expires leases, finishes.

One process, one asyncio loop. The lease book owns the state; this module only wires it to the
network, the clock and the end of the run (export, then mark finished). It is built on an ownership
of the run directory (seerd/ownership.py) taken before the database is opened for writing; should
another coordinator take the run over, it stops at its next tick without writing the run's end.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import uvicorn
from starlette.applications import Starlette

from seerd.book.book import FORECASTS_PER_TICK, LeaseBook
from seerd.config import RunConfig
from seerd.coordinator.footprint import check_footprint, mem_available_bytes, run_footprint
from seerd.coordinator.heap import HeapKeeper
from seerd.coordinator.load import coordinator_load
from seerd.coordinator.model_identity import verify_model, weight_version
from seerd.cpu import CpuSnapshot
from seerd.db import Engine, Rollout, RolloutStatus, WorkerStatus, add_event, make_engine, make_sessionmaker, queries
from seerd.db.migrate import upgrade_run_database
from seerd.db.read import UnreadableDatabase
from seerd.db.sharing import warn_if_shared
from seerd.db.wal_sync import WalSyncer
from seerd.drafts.host import REFRESH_S, DraftHost, book_sequences, history_sequences
from seerd.io.export import ExportResult, export_run
from seerd.io.prompts import load_model_limits
from seerd.kvpool.host import PoolHost, host_pool, queued_longest, run_tag
from seerd.ownership import Ownership
from seerd.protocol import EngineSettings, StatusReply
from seerd.rundir import RunDir
from seerd.scheduler import make_policy
from seerd.scheduler.registry import policy_traits
from seerd.server.app import CoordinatorControl, create_app
from seerd.server.forwarding import ApiFronts, FrontsGuard, api_processes_for
from seerd.server.guard import (
    ConnectionGuard, api_server, body_limit, limits_for, listening_socket, raise_open_files_limit,
)
from seerd.server.latency import watch_loop_lag
from seerd.status.snapshot import read_snapshot

log = logging.getLogger("seerd.coordinator")

EXPIRY_INTERVAL_S = 0.5
# After the last response, keep answering for this long so that every worker hears "done" and
# says goodbye with its final figures (what `seerd status` and `seerd report` show afterwards).
DONE_LINGER_S = 5.0
# `seerd serve` with grouped drafting: the last this many finished batches' responses to the same
# prompts seed a batch's draft server (its start reads them all: more would slow every start).
HISTORY_BATCHES = 2


class RunNotFound(RuntimeError):
    """No run (database or rollout) where one was expected."""


@dataclass(frozen=True)
class CoordinatorResult:
    status: RolloutStatus
    export: ExportResult | None
    reason: str | None = None
    load: dict | None = None  # where the coordinator's time went (`coordinator.load`)


def open_database(run_dir: RunDir, *, synchronous: str = "FULL") -> Engine:
    """The run's database for writing, its schema brought to head (copied aside first when it moves).
    On a network filesystem, says once what that allows (seerd.db.sharing)."""
    warn_if_shared(run_dir.db_path)
    engine = make_engine(run_dir.db_path, synchronous=synchronous)
    upgrade_run_database(engine, run_dir.db_path)
    return engine


def load_rollout(engine: Engine, rollout_id: int | None = None) -> Rollout:
    """The rollout `rollout_id`, or the latest (a `seerd run` database holds one; `seerd serve`'s
    one per batch)."""
    with make_sessionmaker(engine).begin() as session:
        rollout = queries.rollouts.load(session, rollout_id)
    if rollout is None:
        raise RunNotFound("the run's database holds no rollout" if rollout_id is None else f"no rollout {rollout_id}")
    return rollout


class Coordinator:
    def __init__(self, run_dir: RunDir, ownership: Ownership, *, allow_model_change: bool = False,
                 host: str = "127.0.0.1", port: int = 0,
                 expected_workers: int | None = None, clock: Callable[[], float] = time.time,
                 drain_signals: tuple[signal.Signals, ...] = (), drain_grace_s: float = 120.0,
                 rollout_id: int | None = None, outputs: RunDir | None = None, serving: bool = False,
                 heap: HeapKeeper | None = None, pool: PoolHost | None = None,
                 api_processes: int | None = None) -> None:
        """ModelChanged (model_identity.py) when the run's checkpoint changed, unless allowed.
        `seerd serve` runs one per batch: its `rollout_id`, exported to `outputs`, `serving`, the
        serve's `heap` (settled once for the process: a full collection with vLLM imported took
        0.36 s of every batch's start, on the event loop) and the serve's KV `pool`, if any (it
        lives across batches; this coordinator scopes it to its batch and cleans the batch's keys).
        `api_processes`: front processes that serve the API (forwarding.py); None picks by the
        worker count (`api_processes_for`), 0 serves it in this process."""
        if not run_dir.exists():
            raise RunNotFound(f"no run at {run_dir.path} (no {run_dir.db_path.name})")
        ownership.require(run_dir.path)
        self.ownership = ownership
        self.run_dir = run_dir
        self.clock = clock
        self.host, self.port = host, port
        rollout = self._open_run(rollout_id, allow_model_change, expected_workers)
        self.rollout_id = rollout.id
        self.weights_version = weight_version(rollout.model_path, rollout.model_fingerprint)
        self.outputs = outputs or run_dir
        self.serving = serving
        # Reported tokens are checked against the model's own vocabulary, read here rather than
        # taken from the workers whose reports it checks (the prompts were checked against it too).
        vocab_size = load_model_limits(Path(self.config.model_path)).vocab_size
        self.book = LeaseBook(self.sessions, rollout.id, make_policy(self.config.policy),
                              chunk_tokens=self.config.chunk_tokens, lease_ttl_s=self.config.lease_ttl_s,
                              seed=self.config.seed, vocab_size=vocab_size, in_place=self.config.in_place)
        self.control = CoordinatorControl(self.book, clock=clock, scheduling_gate=self._gate)
        self.max_body_bytes = body_limit(self.config.engine, self.config.chunk_tokens)  # the largest call
        self.heap = heap or HeapKeeper()
        self._own_heap = heap is None
        self._own_pool = pool is None
        self.drafts, self.pool = self._hosts(pool, rollout.created_at)
        self._drafts_refreshed_at = 0.0
        self.started_at = clock()
        self.cpu_started = CpuSnapshot.now()
        self._stop_reason: str | None = None
        self._server: uvicorn.Server | ApiFronts | None = None
        # The API's connection limits and their counters (the fronts' summed, with fronts).
        self.guard: ConnectionGuard | FrontsGuard | None = None
        self.initial_status = rollout.status
        self.load: dict | None = None
        self.expected_workers = expected_workers or self.config.workers
        self.api_processes = api_processes_for(self.expected_workers) if api_processes is None else api_processes
        self._gate_opened = False  # `_gate`: every expected worker came (or the wait ran out)
        # Warning signals (Slurm's `--signal`, before a time limit or preemption): drain, then stop.
        self.drain_signals = drain_signals
        self.drain_grace_s = drain_grace_s
        self._drain_deadline: float | None = None
        self._drain_reason = ""
        self.drained = False  # the run stopped after a drain: the caller requeues the job
        self.drain_recorded = False
        self._noted_events: list[tuple[float, str, dict]] = []  # `note_event`'s, written at the next tick

    def _open_run(self, rollout_id: int | None, allow_model_change: bool, expected_workers: int | None) -> Rollout:
        """The run's database open, its config read, the model checked against the fingerprint it
        was created with, the run's footprint against this machine's memory; the rollout row."""
        self.engine = open_database(self.run_dir)
        rollout = load_rollout(self.engine, rollout_id)
        self.config = RunConfig.from_json(rollout.config_json)
        if self.config.sqlite_synchronous != "FULL":  # pragmas are set per connection: reopen
            self.engine.dispose()
            self.engine = make_engine(self.run_dir.db_path, synchronous=self.config.sqlite_synchronous)
        self.sessions = make_sessionmaker(self.engine)
        try:
            verify_model(self.sessions, rollout, allow_change=allow_model_change, now=self.clock())
            rollout = load_rollout(self.engine, rollout.id)  # with the fingerprint it now runs under
            # Before the book is loaded: a run that cannot fit is refused with what it needs (footprint.py).
            check_footprint(run_footprint(self.engine, rollout.id, expected_workers or self.config.workers),
                            mem_available_bytes())
        except BaseException:
            self.engine.dispose()
            raise
        return rollout

    def _hosts(self, pool: PoolHost | None, created_at: float) -> tuple[DraftHost | None, PoolHost | None]:
        """The job's grouped draft server (Seer's DGDS), only when workers draft from it, and its
        global KV pool (Mooncake master + metadata server) when workers use it (`pool`: the
        serve's), each listening to the book."""
        drafts = DraftHost() if self.config.spec.mode == "grouped" else None
        if drafts is not None:
            self.book.listeners.committed_tokens.append(drafts.committed)
            self.book.listeners.group_ended.append(drafts.group_finished)
        if pool is None and self.config.kv_pool.mode == "mooncake":
            pool = host_pool(self.run_dir, self.config.kv_pool, host=self.host,
                             tag=run_tag(self.run_dir.path, created_at), model_path=self.config.model_path)
        if pool is not None:
            self.book.listeners.request_ended.append(pool.request_finished)
            self.book.listeners.group_ended.append(pool.group_finished)
        return drafts, pool

    @property
    def _owns_run(self) -> bool:
        """False once another coordinator has taken the run over: this one then writes nothing more."""
        return self.ownership.lost is None

    # A policy that binds every group once waits for the expected workers (or a timeout) at the
    # start. Once open the gate stays open: a worker taken out mid-run closed it again, and the
    # live ones got nothing until it came back (its requests sat queued for the restart's 24 s,
    # tests/integration/test_stuck_engines.py); `group` rebinds a gone worker's groups itself.
    def _gate(self) -> bool:
        if self._gate_opened:
            return True
        if not policy_traits(self.config.policy).waits_for_every_worker and not self.config.wait_for_workers:
            self._gate_opened = True
            return True
        # list() copies in one step: the state thread may be registering a worker right now.
        alive = [w for w in list(self.book.workers.values()) if w.status == WorkerStatus.ALIVE]
        if len(alive) >= self.expected_workers or self.clock() - self.started_at > self.config.worker_wait_s:
            self._gate_opened = True
        return self._gate_opened

    def request_stop(self, reason: str) -> None:
        """Stop handing out work and shut down; the run stays resumable."""
        if self._stop_reason is None:
            self._stop_reason = reason
            self.control.accepting = False
            self.control.work_queued()  # long-polling lease calls answer now, not at their deadline
            log.warning("stopping: %s", reason)

    def request_drain(self, reason: str) -> None:
        """Stop handing out leases; stop once in-flight chunks reported or the grace period ends.

        Nothing is lost either way: a chunk still leased at the end runs again after the restart.
        """
        if self._drain_deadline is None and self._stop_reason is None:
            self._drain_deadline = self.clock() + self.drain_grace_s
            self._drain_reason = reason
            self.control.accepting = False
            self.control.work_queued()
            log.warning("draining (%s): no new leases; waiting up to %.0fs for %d in flight", reason,
                        self.drain_grace_s, len(self.book.state.leases))

    def _signal_actions(self) -> dict[signal.Signals, Callable[[], None]]:
        """Every signal the coordinator handles, in one place."""
        actions = {signum: partial(self.request_stop, f"signal {signum.name}")
                   for signum in (signal.SIGTERM, signal.SIGINT)}
        for signum in self.drain_signals:
            actions[signum] = partial(self.request_drain, f"signal {signum.name}")
        return actions

    def engine_settings(self) -> EngineSettings:
        kv_pool = None if self.pool is None else self.pool.engine_settings
        return EngineSettings(self.config.model_path, self.config.engine, self.config.seed, self.config.spec,
                              kv_pool, weights_version=self.weights_version, serving=self.serving,
                              batch=self.rollout_id)

    async def _start_drafts(self) -> None:
        """Give the draft server every unfinished group with its tokens so far (and the earlier
        rollout's responses with --spec-history) before any worker asks."""
        if self.drafts is None:
            return
        self.drafts.seed(await self.control.run(book_sequences, self.book))
        history, rollouts = self.config.spec.history_run_dir, None
        if self.serving:  # the serve's earlier batches of the same prompts, from its own database
            history, rollouts = str(self.run_dir.path), self._earlier_batches()
        if history and rollouts != []:
            try:
                seeded = history_sequences(RunDir(Path(history)).db_path, self.run_dir.db_path,
                                           list(self.book.state.unfinished_groups), ownership=self.ownership,
                                           rollouts=rollouts)
            except UnreadableDatabase as exc:  # drafting from history is an accelerator: say so, go on
                log.warning("--spec-history %s unreadable, drafting without it: %s", history, exc)
                seeded = {}
            self.drafts.seed(seeded)
            await self.control.run(self.record_event, "spec_history_seeded",
                                   {"run_dir": history, "groups": len(seeded), "rollouts": rollouts,
                                    "responses": sum(len(v) for v in seeded.values())})

    def _earlier_batches(self) -> list[int]:
        """`seerd serve`: the finished batches before this one whose responses seed its drafts."""
        with self.engine.connect() as conn:
            return queries.rollouts.finished_before(conn, self.rollout_id, HISTORY_BATCHES)

    def status_snapshot(self, tail_rows: int, status: StatusReply) -> dict:
        """`seerd status`'s snapshot, read here for a host that may not open the database itself
        (seerd.db.sharing); on the API's reader thread, never the state thread."""
        return read_snapshot(self.run_dir.path, tail_rows=tail_rows, coordinator=status, ownership=self.ownership)

    def _refresh_drafts(self) -> None:
        if self.drafts is not None and self.clock() - self._drafts_refreshed_at >= REFRESH_S:
            self._drafts_refreshed_at = self.clock()
            self.drafts.register(list(self.book.state.unfinished_groups))

    async def serve(self, on_tick: Callable[[dict], None] | None = None,
                    on_ready: Callable[[str, int], None] | None = None) -> CoordinatorResult:
        if self.initial_status == RolloutStatus.FINISHED:
            return CoordinatorResult(RolloutStatus.FINISHED, None, "already finished")
        self._begin()
        # Fresh credentials for this start, before anything (the KV pool's engines, workers) reads them.
        secret, metrics_token = self.run_dir.rotate_secret(), self.run_dir.rotate_metrics_token()
        open_files = raise_open_files_limit(self.expected_workers)
        guard = ConnectionGuard(limits_for(self.expected_workers, open_files))
        sock = listening_socket(self.host, self.port)
        host, port = sock.getsockname()[:2]
        await self._start_hosts()
        app = self.create_app(secret, f"{host}:{port}", metrics_token)
        if self.api_processes:
            self._server = ApiFronts(app, self.control, self.api_processes, secret=secret, address=f"{host}:{port}",
                                     metrics_token=metrics_token, limits=guard.limits,
                                     max_body_bytes=self.max_body_bytes)
            self.guard = self._server.guard
        else:
            self._server = api_server(app, guard)  # signal handlers are ours, below, in one place
            self.guard = guard
        app.state.guard = self.guard  # its counters on /metrics
        loop = asyncio.get_running_loop()
        actions = self._signal_actions()
        previous = {signum: signal.getsignal(signum) for signum in actions}
        for signum, action in actions.items():
            loop.add_signal_handler(signum, action)
        server_task = asyncio.create_task(self._server.serve(sockets=[sock]))
        server_task.add_done_callback(self._server_ended)
        lag_task = asyncio.create_task(watch_loop_lag(self.control.turns))
        while not self._server.started and not server_task.done():
            await asyncio.sleep(0.01)
        self.run_dir.write_address(host, port, os.getpid())
        if on_ready:
            on_ready(host, port)
        try:
            result = await self._watch(on_tick)
        finally:
            self._server.should_exit = True
            lag_task.cancel()
            await asyncio.wait([server_task])  # its failure is the stop's reason (`_server_ended`)
            await self._end()
            for signum, handler in previous.items():
                loop.remove_signal_handler(signum)
                # asyncio leaves SIG_DFL behind; a late warning signal must not kill the process.
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
            if self._owns_run:  # else the address is the new owner's
                self.run_dir.address_path.unlink(missing_ok=True)
        return result

    def _server_ended(self, task: asyncio.Task) -> None:
        if task.cancelled() or self._server is None or self._server.should_exit:
            return
        failure = task.exception()
        log.error("the API server stopped before the run did", exc_info=failure)
        self.request_stop(f"the API server stopped: {failure or 'it ended'}")

    async def serve_batch(self, mount: Callable[[Starlette | None], None], secret: str, address: str,
                          on_tick: Callable[[dict], None] | None = None) -> CoordinatorResult:
        """`seerd serve`: this rollout on the serve's listener, which checks the signatures
        (`mount(app)` puts this rollout's API behind it, `mount(None)` takes it away); the
        serve owns the credentials, the socket and the signals."""
        if self.initial_status == RolloutStatus.FINISHED:
            return CoordinatorResult(RolloutStatus.FINISHED, None, "already finished")
        self._begin()
        await self._start_hosts()
        mount(self.create_app(secret, address, None, signed=False))
        lag_task = asyncio.create_task(watch_loop_lag(self.control.turns))
        try:
            return await self._watch(on_tick)
        finally:
            mount(None)
            lag_task.cancel()
            await self._end()
            self.engine.dispose()

    def _begin(self) -> None:
        """The book loaded, a resume recorded, the rollout running."""
        now = self.clock()
        self.book.load(now)
        if self.config.sqlite_synchronous in ("FULL", "EXTRA"):  # below that, no fsync is wanted
            # Reports are acknowledged after an fsync of the WAL that runs off the state thread.
            self.control.wal_syncer = WalSyncer(self.run_dir.db_path)
            self.book.reports_synced_later = True
        if self._own_heap:
            self.heap.settle()  # the imports and the loaded book out of the collector's full passes
        if self.initial_status in (RolloutStatus.RUNNING, RolloutStatus.INTERRUPTED, RolloutStatus.FAILED):
            with self.sessions.begin() as session:
                add_event(session, self.rollout_id, now, "rollout_resumed",
                          data={"previous_status": self.initial_status.value, **self.book.counts()})
        self.book.set_rollout_status(RolloutStatus.RUNNING, now)

    async def _start_hosts(self) -> None:
        """The draft server and the KV pool, before workers can learn the coordinator's address."""
        await self._start_drafts()
        if self.pool is not None:
            self.pool.begin_batch(self.rollout_id)
        if self.pool is not None and self._own_pool:
            address = await asyncio.get_running_loop().run_in_executor(None, self.pool.start)
            await self.control.run(self.record_event, "kv_pool_started",
                                   {"master": address.master, "generation": address.generation})

    def create_app(self, secret: str, address: str, metrics_token: str | None, *, signed: bool = True) -> Starlette:
        app = create_app(self.control, secret, drafts=self.drafts,
                         max_body_bytes=self.max_body_bytes,
                         address=address, metrics_token=metrics_token, snapshot=self.status_snapshot,
                         signed=signed)
        app.state.engine_settings = self.engine_settings()
        app.state.kv_pool = self.pool
        return app

    async def _end(self) -> None:
        """After the watch: workers retired, the state thread, book, draft server and pool closed."""
        if self._owns_run:  # else the workers are the new owner's to retire
            await self.control.run(self.book.retire_workers)
        self.control.close()
        if self.control.wal_syncer is not None:  # after the state thread: no report commits any more
            self.control.wal_syncer.close()
        if self._own_heap:
            self.heap.close()
        self.book.close()  # the state thread's kept connection (a later write opens its own)
        if self.drafts is not None:
            self.drafts.close()
        if self.pool is not None:  # the serve's pool outlives its batch: only the batch's keys go
            ended = partial(self.pool.close, run_finished=self.book.is_complete()) if self._own_pool \
                else self.pool.end_batch
            figures = await asyncio.get_running_loop().run_in_executor(None, ended)
            # The state thread is closed: the events are ours now.
            self.record_event("kv_pool_stopped" if self._own_pool else "kv_pool_batch_ended", figures)

    async def _watch(self, on_tick: Callable[[dict], None] | None) -> CoordinatorResult:
        run = self.control.run
        while True:
            if not self._owns_run:
                return CoordinatorResult(RolloutStatus.INTERRUPTED, None,
                                         f"this coordinator lost the run: {self.ownership.lost}")
            if self.book.broken is not None:  # its state is past the database's: resume from the database
                self.request_stop(f"the lease book stopped ({self.book.broken}); resume the run from its database")
            elif expired := await run(self.book.expire, self.clock()):
                self.control.work_queued(expired)
            await run(self.book.persist_soft_state, FORECASTS_PER_TICK)
            await run(self.heap.tick)
            await run(self._refresh_drafts)
            if self.pool is not None and await self.pool.check(partial(run, queued_longest, self.book.state)):
                await run(self.record_event, "kv_pool_restarted", {"restarts": self.pool.restarts})
            if on_tick:
                on_tick(await run(self.book.counts))
            await self._write_noted_events()
            if self.book.is_complete():
                return await self._finish()
            if self._drain_deadline is not None and self._stop_reason is None:
                in_flight = await run(lambda: len(self.book.state.leases))
                if not self.drain_recorded:
                    self.drain_recorded = True
                    await run(self.record_event, "rollout_draining", {"reason": self._drain_reason, "in_flight": in_flight})
                if not in_flight or self.clock() >= self._drain_deadline:
                    self.drained = True
                    self._stop_reason = (f"drained after {self._drain_reason}; {in_flight} chunks were still "
                                         f"in flight (they run again after the restart)")
            if self._stop_reason is not None:
                await run(self.book.set_rollout_status, RolloutStatus.INTERRUPTED, self.clock(), self._stop_reason)
                return CoordinatorResult(RolloutStatus.INTERRUPTED, None, self._stop_reason)
            await asyncio.sleep(EXPIRY_INTERVAL_S)

    async def _finish(self) -> CoordinatorResult:
        export = await self.control.run(self._export_and_finish)
        deadline = self.clock() + DONE_LINGER_S
        while self.clock() < deadline and self._stop_reason is None:
            live = await self.control.run(lambda: [w.id for w in self.book.live_workers()])
            if not any(w not in self.control.left for w in live):
                break
            await asyncio.sleep(0.1)
        return CoordinatorResult(RolloutStatus.FINISHED, export, load=self.load)

    def _export_and_finish(self) -> ExportResult:
        """On the state thread: write the outputs, then mark the rollout finished."""
        export_started = time.perf_counter()
        with self.sessions.begin() as session:
            export = export_run(session, self.rollout_id, self.outputs)
        self.load = coordinator_load(self.book, self.control, self.heap, started_at=self.started_at,
                                     cpu_started=self.cpu_started, now=self.clock(),
                                     export_s=time.perf_counter() - export_started)
        with self.sessions.begin() as session:
            add_event(session, self.rollout_id, self.clock(), "coordinator_load", data=self.load)
        # Outputs are on disk before the run is marked finished: a crash in between re-exports.
        self.book.set_rollout_status(RolloutStatus.FINISHED, self.clock())
        return export

    def record_event(self, kind: str, data: dict, ts: float | None = None) -> None:
        """One event in its own transaction (outside the state thread only before or after `serve`)."""
        if not self._owns_run:
            log.warning("not recorded (the run is no longer ours): %s %s", kind, data)
            return
        with self.sessions.begin() as session:
            add_event(session, self.rollout_id, self.clock() if ts is None else ts, kind, data=data)

    def note_event(self, kind: str, data: dict) -> None:
        """An event from the event loop's thread while the run is served (a supervisor's tick): the
        state thread writes it at the next tick, before a stop the same tick asked for."""
        self._noted_events.append((self.clock(), kind, data))

    async def _write_noted_events(self) -> None:
        noted, self._noted_events = self._noted_events, []
        for ts, kind, data in noted:
            await self.control.run(self.record_event, kind, data, ts)

    def mark_failed(self, reason: str) -> None:
        if self._owns_run:
            self.book.set_rollout_status(RolloutStatus.FAILED, self.clock(), reason)
