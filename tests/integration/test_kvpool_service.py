"""The KV pool's lifecycle on real Mooncake processes (no vLLM): service, holder, clients, a master
killed -9 and restarted, what each process listens on, and nothing left behind."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from seerd.kvpool.address import POOL_FILE, read_pool_address
from seerd.kvpool.holder import HOLDER_LOG, HolderProcess
from seerd.kvpool.service import MASTER_LOG, METADATA_LOG, PoolService
from seerd.kvpool.store import MiB, close_quietly, open_store
from tests.integration.harness import live_processes, wait_for

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(120)]

HOST = "127.0.0.1"
SEGMENT = 64 * MiB
VALUE = 1 * MiB


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket `pid` listens on, from /proc (no `ss` needed)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with open(table) as handle:
            next(handle)
            for line in handle:
                fields = line.split()
                if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                    continue
                hex_address, hex_port = fields[1].split(":")
                found.append((_decode_address(hex_address, width), int(hex_port, 16)))
    return found


def _decode_address(hex_address: str, width: int) -> str:
    raw = bytes.fromhex(hex_address)
    if width == 8:
        return ".".join(str(b) for b in raw[::-1])
    words = [raw[i:i + 4][::-1] for i in range(0, 16, 4)]  # four host-order 32-bit words
    return ":".join(b"".join(words).hex()[i:i + 4] for i in range(0, 32, 4))


def session_members(sid: int) -> list[int]:
    return [pid for pid, fields in live_processes().items() if int(fields[3]) == sid]


def put_and_get(store, key: str) -> None:
    value = os.urandom(VALUE)
    assert store.upsert(key, value) == 0
    assert store.get_size(key) == VALUE
    buffer = (ctypes.c_char * VALUE)()
    assert store.get_into(key, ctypes.addressof(buffer), VALUE) == VALUE
    assert buffer.raw == value


def holder_connects(log_path: Path, generation: int) -> bool:
    return f"connected to pool generation {generation} " in log_path.read_text()


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    (tmp_path / "logs").mkdir(mode=0o700)
    return tmp_path


def test_pool_lifecycle(run_dir: Path):
    service = PoolService(run_dir, HOST)
    holder = HolderProcess(run_dir, SEGMENT, host=HOST)
    clients = []
    try:
        started = time.monotonic()
        address = service.start()
        print(f"service ready in {time.monotonic() - started:.2f} s: {address}")
        assert address.generation == 1
        assert read_pool_address(run_dir) == address
        for path in (run_dir / POOL_FILE, run_dir / "logs" / MASTER_LOG, run_dir / "logs" / METADATA_LOG):
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path

        # The service binds the host it was given; never a wildcard.
        master_binds, metadata_binds = listening(service.master.pid), listening(service.metadata.pid)
        print("master listens on", master_binds, "- metadata server on", metadata_binds)
        assert sorted(port for _, port in master_binds) == sorted(
            [int(address.master.rsplit(":", 1)[1]), int(address.metrics_url.split(":")[2].split("/")[0])])
        assert [port for _, port in metadata_binds] == [int(address.metadata_url.split(":")[2].split("/")[0])]
        for bound, _ in master_binds + metadata_binds:
            assert bound == HOST, (bound, master_binds, metadata_binds)

        holder.spawn()
        holder_log = run_dir / "logs" / HOLDER_LOG
        spawned = time.monotonic()
        wait_for(lambda: holder_connects(holder_log, 1), 30, "the holder's first connect")
        print(f"holder connected {time.monotonic() - spawned:.2f} s after its spawn")
        wait_for(lambda: service.stats().get("capacity_bytes") == SEGMENT, 10, "the holder's segment")
        assert stat.S_IMODE(holder_log.stat().st_mode) == 0o600
        # Store clients listen on every interface (documented in service.py); printed, not pinned.
        print("holder listens on", listening(holder.pid))

        client = open_store(address, local_host=HOST, segment_bytes=0, buffer_bytes=16 * MiB)
        clients.append(client)
        put_and_get(client, "before-restart")
        stats = service.stats()
        print("stats after a put:", stats)
        assert stats["bytes_used"] >= VALUE and stats["keys"] >= 1 and stats["up"] is True

        # kill -9 the master: check() restarts both under the next generation.
        os.kill(service.master.pid, signal.SIGKILL)
        service.master.wait()
        restarted = time.monotonic()
        assert service.check() is True
        print(f"restart took {time.monotonic() - restarted:.2f} s")
        assert service.address.generation == 2 and service.restarts == 1
        assert read_pool_address(run_dir).generation == 2
        assert service.check() is False  # both alive: nothing to do
        wait_for(lambda: holder_connects(holder_log, 2), 30, "the holder's reconnect")
        print(f"holder reconnected {time.monotonic() - restarted:.2f} s after the master's death")
        wait_for(lambda: service.stats().get("capacity_bytes") == SEGMENT, 10, "the segment, mounted again")
        assert holder.running()

        fresh = open_store(service.address, local_host=HOST, segment_bytes=0, buffer_bytes=16 * MiB)
        clients.append(fresh)
        assert fresh.get_size("before-restart") < 0  # the master's state died with it
        put_and_get(fresh, "after-restart")
        if service.address.master == address.master:  # same ports: the old client recovers after -900
            codes = [client.upsert("old-client", b"x" * 4096) for _ in range(3)]
            print("old client's upserts after the restart:", codes)
            assert codes[-1] == 0 and set(codes) <= {0, -900}

        pids = service.pids() + [holder.pid]
    finally:
        stopping = time.monotonic()
        for store in clients:
            close_quietly(store)
        closed = time.monotonic()
        holder.stop()
        holder_stopped = time.monotonic()
        assert holder.poll() == 0  # SIGTERM: unmounted and exited cleanly
        service.stop()
        print(f"closing clients {closed - stopping:.2f} s, stopping the holder "
              f"{holder_stopped - closed:.2f} s, the service {time.monotonic() - holder_stopped:.2f} s")
    for pid in pids:
        assert session_members(pid) == [], f"process left in session {pid}"

    # A resumed run starts above every generation of the previous one.
    again = PoolService(run_dir, HOST)
    try:
        assert again.start().generation == 3
    finally:
        again.stop()
    assert not any(session_members(pid) for pid in again.pids())


def test_pool_dies_with_its_owner(run_dir: Path):
    """kill -9 of the coordinator (here: a small owner process) takes the service and the holder
    along."""
    owner = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import json, sys, time
        from seerd.kvpool.holder import HolderProcess
        from seerd.kvpool.service import PoolService
        service = PoolService({str(run_dir)!r}, {HOST!r})
        service.start()
        holder = HolderProcess({str(run_dir)!r}, {SEGMENT}, host={HOST!r})
        holder.spawn()
        print(json.dumps(service.pids() + [holder.pid]), flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        pids = json.loads(owner.stdout.readline())
        assert all(Path(f"/proc/{pid}").exists() for pid in pids)
    finally:
        owner.kill()
        owner.wait()
    wait_for(lambda: not any(session_members(pid) for pid in pids), 10, "the pool processes to exit")
