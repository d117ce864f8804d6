"""A worker: one engine, leasing chunks up to its capacity, reporting them, heartbeating, until
the rollout is done (the process around it: `seerd.worker.main`).

Workers hold no state that matters: a report is retried until answered (reports are idempotent),
and a killed worker's leases expire and run elsewhere. No answer of the coordinator ends a worker
(`seerd.worker.client`): a 4xx is logged and the worker carries on, registering again when the
coordinator no longer knows it; only a coordinator gone for longer than the patience does (exit 3).
A worker exits 4, to be started afresh by its supervisor, when its engine is dead or when the
coordinator took it out (`Retired`: its engine stopped stepping, or failed what others ran;
`seerd.book.liveness`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from typing import NamedTuple

from seerd.drafts.drafter import drafter_stats
from seerd.kvpool.pool import pool_stats
from seerd.protocol import (
    HEARTBEAT, LEASE, LEASE_LONG_POLL_S, REGISTER, RELEASE, REPORT,
    ChunkGrant, ChunkReport, HeartbeatBody, HeartbeatReply, LeaseBody, RegisterBody,
    ReleaseBody, ReportBody, ReportReply, lease_key, parse_engine_id,
)
from seerd.worker.client import (
    Backoff, CoordinatorClient, CoordinatorRefused, NotRegistered, Retired,
)
from seerd.worker.engine import Engine, EngineDead, Stream
from seerd.worker.stats import WorkerStats

log = logging.getLogger("seerd.worker")

BEAT_CARRIED_AFTER = 0.75  # of a heartbeat interval: when a report carries the heartbeat


def generation_budget(grant: ChunkGrant) -> int:
    """The chunk's budget, cut at the response's target length when the row has one."""
    if grant.target_remaining is None:
        return grant.max_tokens
    return min(grant.max_tokens, grant.target_remaining)


def reported_finish_reason(grant: ChunkGrant, finish_reason: str, num_tokens: int) -> str:
    """Say "length_target" when the chunk ended because the response reached its target (as if
    the model emitted EOS there); an EOS before it stays "stop"."""
    if finish_reason == "length" and grant.target_remaining == num_tokens:
        return "length_target"
    return finish_reason


def engine_figures(engine: Engine) -> dict | None:
    return None if engine.counters is None else engine.counters.figures()


class LoadedWeights(NamedTuple):
    version: str  # `EngineSettings.weights_version` of the checkpoint the engine holds
    reload_s: float  # how long loading it in place took (0: the engine started with it)


class LostContinuation(RuntimeError):
    """A `continues` grant for a request whose engine request is no longer held here: the chunk
    is given back unrun (not a failure) and runs elsewhere from its durable tokens."""


class RunningRequest(NamedTuple):
    engine_id: str  # the engine request (named after the chunk that started it)
    stream: Stream
    start: int  # where the next chunk's tokens begin in the stream


class Worker:
    def __init__(self, client: CoordinatorClient, engine: Engine, rank: int,
                 weights: LoadedWeights | None = None) -> None:
        self.client = client
        self.weights = weights or LoadedWeights("", 0.0)  # what it registers with
        self.engine = engine
        self.rank = rank
        self.worker_id = f"w{rank}-{socket.gethostname()}-{os.getpid()}"
        self.running: dict[int, tuple[int, asyncio.Task]] = {}  # chunk_id -> (epoch, task)
        self.engine_ids: dict[int, str] = {}  # chunk_id -> the engine's request id (see seerd.protocol)
        self.offsets: dict[int, tuple[str, int]] = {}  # chunk_id -> (its engine request's lease key, start)
        # In-place continuation: engine requests that run on past a reported chunk, by request id,
        # until the report's reply continues them (`ChunkGrant.continues`) or not (then stopped).
        self.held: dict[int, RunningRequest] = {}
        self.held_by_chunk: dict[int, int] = {}  # reported chunk id -> its request id, while held
        self.reports: asyncio.Queue[ChunkReport] = asyncio.Queue()
        self.done = asyncio.Event()
        self.slot_freed = asyncio.Event()
        self.stats = WorkerStats()
        # CPU clocks from here on (after the engine's warm-up): the event loop thread's own (reports,
        # grants, heartbeats: what a chunk costs the worker beside the engine) and the process's.
        self._cpu_since = (time.thread_time(), time.process_time())
        self.heartbeat_interval_s = 2.0
        self.beat_at = time.monotonic()  # when the last heartbeat was sent, on its own or in a report
        self.stopped_by: str | None = None
        self.fatal: BaseException | None = None

    def stop(self, why: str) -> None:
        """A signal: stop leasing; in-flight chunks are given back so they run elsewhere at once."""
        log.warning("stopping on %s with %d chunks in flight", why, len(self.running))
        self.stopped_by = why
        self.done.set()

    async def release_all(self, why: str) -> None:
        for chunk_id, (epoch, task) in list(self.running.items()):
            task.cancel()
            try:
                await asyncio.wait_for(self.client.call(RELEASE, ReleaseBody(
                    self.worker_id, chunk_id, epoch, reason=f"worker stopped ({why})")), timeout=2.0)
            except Exception:  # best effort: the coordinator may be gone; the lease then expires
                return

    async def register(self) -> None:
        reply = await self.client.call_until_answered(REGISTER, RegisterBody(
            self.worker_id, self.rank, address=f"{socket.gethostname()}:{os.getpid()}",
            max_chunks=self.engine.max_chunks, kv_capacity_tokens=self.engine.kv_capacity_tokens,
            kv_block_tokens=self.engine.kv_block_tokens, weights_version=self.weights.version,
            weights_loaded_s=self.weights.reload_s, dtype=self.engine.dtype))
        self.worker_id = reply.worker_id
        self.heartbeat_interval_s = reply.heartbeat_interval_s
        self.beat_at = time.monotonic()
        log.info("registered as %s (capacity %d chunks, %d KV tokens, %s)", self.worker_id,
                 self.engine.max_chunks, self.engine.kv_capacity_tokens, self.engine.dtype)

    async def run(self) -> None:
        await self.register()
        loops = [asyncio.create_task(coro) for coro in (self._lease_loop(), self._report_loop(),
                                                         self._heartbeat_loop())]
        done_wait = asyncio.create_task(self.done.wait())
        finished, _ = await asyncio.wait([done_wait, *loops], return_when=asyncio.FIRST_COMPLETED)
        for task in [done_wait, *loops]:
            task.cancel()
        for task in finished:
            if task is not done_wait and task.exception() is not None:
                raise task.exception()

    async def run_to_end(self) -> None:
        """`run`, then, stopped, give back the chunks in flight, or, done, say goodbye with the
        final figures (an engine that died does neither)."""
        await self.run()
        if self.stopped_by:
            await self.release_all(self.stopped_by)
        elif self.fatal is None:
            await self.say_goodbye()

    async def _lease_loop(self) -> None:
        refused = Backoff(cap_s=10.0)
        while not self.done.is_set():
            wanted = self.engine.max_chunks - len(self.running)
            retry_after = 0.2
            if wanted > 0:
                try:
                    reply = await self.client.call(LEASE, LeaseBody(self.worker_id, wanted, LEASE_LONG_POLL_S))
                except NotRegistered:
                    await self._reregister()
                    continue
                except CoordinatorRefused as exc:
                    wait = refused.next()
                    log.error("lease call refused (%s); again in %.1fs", exc, wait)
                    await asyncio.sleep(wait)
                    continue
                refused.reset()
                if reply.done:
                    self.done.set()
                    return
                for grant in reply.chunks:
                    self._start_chunk(grant)
                retry_after = reply.retry_after_s
                if reply.chunks:
                    continue
            self.slot_freed.clear()
            with contextlib.suppress(asyncio.TimeoutError):  # poll again after retry_after
                await asyncio.wait_for(self.slot_freed.wait(), timeout=retry_after)

    def _start_chunk(self, grant: ChunkGrant) -> None:
        task = asyncio.create_task(self._run_chunk(grant))
        self.running[grant.chunk_id] = (grant.epoch, task)

    def _open(self, grant: ChunkGrant) -> RunningRequest:
        """The engine request a grant runs in: the one kept running for its request (`continues`),
        or a new one; with `run_on` it may generate past the chunk, up to the response's end."""
        if grant.continues:
            held = self.held.pop(grant.request_id, None)
            if held is None:  # stopped meanwhile (an abort, a re-registration): nothing to continue
                raise LostContinuation(f"no running engine request for request {grant.request_id}")
            return held
        engine_id = grant.identity.engine_id
        limit = generation_budget(grant)
        if grant.run_on:
            limit = grant.response_remaining if grant.target_remaining is None else \
                min(grant.response_remaining, grant.target_remaining)
        return RunningRequest(engine_id, self.engine.open(engine_id, grant.prompt_token_ids, limit, grant.sampling,
                                                          stream=grant.run_on), 0)

    async def _run_chunk(self, grant: ChunkGrant) -> None:
        chunk_id, epoch = grant.chunk_id, grant.epoch
        opened = None
        try:
            opened = self._open(grant)
            self.engine_ids[chunk_id] = opened.engine_id
            identity = parse_engine_id(opened.engine_id)
            self.offsets[chunk_id] = (identity.lease_key if identity else opened.engine_id, opened.start)
            budget = generation_budget(grant)
            await opened.stream.until(opened.start + budget)
            result, runs_on = opened.stream.result(opened.start, budget)
        except asyncio.CancelledError:
            if opened is not None:
                await self.engine.abort(opened.engine_id)
            raise
        except Exception as exc:  # the engine failed this chunk: give it back, it runs elsewhere
            log.exception("chunk %d failed", chunk_id)
            if opened is not None:
                await self.engine.abort(opened.engine_id)
            self._forget(chunk_id)
            self.slot_freed.set()
            # Not taken (a restarted coordinator already voided the lease; a refusal): it expires.
            with contextlib.suppress(NotRegistered, CoordinatorRefused, Retired):
                await self.client.call(RELEASE, ReleaseBody(self.worker_id, chunk_id, epoch, repr(exc)[:2000],
                                                            failed=not isinstance(exc, LostContinuation)))
            if isinstance(exc, EngineDead):  # nothing more can run here: exit, to be restarted
                self.fatal = exc
                self.done.set()
            return
        self.stats.chunk_done(chunk_id, len(result.token_ids))
        finish_reason = reported_finish_reason(grant, result.finish_reason, len(result.token_ids))
        runs_on = runs_on and finish_reason == "length"
        if runs_on:  # held until the report's reply says whether it continues here
            self.held_by_chunk[chunk_id] = grant.request_id
            self.held[grant.request_id] = opened._replace(start=opened.start + len(result.token_ids))
        await self.reports.put(ChunkReport(chunk_id, epoch, result.token_ids, result.logprobs, finish_reason,
                                           result.cached_tokens, running_on=runs_on))

    def _forget(self, chunk_id: int) -> None:
        self.running.pop(chunk_id, None)
        self.engine_ids.pop(chunk_id, None)
        self.offsets.pop(chunk_id, None)

    async def _settle_held(self, batch: list[ChunkReport], grants: list[ChunkGrant]) -> None:
        """After a report's reply: start its grants (a `continues` one picks up the engine request
        held for it) and stop every held request the reply did not continue."""
        continued = {grant.request_id for grant in grants if grant.continues}
        stopped = []
        for report in batch:
            request_id = self.held_by_chunk.pop(report.chunk_id, None)
            if request_id is not None and request_id not in continued:
                held = self.held.pop(request_id, None)
                if held is not None:  # tokens past the boundary were never reported: dropped
                    stopped.append(held.engine_id)
        # The grants take their slots before the first await, so the lease loop never sees them free.
        for grant in grants:
            self._start_chunk(grant)
        for engine_id in stopped:
            await self.engine.abort(engine_id)

    async def _report_loop(self) -> None:
        while True:
            batch = [await self.reports.get()]
            while not self.reports.empty():
                batch.append(self.reports.get_nowait())
            # The slots this batch frees (finished or stopped chunks) are filled from its reply; the
            # running-on ones the coordinator counts itself.
            freed = 0 if self.done.is_set() else \
                self.engine.max_chunks - (len(self.running) - len(batch)) - sum(r.running_on for r in batch)
            try:
                reply = await self.client.call(REPORT, ReportBody(self.worker_id, batch, wanted=max(0, freed),
                                                                  heartbeat=self._beat_if_due()))
            except NotRegistered:
                log.warning("coordinator restarted: dropping %d reports of void leases", len(batch))
                reply = ReportReply(results=[], done=False)
                await self._reregister()
            except CoordinatorRefused as exc:
                log.error("report of %d chunks refused (%s): giving them back to run again", len(batch), exc)
                reply = ReportReply(results=[], done=False)
                for report in batch:  # best effort: a lease not given back expires
                    with contextlib.suppress(NotRegistered, CoordinatorRefused):
                        await self.client.call(RELEASE, ReleaseBody(self.worker_id, report.chunk_id, report.epoch,
                                                                    f"report refused: {exc}"[:200]))
            for result in reply.results:
                if not result.accepted:
                    log.warning("report of chunk %d rejected: %s", result.chunk_id, result.reason)
            for report in batch:
                self._forget(report.chunk_id)
            await self._settle_held(batch, reply.grants)
            self.slot_freed.set()
            if reply.heartbeat is not None:
                await self._heard(reply.heartbeat)
            if reply.done:
                self.done.set()

    def _heartbeat(self, leaving: bool = False) -> HeartbeatBody:
        stats = self.stats.payload({cid: self.offsets.get(cid, (lease_key(cid, epoch), 0))
                                    for cid, (epoch, _) in self.running.items()},
                                   self.engine.live, drafter_stats(), pool_stats(),
                                   engine_figures(self.engine))
        stats["cpu"] = {"loop_s": time.thread_time() - self._cpu_since[0],
                        "process_s": time.process_time() - self._cpu_since[1]}
        return HeartbeatBody(self.worker_id, list(self.running), stats, self.engine.progress(), leaving=leaving)

    async def say_goodbye(self) -> None:
        """The rollout is done: one last heartbeat with the final figures (drafted and accepted
        tokens, chunks), which the coordinator waits for before it stops. Best effort: a
        coordinator already gone keeps the figures of the last periodic heartbeat."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.client.call(HEARTBEAT, self._heartbeat(leaving=True)), timeout=2.0)

    async def _heartbeat_loop(self) -> None:
        while True:
            due = self.beat_at + self.heartbeat_interval_s - time.monotonic()
            if due > 0:  # a report may carry one meanwhile: then it is due later
                await asyncio.sleep(due)
                continue
            self.beat_at = time.monotonic()  # a refused one is tried again an interval later
            try:
                reply = await self.client.call(HEARTBEAT, self._heartbeat())
            except NotRegistered:
                await self._reregister()
                continue
            except CoordinatorRefused as exc:  # the next one may pass; leases not extended meanwhile expire
                log.error("heartbeat refused (%s)", exc)
                continue
            await self._heard(reply)

    def _beat_if_due(self) -> HeartbeatBody | None:
        """A heartbeat for a report about to go out, once `BEAT_CARRIED_AFTER` of an interval has
        passed since the last one was sent: a worker that reports that often makes no
        heartbeat call of its own, and beats at most 1 / BEAT_CARRIED_AFTER times as often as its
        heartbeat loop would (at one half, busy workers beat twice as often). Counted from when it
        is sent: one lost with its call leaves the next to the heartbeat loop, an interval later
        (four fit in a lease's TTL)."""
        now = time.monotonic()
        if now - self.beat_at < self.heartbeat_interval_s * BEAT_CARRIED_AFTER:
            return None
        self.beat_at = now
        return self._heartbeat()

    async def _heard(self, reply: HeartbeatReply) -> None:
        """A heartbeat's answer, from its own call or a report's."""
        if reply.interval_s is not None:
            self.heartbeat_interval_s = reply.interval_s
        for chunk_id in reply.abort:
            await self._abort(chunk_id)
        if reply.done:
            self.done.set()

    async def _abort(self, chunk_id: int) -> None:
        entry = self.running.get(chunk_id)
        if entry is None:
            return
        _epoch, task = entry
        task.cancel()
        engine_id = self.engine_ids.get(chunk_id)
        self._forget(chunk_id)
        request_id = self.held_by_chunk.pop(chunk_id, None)
        if request_id is not None:  # reported and held: its engine request stops too
            self.held.pop(request_id, None)
        if engine_id is not None:
            await self.engine.abort(engine_id)
        self.slot_freed.set()

    async def _reregister(self) -> None:
        await self.drop_engine_requests()
        await self.register()

    async def drop_engine_requests(self) -> None:
        """Abort every engine request of this worker's, running or held past a report."""
        for chunk_id in list(self.running):
            await self._abort(chunk_id)
        for held in list(self.held.values()):
            await self.engine.abort(held.engine_id)
        self.held.clear()
        self.held_by_chunk.clear()
