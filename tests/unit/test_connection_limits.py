"""The coordinator's connection limits (server/guard.py) on its real server (uvicorn, httptools,
the API on a real book): heads too large or too slow, bodies too large or too slow, strangers
holding hundreds of idle connections while a registered worker is served, and the open-files
limit raised to what the workers need."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from seerd import protocol
from seerd.server.app import CoordinatorControl, create_app
from seerd.server.guard import (
    FILES_PER_WORKER, MAX_UNPROVEN, RESERVED_FILES, ConnectionGuard, ConnectionLimits, limits_for,
    open_files_needed,
)
from seerd.protocol import EngineSettings, HeartbeatBody, LeaseBody, RegisterBody
from seerd.settings import EngineConfig
from seerd.signing import Signer, call_key
from seerd.worker.client import CoordinatorClient
from seerd.worker.worker import Worker
from tests.unit.helpers import (
    rollout_weights,
    REPO, FakeClock, ScriptedEngine, loopback_socket, make_book, rows, served, signed_auth,
)
from tests.unit.test_export_live import GROUPS, N, build_run

SECRET = "s3cret-token"
WAIT_S = 60.0  # how long a test waits for what must happen (the limits themselves are short)


def api(tmp_path: Path, limits: ConnectionLimits):  # noqa: ANN201
    """(app, guard, socket, address) of an API on a real book, behind a guard with `limits`."""
    sock, address = loopback_socket()
    book = make_book(tmp_path, prompt_rows=rows(groups=2, n=2, max_tokens=40), now=FakeClock()())
    app = create_app(CoordinatorControl(book), SECRET, address=address, max_body_bytes=4096)
    app.state.engine_settings = EngineSettings("m", EngineConfig(), 0)
    app.state.guard = ConnectionGuard(limits)  # as the daemon does: its counters on /metrics
    return app, app.state.guard, sock, address


def connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=WAIT_S)


def read_all(conn: socket.socket) -> bytes:
    """Everything until the server closes the connection (a timeout fails the test)."""
    data = b""
    try:
        while chunk := conn.recv(65536):
            data += chunk
    except ConnectionResetError:  # closed with our late bytes unread: closed all the same
        pass
    return data


def read_response(conn: socket.socket) -> bytes:
    """One whole answer (head and body, by its content-length) on a connection left open."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += conn.recv(65536)
    return head + b"\r\n\r\n" + body


def signed_head(address: str, method: str, path: str, body: bytes, length: int | None = None,
                framing: str = "") -> bytes:
    """A signed request head; its body framing `content-length: {length}` unless `framing` says otherwise."""
    authorization, _ = Signer(call_key(SECRET, address)).sign(method, path, body)
    framing = framing or f"content-length: {len(body) if length is None else length}"
    return (f"{method} {path} HTTP/1.1\r\nhost: {address}\r\nauthorization: {authorization}\r\n"
            f"content-type: application/json\r\n{framing}\r\n\r\n").encode()


def run(scenario):  # noqa: ANN001, ANN201
    return asyncio.run(scenario())


def test_a_head_over_the_limit_gets_431_and_the_connection_closed(tmp_path):
    app, guard, sock, address = api(tmp_path, ConnectionLimits(max_head_bytes=2048))

    def huge_head() -> bytes:
        with connect(address) as conn:
            conn.sendall(b"GET /v1/status HTTP/1.1\r\nhost: x\r\nx-padding: " + b"a" * 4096 + b"\r\n\r\n")
            return read_all(conn)

    async def scenario() -> bytes:
        async with served(app, sock, guard):
            return await asyncio.to_thread(huge_head)

    answer = run(scenario)
    assert answer.startswith(b"HTTP/1.1 431 ") and guard.counters.heads_too_large == 1


def test_a_head_that_trickles_or_never_comes_is_cut_off(tmp_path):
    app, guard, sock, address = api(tmp_path, ConnectionLimits(head_timeout_s=0.5))

    def slow_and_silent() -> tuple[bytes, bytes]:
        with connect(address) as silent, connect(address) as slow:
            slow.sendall(b"GET /v1/status HTTP/1.1\r\n")
            for _ in range(200):  # a byte now and then: it never finishes (unless cut off first)
                try:
                    slow.sendall(b"x")
                except OSError:
                    break
                time.sleep(0.05)
            return read_all(silent), read_all(slow)

    async def scenario() -> tuple[bytes, bytes]:
        async with served(app, sock, guard):
            return await asyncio.to_thread(slow_and_silent)

    silent, slow = run(scenario)
    assert silent == b"" and slow == b"" and guard.counters.head_timeouts == 2


def test_bodies_too_large_unsized_or_too_slow_are_refused_or_cut_off(tmp_path):
    app, guard, sock, address = api(tmp_path, ConnectionLimits(body_timeout_s=0.5))
    body = json.dumps({"worker_id": "w", "running": []}).encode()

    def calls() -> tuple[bytes, bytes, bytes, bytes]:
        with connect(address) as conn:  # over the limit (4096): refused on its length, unread
            conn.sendall(signed_head(address, "POST", protocol.HEARTBEAT.path, b"x" * 5000))
            too_large = read_response(conn)
        with connect(address) as conn:
            conn.sendall(signed_head(address, "POST", protocol.HEARTBEAT.path, b"",
                                     framing="transfer-encoding: chunked"))
            chunked = read_response(conn)
        with connect(address) as conn:  # signed, then the body never finishes
            conn.sendall(signed_head(address, "POST", protocol.HEARTBEAT.path, body, len(body) + 10) + body)
            slow = read_all(conn)
        with connect(address) as conn:  # unsigned: 401 at once, the body never read, the connection closed
            conn.sendall(b"POST /v1/heartbeat HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n{")
            unsigned = read_all(conn)
        return too_large, chunked, slow, unsigned

    async def scenario() -> tuple[bytes, bytes, bytes, bytes]:
        async with served(app, sock, guard):
            return await asyncio.to_thread(calls)

    too_large, chunked, slow, unsigned = run(scenario)
    assert too_large.startswith(b"HTTP/1.1 413 ") and b"the limit is 4096" in too_large
    assert chunked.startswith(b"HTTP/1.1 411 ")
    assert b"connection: close" in too_large.lower() and b"connection: close" in chunked.lower()
    assert slow == b"" and guard.counters.body_timeouts == 1
    assert unsigned.startswith(b"HTTP/1.1 401 ") and b"connection: close" in unsigned.lower()


def test_hundreds_of_idle_strangers_never_keep_a_registered_worker_from_being_served(tmp_path):
    """400 idle connections against a cap of 50 unproven ones: the oldest strangers go, the
    worker's calls (each connection proven by its first signed call) are all served."""
    app, guard, sock, address = api(tmp_path, ConnectionLimits(max_unproven=50, head_timeout_s=600))

    async def scenario() -> list:
        async with served(app, sock, guard) as url:
            idle = [await asyncio.to_thread(connect, address) for _ in range(400)]
            deadline = time.monotonic() + WAIT_S
            while guard.counters.evicted < 350:  # the server has taken in every one of them
                assert time.monotonic() < deadline, asdict(guard.counters)
                await asyncio.sleep(0.01)
            client = CoordinatorClient(url, SECRET, patience_s=WAIT_S)
            registered = await client.call(protocol.REGISTER, RegisterBody("w", 0, "x", max_chunks=2,
                                                                           kv_capacity_tokens=10_000))
            replies = [await client.call(protocol.LEASE, LeaseBody(registered.worker_id, 1)),
                       await client.call(protocol.HEARTBEAT, HeartbeatBody(registered.worker_id, [])),
                       await client.call(protocol.STATUS)]
            await client.close()
            still_open = len(guard.unproven)
            async with httpx.AsyncClient(auth=signed_auth(SECRET, address)) as http:
                scraped = (await http.get(f"{url}/metrics")).text
            for conn in idle:
                conn.close()
            return [registered, *replies, still_open, scraped]

    registered, lease, heartbeat, status, still_open, scraped = run(scenario)
    assert lease.chunks and not heartbeat.done and status.workers_alive == 1
    assert still_open <= 50 and guard.counters.evicted >= 350
    closed = {s.labels["reason"]: s.value for family in text_string_to_metric_families(scraped)
              for s in family.samples if s.name == "seerd_api_connections_closed_total"}
    assert closed["evicted"] == guard.counters.evicted and closed["head_timeouts"] == 0


COORDINATOR = """
import asyncio, json, resource, sys
from dataclasses import asdict
from pathlib import Path
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[2]), int(sys.argv[2])))  # soft and hard: no way up
from seerd.coordinator.daemon import Coordinator
from seerd.event_loop import run_event_loop
from seerd.ownership import take_ownership
from seerd.rundir import RunDir
rundir = RunDir(Path(sys.argv[1]))
with take_ownership(rundir.path) as ownership:
    coordinator = Coordinator(rundir, ownership, expected_workers=1)
    result = run_event_loop(coordinator.serve())
    print(json.dumps({"status": result.status.value, "guard": asdict(coordinator.guard.counters),
                      "max_unproven": coordinator.guard.limits.max_unproven}))
"""


def test_a_coordinator_whose_open_files_are_few_still_serves_its_worker_past_400_idle_strangers(tmp_path):
    """The real daemon in its own process with a hard limit of 300 open files (it cannot raise it):
    it shrinks its cap on unproven connections to fit, so 400 idle strangers never exhaust its file
    descriptors, and the worker runs the rollout to its end."""
    rundir = build_run(tmp_path / "run")
    log = open(tmp_path / "coordinator.log", "wb")  # noqa: SIM115 - closed below
    daemon = subprocess.Popen([sys.executable, "-c", COORDINATOR, str(rundir.path), "300"],
                              stdout=subprocess.PIPE, stderr=log, env={**os.environ, "PYTHONPATH": str(REPO)})
    idle: list[socket.socket] = []
    try:
        deadline = time.monotonic() + WAIT_S
        while not rundir.address_path.exists():
            assert daemon.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "coordinator.log").read_text()
            time.sleep(0.05)
        host, port = rundir.read_address()
        idle = [connect(f"{host}:{port}") for _ in range(400)]

        async def work() -> Worker:
            client = await CoordinatorClient.from_run_dir(rundir, patience_s=WAIT_S)
            worker = Worker(client, ScriptedEngine(lambda rid: 12, max_chunks=4, pause_s=0.0), rank=0,
                            weights=rollout_weights(rundir))
            await asyncio.wait_for(worker.run(), timeout=2 * WAIT_S)
            await worker.say_goodbye()
            await client.close()
            return worker

        worker = run(work)
        out, _ = daemon.communicate(timeout=WAIT_S)
    finally:
        for conn in idle:
            conn.close()
        if daemon.poll() is None:
            daemon.kill()
        log.close()
    outcome = json.loads(out.decode().strip().splitlines()[-1])
    assert outcome["status"] == "finished" and worker.stats.chunks_done >= GROUPS * N
    counters = outcome["guard"]
    assert outcome["max_unproven"] == 64 and counters["evicted"] + counters["head_timeouts"] >= 400 - 64


RAISE = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (256, int(sys.argv[1])))
from seerd.server.guard import raise_open_files_limit
limits = [raise_open_files_limit(8), raise_open_files_limit(4096)]
print(json.dumps([*limits, resource.getrlimit(resource.RLIMIT_NOFILE)]))
"""


def test_the_open_files_limit_is_raised_to_what_the_workers_need_up_to_the_hard_limit():
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 8192:
        pytest.skip(f"this machine's hard limit ({hard}) is below what the check needs")
    out = subprocess.run([sys.executable, "-c", RAISE, "8192"], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    eight, many, (soft, _) = json.loads(out.stdout)
    assert eight == open_files_needed(8) == RESERVED_FILES + 8 * FILES_PER_WORKER + 2 * MAX_UNPROVEN
    assert many == soft == 8192  # 4096 workers want more than the hard limit: as far as it goes
    assert "raise the hard limit" in out.stderr


def test_the_cap_on_strangers_shrinks_to_fit_the_open_files():
    assert limits_for(8, resource.RLIM_INFINITY).max_unproven == MAX_UNPROVEN
    assert limits_for(8, open_files_needed(8)).max_unproven == MAX_UNPROVEN
    assert limits_for(8, open_files_needed(8) - 200).max_unproven == MAX_UNPROVEN - 100  # half the room left
    assert limits_for(8, 100_000).max_unproven == MAX_UNPROVEN
    assert limits_for(4096, 1024).max_unproven == 64  # never below 64


def test_a_call_that_never_ends_does_not_keep_the_stopping_server_from_stopping(monkeypatch):
    from starlette.applications import Starlette
    from starlette.routing import Route

    from seerd.server import guard as guard_module

    monkeypatch.setattr(guard_module, "SHUTDOWN_GRACE_S", 0.5)
    entered = asyncio.Event()
    cancelled = []

    async def stuck(_request):  # noqa: ANN001, ANN202 - a handler whose answer never comes
        entered.set()
        try:
            await asyncio.get_running_loop().create_future()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def scenario() -> None:
        sock, address = loopback_socket()
        server = guard_module.api_server(Starlette(routes=[Route("/stuck", stuck)]), ConnectionGuard())
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        async with httpx.AsyncClient(timeout=WAIT_S) as client:
            call = asyncio.create_task(client.get(f"http://{address}/stuck"))
            await asyncio.wait_for(entered.wait(), WAIT_S)
            server.should_exit = True
            await asyncio.wait_for(serving, WAIT_S)  # without the grace: for ever
            call.cancel()
        sock.close()

    asyncio.run(scenario())
    assert cancelled == [True]
