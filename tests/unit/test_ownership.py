"""One live coordinator per run directory (seerd/ownership.py), with real processes: a live owner is
refused and named, a dead or silent one is taken over, racing takers end with one owner, and an
owner that was taken over notices and leaves its successor's record alone."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from seerd.ownership import (
    OWNER_FILE, OwnerRecord, RunOwned, _publish, _write_beat, process_start, read_owner, take_ownership,
    this_process,
)
from tests.unit.helpers import holders, python  # noqa: F401  (holders is a fixture)

# A process that tries to own RUN_DIR and says how it went; an owner holds on until stdin closes.
TAKE = """
import sys
from pathlib import Path
from seerd.ownership import RunOwned, take_ownership
try:
    ownership = take_ownership(Path(sys.argv[1]))
except RunOwned as exc:
    print("refused", exc.owner.pid, flush=True)
    sys.exit(0)
print("owned", flush=True)
sys.stdin.read()
ownership.release()
"""



def stale_record(run: Path, *, host: str = "node-elsewhere", beat_age_s: float = 0.0, **fields) -> OwnerRecord:
    """Publish an owner record of another process (by default on another node) with one heartbeat."""
    record = dataclasses.replace(this_process(), host=host, **fields)
    beat_fd = _publish(run, record)
    _write_beat(beat_fd, 7, time.time() - beat_age_s)
    os.close(beat_fd)
    return record


def test_a_live_owner_on_this_host_is_refused_and_named(tmp_path, holders):
    owner = holders(tmp_path)
    with pytest.raises(RunOwned) as refused:
        take_ownership(tmp_path)
    message = str(refused.value)
    assert f"pid {owner.pid} on {os.uname().nodename}" in message and "since 20" in message
    assert refused.value.owner.pid == owner.pid and read_owner(tmp_path).pid == owner.pid


def test_a_killed_owner_on_this_host_is_taken_over_at_once_even_as_a_zombie(tmp_path, holders):
    owner = holders(tmp_path)
    dead = read_owner(tmp_path)
    owner.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{owner.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":  # not reaped yet
        assert time.monotonic() < deadline
        time.sleep(0.01)
    started = time.monotonic()
    with take_ownership(tmp_path) as ownership:
        assert time.monotonic() - started < 1.0
        assert read_owner(tmp_path).token == ownership.record.token
        assert not (tmp_path / f"owner-{dead.token}.beat").exists()  # the dead owner's heartbeat went with it
    assert read_owner(tmp_path) is None and not list(tmp_path.iterdir())  # release leaves nothing behind


def test_a_reused_pid_is_not_the_owner(tmp_path):
    # The record names a running process (our parent) but another start time: that pid was reused.
    stale_record(tmp_path, host=os.uname().nodename, pid=os.getppid(), pid_started=process_start(os.getppid()) + 1)
    with take_ownership(tmp_path) as ownership:
        assert read_owner(tmp_path).pid == os.getpid() == ownership.record.pid


def test_a_remote_owner_whose_heartbeat_moves_is_refused_and_named(tmp_path, holders):
    owner = holders(tmp_path, host="node-elsewhere")
    started = time.monotonic()
    with pytest.raises(RunOwned) as refused:
        take_ownership(tmp_path, stale_after_s=30, heartbeat_s=0.1)
    assert time.monotonic() - started < 5  # one beat is enough, no waiting for the bound
    assert f"pid {owner.pid} on node-elsewhere" in str(refused.value) and "last heartbeat" in str(refused.value)


def test_a_remote_owner_with_an_old_heartbeat_is_taken_over_at_once(tmp_path):
    stale_record(tmp_path, beat_age_s=3600)
    started = time.monotonic()
    with take_ownership(tmp_path, stale_after_s=30):
        assert time.monotonic() - started < 1.0
        assert read_owner(tmp_path).host == os.uname().nodename


def test_a_silent_remote_owner_is_taken_over_after_the_bound(tmp_path):
    """A Slurm job requeued on another node: its predecessor was killed a moment ago, so its last
    heartbeat is recent, but it never beats again."""
    silent = stale_record(tmp_path, beat_age_s=0.5)
    started = time.monotonic()
    with take_ownership(tmp_path, stale_after_s=1.0, heartbeat_s=0.1) as ownership:
        waited = time.monotonic() - started
        assert 1.0 <= waited < 5, waited
        assert ownership.record.token != silent.token and read_owner(tmp_path).token == ownership.record.token


def test_racing_takers_of_a_dead_owner_end_with_exactly_one(tmp_path):
    stale_record(tmp_path, host=os.uname().nodename, pid=999_999_999)  # no such process
    takers = [python(TAKE, str(tmp_path), stdin=subprocess.PIPE) for _ in range(4)]
    try:
        answers = {proc.pid: proc.stdout.readline().split() for proc in takers}
        owners = [pid for pid, answer in answers.items() if answer == ["owned"]]
        assert len(owners) == 1, answers
        assert all(answer == ["refused", str(owners[0])] for pid, answer in answers.items() if pid != owners[0])
        assert read_owner(tmp_path).pid == owners[0]
    finally:
        for proc in takers:
            proc.stdin.close()
            proc.wait(timeout=30)
    assert read_owner(tmp_path) is None


def test_an_owner_taken_over_notices_and_leaves_its_successor_alone(tmp_path):
    ownership = take_ownership(tmp_path, heartbeat_s=3600)  # beats only when the test says
    ownership.beat()
    assert ownership.lost is None
    # A taker that judged us stale (say we were frozen for minutes on another node): its own record.
    os.rename(tmp_path / OWNER_FILE, tmp_path / "moved-away")
    successor = stale_record(tmp_path)
    ownership.beat()
    assert ownership.lost is not None and "node-elsewhere" in ownership.lost
    ownership.release()
    assert read_owner(tmp_path) == successor


def test_the_record_says_who_and_since_when(tmp_path):
    before = time.time()
    with take_ownership(tmp_path) as ownership:
        record = read_owner(tmp_path)
        assert (tmp_path / OWNER_FILE).stat().st_mode & 0o777 == 0o600
    assert record == ownership.record
    assert record.pid == os.getpid() and record.host == os.uname().nodename and before <= record.since <= time.time()
    assert record.pid_started == process_start(os.getpid()) and record.boot_id and record.pid_namespace
    assert record.slurm_job_id == os.environ.get("SLURM_JOB_ID")
