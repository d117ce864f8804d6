"""A run directory on a network filesystem (seerd/db/sharing.py): no process opens the database from
another host while the run's coordinator writes it there; `seerd status` reads through the
coordinator's API instead; the coordinator says at start what is safe; `seerd db snapshot` copies a
live run consistently.

No NFS server can run here, so the network verdict is faked: the tests hand seerd a mountinfo in
which the run directory is an NFS export (`faked_nfs_mount`), and "another host" is an owner record
with another host name, written by a real process that owns the run (`holders`) or by the real
coordinator's own ownership. The databases, the coordinator and its API are real."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import socket
import sqlite3
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import seerd.db.filesystem
from seerd.cli.main import cli
from seerd.coordinator.daemon import Coordinator
from seerd.db import queries, read
from seerd.db.read import DatabaseInUseElsewhere
from seerd.db.sharing import coordinator_elsewhere, coordinator_warning
from seerd.ownership import CLOCK_SKEW_S, STALE_AFTER_S, take_ownership
from seerd.status.snapshot import read_snapshot
from tests.unit.helpers import holders, make_book  # noqa: F401 - holders is a fixture
from tests.unit.test_export_live import GROUPS, N, build_run

OTHER_HOST = "gpu-node-17"


def faked_nfs_mount(tmp_path: Path, run_dir: Path, options: str = "rw,vers=4.2,hard,proto=tcp,local_lock=none"
                    ) -> Path:
    """A mountinfo in which `run_dir` is an NFS export mounted on a local root: what seerd reads
    instead of /proc/self/mountinfo, so that it takes the run directory for a network filesystem."""
    point = str(run_dir.resolve()).replace(" ", "\\040")
    path = tmp_path / "mountinfo"
    path.write_text("26 1 259:2 / / rw,relatime shared:1 - ext4 /dev/vda rw,errors=remount-ro\n"
                    f"95 26 0:48 / {point} rw,relatime shared:50 - nfs4 nas01:/export/runs {options}\n")
    return path


def local_mount(tmp_path: Path) -> Path:
    path = tmp_path / "mountinfo-local"
    path.write_text("26 1 259:2 / / rw,relatime shared:1 - ext4 /dev/vda rw,errors=remount-ro\n")
    return path


def database_files(run_dir: Path) -> dict[str, str]:
    """The database and its WAL and index files, by content: what any opening could change."""
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(run_dir.glob("state.db*"))}


def a_run_in_progress(run_dir: Path):  # noqa: ANN201
    """A run database with leases and a report committed (the book keeps its connections open)."""
    book = make_book(run_dir, chunk_tokens=8)
    worker = book.register(rank=0, address="test", max_chunks=2, kv_capacity_tokens=1000, worker_id="w0",
                           now=1000.0).id
    grants = book.lease(worker, 2, now=1001.0)
    from seerd.protocol import ChunkReport

    book.report(worker, ChunkReport(grants[0].chunk_id, grants[0].epoch, [7] * 8, [-1.0] * 8, "length"), now=1002.0)
    return book


def test_no_host_but_the_coordinators_opens_the_database_faked_nfs_mount(tmp_path, holders, monkeypatch):
    run = tmp_path / "run"
    book = a_run_in_progress(run)
    holders(run, host=OTHER_HOST)  # a live owner of the run on another host, beating every 0.1 s
    mountinfo = faked_nfs_mount(tmp_path, run)
    before = database_files(run)

    with pytest.raises(DatabaseInUseElsewhere) as refused, read.reading(run / "state.db", mountinfo=mountinfo):
        pass
    message = str(refused.value)
    for said in (f"{run / 'state.db'} is on a network filesystem (nfs4 nas01:/export/runs mounted at",
                 "live on another host: pid", f"on {OTHER_HOST}", "state.db-shm",
                 "Read the run through the coordinator's API (`seerd status` does)", f"run this on {OTHER_HOST}",
                 "wait until the run stops"):
        assert said in message
    assert refused.value.found.host == OTHER_HOST

    # Every command that would open it says the same and exits; none creates a file beside it.
    monkeypatch.setattr(seerd.db.filesystem, "MOUNTINFO", mountinfo)
    runner = CliRunner()
    for command, exit_code in ((["export", str(run)], 2), (["report", str(run)], 2),
                               (["db", "snapshot", str(run), str(tmp_path / "copy")], 2),
                               (["status", str(run), "--json"], 3)):
        result = runner.invoke(cli, command)
        assert result.exit_code == exit_code, (command, result.output)
        assert "live on another host" in result.output and OTHER_HOST in result.output, (command, result.output)
    assert "its API did not serve the status: no usable coordinator address" in result.output
    assert not (tmp_path / "copy").exists() and not (run / "rollouts.parquet").exists()
    assert database_files(run) == before  # nothing opened it: not even the WAL index changed
    book.close()


def test_the_coordinators_own_host_opens_the_database_faked_nfs_mount(tmp_path, holders):
    run = tmp_path / "run"
    book = a_run_in_progress(run)
    holders(run)  # the live owner is on this host
    mountinfo = faked_nfs_mount(tmp_path, run)
    assert coordinator_elsewhere(run / "state.db", mountinfo=mountinfo) is None
    with read.reading(run / "state.db", mountinfo=mountinfo) as conn:
        assert queries.requests.counts(conn, book.rollout_id).total == 4
    book.close()


def test_without_a_live_coordinator_any_host_opens_the_database_faked_nfs_mount(tmp_path, holders):
    run = tmp_path / "run"
    book = a_run_in_progress(run)
    mountinfo = faked_nfs_mount(tmp_path, run)
    assert coordinator_elsewhere(run / "state.db", mountinfo=mountinfo) is None  # nobody owns the run
    owner = holders(run, host=OTHER_HOST)
    owner.kill()  # its node died: the record stays, its heartbeat stops
    owner.wait()
    now = time.time()
    found = coordinator_elsewhere(run / "state.db", mountinfo=mountinfo, now=now)
    assert found is not None and 0 < found.remote.stale_in_s <= STALE_AFTER_S + CLOCK_SKEW_S
    assert "if that coordinator was killed, its heartbeat is old enough to tell within" in found.explain()
    later = now + STALE_AFTER_S + CLOCK_SKEW_S + 1  # the heartbeat is older than any skew by then
    assert coordinator_elsewhere(run / "state.db", mountinfo=mountinfo, now=later) is None
    book.close()


def test_a_local_or_unknown_filesystem_never_refuses(tmp_path, holders):
    """Another host cannot see a local disk's run directory at all; an unreadable mountinfo is no
    reason to stop anyone."""
    run = tmp_path / "run"
    book = a_run_in_progress(run)
    holders(run, host=OTHER_HOST)
    for mountinfo in (local_mount(tmp_path), tmp_path / "no-mountinfo-here"):
        assert coordinator_elsewhere(run / "state.db", mountinfo=mountinfo) is None
        with read.reading(run / "state.db", mountinfo=mountinfo) as conn:
            assert queries.rollouts.latest(conn) is not None
    assert coordinator_warning(run / "state.db", mountinfo=local_mount(tmp_path)) is None
    book.close()


def test_the_coordinator_says_once_at_start_what_is_safe_faked_nfs_mount(tmp_path, monkeypatch, caplog):
    rundir = build_run(tmp_path / "run")
    monkeypatch.setattr(seerd.db.filesystem, "MOUNTINFO", faked_nfs_mount(tmp_path, rundir.path))
    with caplog.at_level(logging.WARNING, logger="seerd.db"), take_ownership(rundir.path) as ownership:
        coordinator = Coordinator(rundir, ownership, expected_workers=1)
        coordinator.book.close()
        coordinator.engine.dispose()
    warnings = [record.getMessage() for record in caplog.records if "network filesystem" in record.getMessage()]
    assert len(warnings) == 1
    host = socket.gethostname()
    for said in ("nfs4 nas01:/export/runs", f"only processes on this host ({host})",
                 "`seerd status` reads through this coordinator's API", "Never copy the database",
                 "`seerd db snapshot`"):
        assert said in warnings[0]
    assert "ownership" not in warnings[0]  # locks reach the server (local_lock=none)
    nolock = faked_nfs_mount(tmp_path, rundir.path, "rw,vers=3,hard,nolock,proto=tcp,local_lock=all")
    said = coordinator_warning(rundir.db_path, mountinfo=nolock)
    assert "`nolock`, `local_lock=all`: fcntl locks stay on each host" in said
    assert "only the run directory's ownership (owner.json and its heartbeat)" in said


def claim_another_host(run: Path) -> None:
    """Make the run's owner record say that its coordinator runs on OTHER_HOST. Its token stays,
    so the coordinator (here, in this process) goes on owning the run."""
    record = json.loads((run / "owner.json").read_text())
    record.update(host=OTHER_HOST, boot_id="another-boot")
    edited = run / ".owner.edited"
    edited.write_text(json.dumps(record))
    os.replace(edited, run / "owner.json")


def test_status_from_another_host_reads_through_the_coordinators_api_faked_nfs_mount(tmp_path, monkeypatch):
    rundir = build_run(tmp_path / "run")
    monkeypatch.setattr(seerd.db.filesystem, "MOUNTINFO", faked_nfs_mount(tmp_path, rundir.path))
    runner = CliRunner()
    with take_ownership(rundir.path) as ownership:
        coordinator = Coordinator(rundir, ownership, expected_workers=1)

        async def scenario() -> tuple:
            ready = asyncio.Event()
            task = asyncio.create_task(coordinator.serve(on_ready=lambda _host, _port: ready.set()))
            await ready.wait()
            claim_another_host(rundir.path)
            as_json = await asyncio.to_thread(runner.invoke, cli, ["status", str(rundir.path), "--json"])
            once = await asyncio.to_thread(runner.invoke, cli, ["status", str(rundir.path), "--once"],
                                           env={"COLUMNS": "120", "NO_COLOR": "1"})
            try:
                await asyncio.to_thread(read_snapshot, rundir.path)
                direct = "read"
            except DatabaseInUseElsewhere as exc:
                direct = str(exc)
            coordinator.request_stop("test over")
            await task
            return as_json, once, direct

        as_json, once, direct = asyncio.run(scenario())
    assert as_json.exit_code == 0, as_json.output
    snapshot = json.loads(as_json.output)
    assert snapshot["read_through_coordinator"] is True and snapshot["run_dir"] == str(rundir.path)
    assert snapshot["requests_total"] == GROUPS * N and snapshot["state"] == "running"
    assert snapshot["coordinator"]["reachable"] is True
    assert once.exit_code == 0 and "read through its API" in once.output, once.output
    assert "live on another host" in direct and OTHER_HOST in direct  # never opened directly from here


def test_db_snapshot_copies_a_live_run_consistently_for_any_host(tmp_path):
    run = tmp_path / "run"
    book = a_run_in_progress(run)  # its last commits are still in the -wal
    assert (run / "state.db-wal").stat().st_size > 0
    copy = tmp_path / "elsewhere" / "copy"
    runner = CliRunner()
    result = runner.invoke(cli, ["db", "snapshot", str(run), str(copy)])
    assert result.exit_code == 0, result.output
    assert oct((copy / "state.db").stat().st_mode & 0o777) == "0o600"
    assert not (copy / "state.db-wal").exists()  # one self-contained file
    with sqlite3.connect(f"file:{copy / 'state.db'}?immutable=1", uri=True) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
        assert conn.execute("SELECT count(*) FROM chunks WHERE status = 'done'").fetchone()[0] == 1
    status = runner.invoke(cli, ["status", str(copy), "--json"])
    assert status.exit_code == 0, status.output
    assert json.loads(status.output)["output_tokens_committed"] == 8
    again = runner.invoke(cli, ["db", "snapshot", str(run), str(copy)])
    assert again.exit_code == 2 and "exists; choose a new DEST_DIR" in again.output
    book.close()
