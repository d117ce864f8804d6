"""The job's KV pool, as the coordinator runs it: the Mooncake master and metadata server (started,
watched, restarted and stopped with the job by `PoolService`) and the pool's cleaning.

Everything that may block (process starts, store calls) runs on the `seerd-kvpool` thread, never
on the event loop or the lease book's state thread. The book tells it when a request or a group
finished; it then removes that request's blocks (and, at the group's end, the group's prompt
blocks) by the key scopes of `seerd.kvpool.keys`, and at the end of a finished run every key of
the run. A restarted master has lost every key anyway: workers recompute meanwhile and repopulate
it, which is why `check()` only restarts and records the fact.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

from seerd.kvpool.address import read_pool_address
from seerd.kvpool.keys import group_pattern, request_pattern, run_pattern
from seerd.kvpool.store import PoolUnavailable, close_quietly, open_store

log = logging.getLogger("seerd.coordinator")

CHECK_EVERY_S = 2.0
CLEANER_BUFFER_BYTES = 16 << 20


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


class PoolHost:
    def __init__(self, service, tag: str, *, local_host: str) -> None:  # noqa: ANN001
        self.service = service  # seerd.kvpool.service.PoolService
        self.tag = tag
        self.local_host = local_host
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="seerd-kvpool")
        self._store = None
        self._checked_at = 0.0
        self.restarts = 0
        self.removed_requests = 0
        self.removed_groups = 0
        self.remove_errors = 0
        self.latest: dict = {}  # pool figures as of the last check (what /v1/status serves)

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
                                     buffer_bytes=CLEANER_BUFFER_BYTES)
        except PoolUnavailable as exc:  # cleaning is best effort: the pool's own eviction bounds it
            log.warning("KV pool: no cleaning client (%s)", exc)
            self._store = None

    # ------------------------------------------------------------------ from the lease book (state thread)
    def request_finished(self, group_id: int, request_id: int) -> None:
        self._thread.submit(self._remove, request_pattern(self.tag, group_id, request_id), "request")

    def group_finished(self, group_id: int) -> None:
        self._thread.submit(self._remove, group_pattern(self.tag, group_id), "group")

    def _remove(self, pattern: str, scope: str) -> None:
        if self._store is None:
            return
        try:
            removed = self._store.remove_by_regex(pattern, force=True)
        except Exception as exc:  # noqa: BLE001 - a failed removal leaves blocks to the pool's eviction
            removed = -1
            log.debug("KV pool: remove %s failed: %s", pattern, exc)
        if removed < 0:
            self.remove_errors += 1
        elif scope == "request":
            self.removed_requests += 1
        elif scope == "group":
            self.removed_groups += 1

    # ------------------------------------------------------------------ from the coordinator's watch loop
    async def check(self) -> bool:
        """Restart a dead master or metadata server and refresh `latest` (at most every
        CHECK_EVERY_S); True if it restarted."""
        now = time.monotonic()
        if now - self._checked_at < CHECK_EVERY_S:
            return False
        self._checked_at = now
        restarted = await self.run(self._check)
        self.latest = await self.run(self._figures)  # replaced whole: readers never see it half-made
        return restarted

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

    def _figures(self) -> dict:
        return {**self.service.stats(), "restarts": self.restarts, "removed_requests": self.removed_requests,
                "removed_groups": self.removed_groups, "remove_errors": self.remove_errors}

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
