"""Durable commits whose fsync runs off the committing thread (`WalSyncer`).

With `synchronous=FULL` SQLite fsyncs the WAL inside every durable commit, so the coordinator's
state thread, which owns the lease book, sat idle through each group commit's fsync while lease
calls and the next reports waited behind it: at 512 workers (`tools/bench/load.py`) ~120 s of fsyncs
in a 775 s run, 2.4 ms each on average under load (0.26 ms on the idle disk). Instead the state thread commits reports as SQLite's
`synchronous=NORMAL` does (written to the WAL, atomic, surviving a killed process) and goes on;
this thread fsyncs the WAL file and only then are those reports acknowledged. A commit is durable
once an fsync of the WAL that began after it has returned: the file's pages written by then
reach the disk, the same guarantee FULL gives. Each fsync covers every commit made before it
began (group commit, now pipelined: the next group is written while the last one is synced).

What a power loss can take is what was never acknowledged. SQLite's WAL recovery keeps a prefix
of the commits (its frames are checksummed in a chain), so the database stays consistent; leases
were never durable anyway (a restarted coordinator re-queues them).

An fsync that fails is fatal for the process's view of the disk: the kernel may have dropped the
pages it could not write, and a later fsync succeeding says nothing about them. Every wait from
then on fails (`failure`), and the coordinator stops its run, to be resumed from the database.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("seerd.db")

Synced = Callable[[BaseException | None], None]  # called with None once durable, or the failure


class WalSyncer:
    """fsyncs a database's WAL file on a thread of its own, for whoever waits (`after_next_sync`)."""

    def __init__(self, db_path: Path, *, fsync: Callable[[int], None] = os.fsync) -> None:
        self._wal = Path(f"{db_path}-wal")
        self._fsync = fsync
        self._cond = threading.Condition()
        self._waiting: list[Synced] = []
        self._closed = False
        self._inode: int | None = None  # the WAL file last synced (a new one: its directory entry too)
        self.failure: BaseException | None = None
        self.syncs = 0
        self.sync_s = 0.0  # time inside fsync, in total, and the longest
        self.longest_sync_s = 0.0
        self._thread = threading.Thread(target=self._run, name="seerd-wal-sync", daemon=True)
        self._thread.start()

    def after_next_sync(self, synced: Synced) -> None:
        """Call `synced(None)` (on this object's thread) once an fsync of the WAL that began after
        this call has returned: everything committed before the call is then on disk. After a
        failed fsync, `synced(failure)`, now or then."""
        with self._cond:
            failure = self.failure
            if failure is None:
                if self._closed:
                    raise RuntimeError("the WAL syncer is closed")
                self._waiting.append(synced)
                self._cond.notify()
        if failure is not None:
            synced(failure)

    def close(self) -> None:
        """Sync for whoever still waits, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if not self._waiting:
                    return
                batch, self._waiting = self._waiting, []
            error = self._sync_once()
            for synced in batch:
                try:
                    synced(error)
                except Exception:  # noqa: BLE001 - one waiter's failure is not the others'
                    log.exception("a WAL sync waiter failed")

    def _sync_once(self) -> BaseException | None:
        if self.failure is not None:
            return self.failure
        started = time.perf_counter()
        try:
            self._sync_wal()
        except OSError as exc:
            log.critical("fsync of %s failed: commits since the last sync may not be on disk (%r)", self._wal, exc)
            with self._cond:
                self.failure = exc
            return exc
        took = time.perf_counter() - started
        self.syncs += 1
        self.sync_s += took
        self.longest_sync_s = max(self.longest_sync_s, took)
        return None

    def _sync_wal(self) -> None:
        try:
            fd = os.open(self._wal, os.O_RDONLY)
        except FileNotFoundError:
            # No WAL: SQLite removes it only after copying every frame into the database file
            # and syncing that (the last connection's close).
            return
        try:
            self._fsync(fd)
            inode = os.fstat(fd).st_ino
        finally:
            os.close(fd)
        if inode != self._inode:  # a new WAL file: its name must survive a power loss too
            directory = os.open(self._wal.parent, os.O_RDONLY)
            try:
                self._fsync(directory)
            finally:
                os.close(directory)
            self._inode = inode
