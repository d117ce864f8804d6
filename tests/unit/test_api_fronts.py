"""The coordinator's API served by front processes (server/front.py, forwarding.py): real
front processes on a real socket, forwarding to the API's handlers on a real book. Calls are
signed and answered as in one process; a replay is refused whichever front takes it; the fronts'
refusals reach the coordinator's /metrics; a killed front is started again; the fronts die with
the coordinator."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from seerd import protocol
from seerd.protocol import EngineSettings, HeartbeatBody, LeaseBody, RegisterBody
from seerd.server.app import CoordinatorControl, create_app
from seerd.server.auth import REPLAYED
from seerd.server.forwarding import ApiFronts, api_processes_for
from seerd.server.guard import ConnectionLimits
from seerd.settings import EngineConfig
from seerd.worker.client import CoordinatorClient
from tests.unit.helpers import FakeClock, loopback_socket, make_book, python, rows, signed_auth
from tests.unit.test_connection_limits import connect, read_all, read_response, signed_head

SECRET = "s3cret-token"
METRICS_TOKEN = "m" * 32
WAIT_S = 60.0  # how long a test waits for what must happen


@contextlib.asynccontextmanager
async def fronted(tmp_path: Path, fronts: int = 2) -> AsyncIterator[tuple[str, str, ApiFronts, object]]:
    """An API on a real book served by `fronts` front processes: (url, address, fronts, book)."""
    sock, address = loopback_socket()
    book = make_book(tmp_path, prompt_rows=rows(groups=2, n=2, max_tokens=40), now=FakeClock()())
    control = CoordinatorControl(book)
    app = create_app(control, SECRET, address=address, metrics_token=METRICS_TOKEN,
                     max_body_bytes=4096)
    app.state.engine_settings = EngineSettings("m", EngineConfig(), 0)
    server = ApiFronts(app, control, fronts, secret=SECRET, address=address, metrics_token=METRICS_TOKEN,
                       max_body_bytes=4096, limits=ConnectionLimits())
    app.state.guard = server.guard
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    deadline = time.monotonic() + WAIT_S
    while not server.started:
        if serving.done():
            serving.result()
        assert time.monotonic() < deadline, "the fronts never said they were ready"
        await asyncio.sleep(0.01)
    try:
        yield f"http://{address}", address, server, book
    finally:
        server.should_exit = True
        await serving
        sock.close()


async def register_and_work(url: str) -> list:
    """A worker's calls, each on a new connection (the fronts share them out as they accept)."""
    replies = []
    for call in range(3):
        client = CoordinatorClient(url, SECRET, patience_s=WAIT_S)
        if call == 0:
            replies.append(await client.call(protocol.REGISTER, RegisterBody(
                "w", 0, "x", max_chunks=2, kv_capacity_tokens=10_000)))
        else:
            worker_id = replies[0].worker_id
            replies.append(await client.call(protocol.LEASE, LeaseBody(worker_id, 1)) if call == 1
                           else await client.call(protocol.HEARTBEAT, HeartbeatBody(worker_id, [])))
        await client.close()
    return replies


def test_calls_through_two_front_processes_are_answered_by_the_coordinators_book(tmp_path):
    async def scenario():  # noqa: ANN202
        async with fronted(tmp_path) as (url, address, server, book):
            replies = await register_and_work(url)
            async with httpx.AsyncClient(auth=signed_auth(SECRET, address)) as http:
                status = (await http.get(f"{url}{protocol.STATUS.path}")).json()
                missing = await http.get(f"{url}/v1/nothing-here")
            return replies, status, missing.status_code, book.known_worker(replies[0].worker_id), \
                server.control.latencies.figures()

    (registered, lease, heartbeat), status, missing, known, latencies = asyncio.run(scenario())
    # The client checks every answer's signature (made by the front with the call key) before it believes it.
    assert known and lease.chunks and not heartbeat.done
    assert status["workers_alive"] == 1 and status["leases"] == len(lease.chunks)
    assert status["api_calls"] >= 3  # counted by the coordinator, whichever front took them
    assert missing == 404
    assert {"/v1/register", "/v1/lease", "/v1/heartbeat"} <= set(latencies)  # timed in the coordinator


def test_a_call_replayed_on_another_connection_is_refused_whichever_front_takes_it(tmp_path):
    def twice(address: str) -> list[bytes]:
        request = signed_head(address, "GET", protocol.STATUS.path, b"")
        answers = []
        for _ in range(2):
            with connect(address) as conn:
                conn.sendall(request)
                answers.append(read_response(conn))
        return answers

    async def scenario():  # noqa: ANN202
        async with fronted(tmp_path) as (_url, address, server, _book):
            return await asyncio.to_thread(twice, address), server.calls.replays

    (first, replayed), replays = asyncio.run(scenario())
    assert first.startswith(b"HTTP/1.1 200 ")
    assert replayed.startswith(b"HTTP/1.1 401 ") and REPLAYED.encode() in replayed and replays == 1


def test_refusals_in_the_fronts_show_on_the_coordinators_metrics(tmp_path):
    def unsigned(address: str) -> bytes:
        with connect(address) as conn:
            conn.sendall(f"GET {protocol.STATUS.path} HTTP/1.1\r\nhost: {address}\r\n\r\n".encode())
            return read_all(conn)

    async def refused_on_metrics(url: str) -> float:
        async with httpx.AsyncClient(headers={"authorization": f"Bearer {METRICS_TOKEN}"}) as http:
            scraped = (await http.get(f"{url}/metrics")).text
        return sum(s.value for family in text_string_to_metric_families(scraped) for s in family.samples
                   if s.name == "seerd_api_refused_total" and s.labels["reason"] == "unsigned")

    async def scenario():  # noqa: ANN202
        async with fronted(tmp_path) as (url, address, _server, _book):
            answer = await asyncio.to_thread(unsigned, address)
            deadline = time.monotonic() + WAIT_S
            while (count := await refused_on_metrics(url)) < 1:  # the fronts tell their counts every second
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
            return answer, count

    answer, count = asyncio.run(scenario())
    assert answer.startswith(b"HTTP/1.1 401 ") and count == 1


def test_a_killed_front_is_started_again_and_the_workers_are_served(tmp_path):
    async def scenario():  # noqa: ANN202
        async with fronted(tmp_path) as (url, _address, server, _book):
            victim = server._fronts[0].process  # noqa: SLF001 - the test picks a front to kill
            os.kill(victim.pid, signal.SIGKILL)
            deadline = time.monotonic() + WAIT_S
            while server.restarts < 1 or not all(f.ready for f in server._fronts.values()):  # noqa: SLF001
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            replacement = server._fronts[0].process.pid  # noqa: SLF001
            return victim.pid, replacement, await register_and_work(url)

    victim, replacement, (registered, lease, heartbeat) = asyncio.run(scenario())
    assert replacement != victim and registered.worker_id and lease.chunks and not heartbeat.done


def test_fronts_ignore_the_stop_signals_that_reach_every_process_of_a_job(tmp_path):
    """Ctrl-C, Slurm's SIGTERM and its warning signals reach the fronts too; the coordinator
    drains on them and its workers must still reach it, so the fronts leave the stopping to the
    coordinator (uvicorn's own handlers, which would stop a front's server, are not installed)."""
    async def scenario():  # noqa: ANN202
        async with fronted(tmp_path) as (_url, _address, server, _book):
            return [_ignored_signals(front.process.pid) for front in server._fronts.values()]  # noqa: SLF001

    for ignored in asyncio.run(scenario()):
        assert {signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2} <= ignored


def _ignored_signals(pid: int) -> set[int]:
    with open(f"/proc/{pid}/status") as status:
        mask = int(next(line for line in status if line.startswith("SigIgn:")).split()[1], 16)
    return {signum for signum in range(1, 64) if mask & (1 << (signum - 1))}


# A coordinator's API on fronts in its own process, its front pids printed, until it is killed.
FRONTED_COORDINATOR = """
import asyncio, json, sys, time
from pathlib import Path
from tests.unit.test_api_fronts import fronted
async def main():
    async with fronted(Path(sys.argv[1])) as (url, address, server, book):
        print(json.dumps([f.process.pid for f in server._fronts.values()] + [address]), flush=True)
        await asyncio.sleep(600)
asyncio.run(main())
"""


def test_the_fronts_exit_when_the_coordinator_is_killed(tmp_path):
    coordinator = python(FRONTED_COORDINATOR, str(tmp_path))
    try:
        *pids, address = json.loads(coordinator.stdout.readline())
        coordinator.kill()
        coordinator.wait()
        deadline = time.monotonic() + WAIT_S
        while any(_alive(pid) for pid in pids):
            assert time.monotonic() < deadline, "a front outlived its coordinator"
            time.sleep(0.05)
    finally:
        if coordinator.poll() is None:
            coordinator.kill()
    host, port = address.rsplit(":", 1)
    try:  # nothing holds the port any more
        socket.create_connection((host, int(port)), timeout=5).close()
        refused = False
    except ConnectionRefusedError:
        refused = True
    assert refused


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_fronts_serve_the_api_from_600_workers():
    assert api_processes_for(1) == api_processes_for(599) == 0
    assert api_processes_for(600) == api_processes_for(5000) == 2
