"""The job's KV pool, as the coordinator runs it: the Mooncake master and metadata server (started,
watched, restarted and stopped with the job by `PoolService`) and the pool's cleaning.

Everything that may block (process starts, store calls) runs on the `seerd-kvpool` thread, never
on the event loop or the lease book's state thread. The book tells it when a request or a group
finished; it then removes that request's blocks (and, at the group's end, the group's prompt
blocks) by the key scopes of `seerd.kvpool.keys`, at the end of a `seerd serve` batch every key
of the batch, and at the end of a finished run (or serve) every key of the run. A restarted master has lost every key anyway: workers recompute meanwhile and repopulate
it, which is why `check()` only restarts and records the fact.

The pool's budget: finished requests' blocks go at once; when the pool still fills past
TRIM_ABOVE of its capacity, `check()` removes the blocks of the requests queued longest (the
book's queue, `queued_longest`, asked on its state thread), one request at a time, until the pool is
under TRIM_BELOW (estimated, see `TrimBudget`). Only a request's own blocks (`r<request>`) go: its group's prompt blocks serve
its siblings too, running ones included, and go when the group finishes. Leased requests are
never queued, so a running request keeps its blocks. Nothing is lost: a trimmed request's next
chunk recomputes what it does not find (the connector treats a missing block as a miss, and a
block removed between its lookup and its load as a failed load, which vLLM recomputes).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import msgspec

from seerd.book.records import WaitingRequest
from seerd.kvpool.address import read_pool_address
from seerd.kvpool.keys import batch_scope, group_pattern, request_pattern, run_pattern
from seerd.kvpool.store import PoolUnavailable, close_quietly, open_store
from seerd.rundir import RunDir
from seerd.scheduler.state import SchedulerState
from seerd.settings import KVPoolConfig, PoolSettings

log = logging.getLogger("seerd.coordinator")

CHECK_EVERY_S = 2.0
# Near the budget the pool is read this often instead: engines save a few MB/s each, and between
# two checks 2 s apart a small pool went from under 70% past Mooncake's 80% (a rollout test).
CHECK_NEAR_BUDGET_S = 0.5
CLEANER_BUFFER_BYTES = 16 << 20
# The budget order holds only if the coordinator frees room before Mooncake evicts in its own
# order (from service.EVICTION_HIGH_WATERMARK, 0.8 of capacity). The gap up to 0.8 absorbs the
# puts of one check interval; the gap between the two makes each trim free a tenth of the pool
# rather than a request per check.
TRIM_ABOVE = 0.7
TRIM_BELOW = 0.6
# Requests asked of the book per check: bounds the state thread's walk of the queue and one
# check's removals, each a regex scan of every key on the master (measured: 17 ms at 10,000 keys).
TRIM_REQUESTS_PER_CHECK = 64

QueuedLongest = Callable[[int, WaitingRequest | None], Awaitable[list[WaitingRequest]]]


def queued_longest(state: SchedulerState, limit: int, after: WaitingRequest | None = None) -> list[WaitingRequest]:
    """Up to `limit` requests waiting in the queue, queued longest first (ties by request id),
    those after `after` only when given. Only requests that have run on a worker: the others
    hold no blocks of their own in the KV pool. Leased (running) requests are never queued. On
    the state thread (the queue is the lease book's)."""
    start = None if after is None else (after.queued_at, after.request_id)
    waiting = []
    for queued in state.queue.fcfs(start):
        if len(waiting) == limit:
            break
        if queued.last_worker is not None:
            waiting.append(WaitingRequest(queued.group_id, queued.request_id, queued.queued_at))
    return waiting


def run_tag(run_path: Path, created_at: float) -> str:
    """Names this rollout's keys: another run (even of the same prompts and model) never matches."""
    return hashlib.blake2b(f"{run_path.resolve()}|{created_at!r}".encode(), digest_size=6).hexdigest()


def model_revision(model_path: str) -> str:
    """The model's revision as the pool sees it: its config and the size and modification time of
    each weight file (a content hash of GBs of weights would cost minutes at every start)."""
    root = Path(model_path)
    digest = hashlib.blake2b(digest_size=12)
    config = root / "config.json"
    digest.update(config.read_bytes() if config.is_file() else b"")
    for weights in sorted(list(root.glob("*.safetensors")) + list(root.glob("*.bin"))):
        info = weights.stat()
        digest.update(f"{weights.name}|{info.st_size}|{info.st_mtime_ns}".encode())
    return digest.hexdigest()


def host_pool(run_dir: RunDir, kv_pool: KVPoolConfig, *, host: str, tag: str, model_path: str) -> PoolHost:
    """The pool a coordinator (or a serve) runs, not started yet; its engines' settings name `tag`
    and `model_path`'s revision."""
    from seerd.kvpool.service import PoolService

    service = PoolService(run_dir.path, host, protocol=kv_pool.protocol, devices=kv_pool.devices, log_dir=run_dir.logs)
    settings = PoolSettings(**msgspec.structs.asdict(kv_pool), run_tag=tag, model_revision=model_revision(model_path))
    return PoolHost(service, tag, local_host=host, engine_settings=settings)


@dataclass
class TrimBudget:
    """How far one trim must bring the pool's usage down, and how far it has brought it.

    What a removal freed is estimated as blocks removed times the pool's mean block size: every
    block of a run has one size (one model, block size and dtype), and the master's figures read
    again would also count the engines' puts meanwhile."""

    used_bytes: float
    target_bytes: float
    block_bytes: float

    @classmethod
    def needed(cls, figures: dict) -> TrimBudget | None:
        """None while the pool is under TRIM_ABOVE of its capacity (or the master did not answer)."""
        used, capacity, keys = figures.get("bytes_used"), figures.get("capacity_bytes"), figures.get("keys")
        if not used or not capacity or not keys or used < TRIM_ABOVE * capacity:
            return None
        return cls(used, TRIM_BELOW * capacity, used / keys)

    def removed(self, blocks: int) -> None:
        self.used_bytes -= blocks * self.block_bytes

    @property
    def met(self) -> bool:
        return self.used_bytes < self.target_bytes


class PoolHost:
    """The pool as one coordinator (`seerd run`) or one serve (`seerd serve`, across its batches)
    hosts it: `tag` names the run's keys, `scope` the running batch's (`begin_batch`), which the
    book's removals and the trims use; `engine_settings` is what the engines' connectors start with."""

    def __init__(self, service, tag: str, *, local_host: str,  # noqa: ANN001
                 engine_settings: PoolSettings | None = None) -> None:
        self.service = service  # seerd.kvpool.service.PoolService
        self.tag = tag
        self.scope = tag  # until a batch begins (tests of the cleaning alone)
        self.engine_settings = engine_settings or PoolSettings()
        self.local_host = local_host
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="seerd-kvpool")
        self._store = None
        self._checked_at = 0.0
        self.restarts = 0
        self.removed_requests = 0
        self.removed_groups = 0
        self.remove_errors = 0
        self.trimmed_requests = 0
        self.trimmed_blocks = 0
        self.trimmed_bytes = 0  # estimated, see TrimBudget
        # The last request a trim dealt with: the next trim asks for requests queued after it.
        # One before it that still waits has not completed a chunk since (a report queues a
        # request anew), so it holds at most what the engine of a lease that expired saved.
        self._trimmed_through: WaitingRequest | None = None
        self.latest: dict = {}  # pool figures as of the last check (what /v1/status serves)
        self._counted_before: dict = {}  # the counters when the running batch began

    async def run(self, fn, *args):  # noqa: ANN001, ANN002, ANN201
        return await asyncio.get_running_loop().run_in_executor(self._thread, partial(fn, *args))

    def start(self):  # noqa: ANN201
        """Start the master and metadata server; returns the pool's address (on the pool's thread)."""
        return self._thread.submit(self._start).result()

    def _start(self):  # noqa: ANN202
        address = self.service.start()
        self._open_cleaner(address)
        return address

    def _open_cleaner(self, address) -> None:  # noqa: ANN001
        try:
            self._store = open_store(address, local_host=self.local_host, segment_bytes=0,
                                     buffer_bytes=CLEANER_BUFFER_BYTES,
                                     log_path=self.service.log_dir / "kvpool-cleaner.log")
        except PoolUnavailable as exc:  # cleaning is best effort: the pool's own eviction bounds it
            log.warning("KV pool: no cleaning client (%s)", exc)
            self._store = None

    # ------------------------------------------------------------------ a batch (a rollout) at a time
    def begin_batch(self, batch: int) -> None:
        """The rollout whose keys the book's removals and the trims name from now on (before its
        book hands out work: the engines scope a chunk's keys by its rollout, from its engine id)."""
        self.scope = batch_scope(self.tag, batch)
        self._trimmed_through = None
        self._counted_before = self._counters()

    def end_batch(self) -> dict:
        """`seerd serve`, after a batch: remove every key left in its scope (blocks saved after
        their group's removal; a batch that did not finish runs again only after a serve restart,
        with a new pool); returns the pool's figures after, its counters the batch's own."""
        def finish() -> dict:
            self._remove(run_pattern(self.scope), "batch")
            before = self._counted_before
            return {**self._figures(), **{name: count - before.get(name, 0) for name, count in self._counters().items()}}

        return self._thread.submit(finish).result()

    def _counters(self) -> dict:
        return {"restarts": self.restarts, "removed_requests": self.removed_requests,
                "removed_groups": self.removed_groups, "remove_errors": self.remove_errors,
                "trimmed_requests": self.trimmed_requests, "trimmed_blocks": self.trimmed_blocks,
                "trimmed_bytes": self.trimmed_bytes}

    # ------------------------------------------------------------------ from the lease book (state thread)
    def request_finished(self, group_id: int, request_id: int) -> None:
        self._thread.submit(self._remove, request_pattern(self.scope, group_id, request_id), "request")

    def group_finished(self, group_id: int) -> None:
        self._thread.submit(self._remove, group_pattern(self.scope, group_id), "group")

    def _remove(self, pattern: str, scope: str, *, force: bool = True) -> int:
        """Remove the keys `pattern` matches; returns how many went (-1: the store failed)."""
        if self._store is None:
            return 0
        try:
            removed = self._store.remove_by_regex(pattern, force=force)
        except Exception as exc:  # noqa: BLE001 - a failed removal leaves blocks to the pool's eviction
            removed = -1
            log.debug("KV pool: remove %s failed: %s", pattern, exc)
        if removed < 0:
            self.remove_errors += 1
        elif scope == "request":
            self.removed_requests += 1
        elif scope == "group":
            self.removed_groups += 1
        return removed

    # ------------------------------------------------------------------ from the coordinator's watch loop
    async def check(self, queued_longest: QueuedLongest | None = None) -> bool:
        """Restart a dead master or metadata server, refresh `latest` and, with `queued_longest`
        (the book's, run on its state thread), trim a pool over its budget; at most every
        CHECK_EVERY_S (CHECK_NEAR_BUDGET_S once past TRIM_BELOW). True if it restarted."""
        now = time.monotonic()
        if now - self._checked_at < (CHECK_NEAR_BUDGET_S if self._near_budget() else CHECK_EVERY_S):
            return False
        self._checked_at = now
        restarted = await self.run(self._check)
        self.latest = await self.run(self._figures)  # replaced whole: readers never see it half-made
        if queued_longest is not None and TrimBudget.needed(self.latest) is not None:
            waiting = await queued_longest(TRIM_REQUESTS_PER_CHECK, self._trimmed_through)
            if waiting:
                self.latest = await self.run(self._trim, waiting)
        return restarted

    def _near_budget(self) -> bool:
        used, capacity = self.latest.get("bytes_used"), self.latest.get("capacity_bytes")
        return bool(used and capacity and used >= TRIM_BELOW * capacity)

    def _check(self) -> bool:
        if not self.service.check():
            return False
        self.restarts += 1
        log.warning("KV pool restarted (generation %s): workers recompute until it fills again",
                    getattr(self.service, "generation", "?"))
        self._close_cleaner()
        address = read_pool_address(self.service.run_dir)
        if address is not None:
            self._open_cleaner(address)
        return True

    def _trim(self, waiting: list[WaitingRequest]) -> dict:
        """Remove the own blocks of `waiting`'s requests, in its order, until the pool is under
        TRIM_BELOW of its capacity (estimated); returns the pool's figures after."""
        budget = TrimBudget.needed(self.service.stats())
        if budget is None or self._store is None:
            return self._figures()
        for request in waiting:
            if budget.met:
                break
            # Unforced: if the request was leased since the book named it, a block an engine is
            # reading right now keeps its read lease and stays.
            removed = self._remove(request_pattern(self.scope, request.group_id, request.request_id),
                                   "trim", force=False)
            if removed < 0:
                break  # the master is gone or failing: the next check restarts it
            self._trimmed_through = request
            if removed:
                self.trimmed_requests += 1
                self.trimmed_blocks += removed
                self.trimmed_bytes += round(removed * budget.block_bytes)
                budget.removed(removed)
        return self._figures()

    def _figures(self) -> dict:
        return {**self.service.stats(), **self._counters()}

    def close(self, *, run_finished: bool) -> dict:
        """Remove a finished run's keys, stop the pool; returns its last figures (after the
        removals queued before, which run first)."""
        def finish() -> dict:
            if run_finished and self._store is not None:
                self._remove(run_pattern(self.tag), "run")
            figures = self._figures()
            self._close_cleaner()
            self.service.stop()
            return figures

        figures = self._thread.submit(finish).result()
        self._thread.shutdown(wait=True)
        return figures

    def _close_cleaner(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            close_quietly(store)  # the master may be gone already
