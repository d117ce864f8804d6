"""`db.wal_sync.WalSyncer` and the report answers that wait for it: a report is acknowledged only
after an fsync of the WAL that began after its commit; a failed fsync fails every wait from then
on and stops the book. The fsync is the real one, or one held until the test lets it go (so that
nothing depends on timing); the file it is handed is checked to be the WAL."""

from __future__ import annotations

import asyncio
import errno
import os
import queue
import stat
import threading
from pathlib import Path

import pytest
from sqlalchemy import text

from seerd.book.records import ReportCall
from seerd.book.records import BookBroken
from seerd.db import make_engine
from seerd.db.base import begin
from seerd.db.wal_sync import WalSyncer
from seerd.protocol import ChunkReport
from seerd.server.control import CoordinatorControl
from tests.unit.helpers import FakeClock, make_book, rows

WAIT_S = 30  # only ever reached when something is broken


class HeldFsync:
    """An fsync that records which file each call was for, and holds each call on a regular
    file until `release` lets it go (directories pass at once)."""

    def __init__(self, fail_first: bool = False) -> None:
        self.started: queue.Queue[int] = queue.Queue()  # inodes of held calls, as they begin
        self._released = threading.Semaphore(0)
        self.fail_first = fail_first
        self.files: list[int] = []

    def __call__(self, fd: int) -> None:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            return
        self.files.append(info.st_ino)
        self.started.put(info.st_ino)
        assert self._released.acquire(timeout=WAIT_S)
        if self.fail_first:
            self.fail_first = False
            raise OSError(errno.EIO, "simulated write-back failure")
        os.fsync(fd)

    def release(self) -> None:
        self._released.release()


def wal_database(tmp_path: Path):  # noqa: ANN201
    engine = make_engine(tmp_path / "state.db", synchronous="FULL")
    with begin(engine) as conn:
        conn.execute(text("CREATE TABLE t (x INTEGER)"))
    return engine


def waiter() -> tuple[threading.Event, list, object]:
    done, got = threading.Event(), []

    def synced(failure: BaseException | None) -> None:
        got.append(failure)
        done.set()
    return done, got, synced


def test_a_wait_ends_only_after_an_fsync_of_the_wal_that_began_after_it(tmp_path):
    engine = wal_database(tmp_path)
    wal_inode = os.stat(f"{tmp_path / 'state.db'}-wal").st_ino
    fsync = HeldFsync()
    syncer = WalSyncer(tmp_path / "state.db", fsync=fsync)
    first_done, first, first_synced = waiter()
    second_done, second, second_synced = waiter()
    with begin(engine, durable=False) as conn:
        conn.execute(text("INSERT INTO t VALUES (1)"))
    syncer.after_next_sync(first_synced)
    assert fsync.started.get(timeout=WAIT_S) == wal_inode  # the first fsync has begun, and holds
    with begin(engine, durable=False) as conn:  # committed while that fsync runs: it needs the next
        conn.execute(text("INSERT INTO t VALUES (2)"))
    syncer.after_next_sync(second_synced)
    assert not first_done.is_set()
    fsync.release()
    assert first_done.wait(WAIT_S) and first == [None]
    assert fsync.started.get(timeout=WAIT_S) == wal_inode  # the second has begun...
    assert not second_done.is_set()  # ...and the second wait is not over before it ends
    fsync.release()
    assert second_done.wait(WAIT_S) and second == [None]
    syncer.close()
    assert syncer.syncs == 2 and fsync.files == [wal_inode, wal_inode]
    engine.dispose()


def test_a_failed_fsync_fails_its_waits_and_every_later_one(tmp_path):
    wal_database(tmp_path).dispose()
    (tmp_path / "state.db-wal").touch()  # (the close above folded the WAL away: one to sync)
    fsync = HeldFsync(fail_first=True)
    syncer = WalSyncer(tmp_path / "state.db", fsync=fsync)
    done, got, synced = waiter()
    syncer.after_next_sync(synced)
    fsync.started.get(timeout=WAIT_S)
    meanwhile_done, meanwhile, meanwhile_synced = waiter()
    syncer.after_next_sync(meanwhile_synced)  # waits for the next fsync: there is none to trust
    fsync.release()
    fsync.release()  # (were a second fsync made, it would succeed)
    assert done.wait(WAIT_S) and isinstance(got[0], OSError) and got[0].errno == errno.EIO
    # The disk may have dropped pages that failed: a later fsync's success proves nothing.
    assert meanwhile_done.wait(WAIT_S) and meanwhile == [syncer.failure]
    later_done, later, later_synced = waiter()
    syncer.after_next_sync(later_synced)
    assert later_done.wait(WAIT_S) and later == [syncer.failure] and fsync.files == [fsync.files[0]]
    syncer.close()


def test_without_a_wal_file_there_is_nothing_to_sync_and_close_answers_who_waits(tmp_path):
    calls = []
    syncer = WalSyncer(tmp_path / "state.db", fsync=calls.append)
    done, got, synced = waiter()
    syncer.after_next_sync(synced)
    syncer.close()
    assert done.is_set() and got == [None] and calls == []
    with pytest.raises(RuntimeError, match="closed"):
        syncer.after_next_sync(synced)


def test_a_new_wal_file_has_its_directory_synced_once(tmp_path):
    engine = wal_database(tmp_path)
    synced_modes = []

    def fsync(fd: int) -> None:
        synced_modes.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        os.fsync(fd)
    syncer = WalSyncer(tmp_path / "state.db", fsync=fsync)
    for _ in range(2):
        done, _got, synced = waiter()
        syncer.after_next_sync(synced)
        assert done.wait(WAIT_S)
    syncer.close()
    assert synced_modes == [False, True, False]  # the WAL, its directory once, the WAL again
    engine.dispose()


def _report_behind(tmp_path, fsync: HeldFsync):  # noqa: ANN001, ANN202
    """A book whose report answers wait for `fsync`, and a report of the chunk its worker holds."""
    clock = FakeClock()
    book = make_book(tmp_path, policy="divided", prompt_rows=rows(groups=1, n=2, max_tokens=20), now=clock())
    book.register(rank=0, address="x", max_chunks=1, kv_capacity_tokens=1000, worker_id="w0", now=clock())
    (grant,) = book.lease("w0", 1, clock())
    control = CoordinatorControl()
    control.wal_syncer = WalSyncer(Path(book.engine.url.database), fsync=fsync)
    book.reports_synced_later = True
    call = ReportCall("w0", [ChunkReport(grant.chunk_id, grant.epoch, [5] * 4, [-0.5] * 4, "stop")])
    return book, control, call, clock


def test_a_report_is_answered_only_once_its_commit_is_synced(tmp_path):
    fsync = HeldFsync()
    book, control, call, clock = _report_behind(tmp_path, fsync)

    async def scenario() -> None:
        answer = asyncio.ensure_future(control.report(book, call, clock))
        await asyncio.get_running_loop().run_in_executor(None, fsync.started.get, True, WAIT_S)
        # Committed (the book has applied it) and being synced: not acknowledged yet.
        assert book.state.finished_requests == 1 and not answer.done()
        fsync.release()
        outcomes, _grants, _abort = await answer
        assert [o.accepted for o in outcomes] == [True]

    asyncio.run(asyncio.wait_for(scenario(), 60))
    control.close()
    control.wal_syncer.close()
    assert control.turns.figures()["reports synced"]["calls"] == 1 and book.broken is None


def test_a_failed_sync_answers_the_report_with_its_error_and_stops_the_book(tmp_path):
    fsync = HeldFsync(fail_first=True)
    book, control, call, clock = _report_behind(tmp_path, fsync)
    fsync.release()

    async def scenario() -> None:
        with pytest.raises(OSError, match="write-back"):  # never acknowledged: the API answers 5xx
            await control.report(book, call, clock)

    asyncio.run(asyncio.wait_for(scenario(), 60))
    control.close()  # (after its last task: stopping the book)
    control.wal_syncer.close()
    assert book.broken is not None and "fsync" in book.broken
    with pytest.raises(BookBroken):
        book.lease("w0", 1, clock())


def test_a_sync_failing_after_the_state_thread_stopped_still_answers_and_stops_the_book(tmp_path):
    # As at a coordinator's end: the state thread is closed while a group's fsync runs.
    fsync = HeldFsync(fail_first=True)
    book, control, call, clock = _report_behind(tmp_path, fsync)

    async def scenario() -> None:
        answer = asyncio.ensure_future(control.report(book, call, clock))
        await asyncio.get_running_loop().run_in_executor(None, fsync.started.get, True, WAIT_S)
        control.close()
        fsync.release()
        with pytest.raises(OSError, match="write-back"):
            await answer

    asyncio.run(asyncio.wait_for(scenario(), 60))
    control.wal_syncer.close()
    assert book.broken is not None and "fsync" in book.broken
