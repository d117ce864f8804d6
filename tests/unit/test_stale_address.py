"""A network the coordinator does not trust: whatever listens on a stale coordinator address learns
nothing usable from `seerd status` or a worker, and cannot pass for the coordinator; a restarted
coordinator has a fresh secret and its workers follow it. Real coordinators (HTTP on loopback,
SQLite), real workers whose engines are scripted, a plain socket server as the impostor."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import msgspec
from sqlalchemy import select

from seerd import protocol
from seerd.coordinator.daemon import Coordinator
from seerd.db import Chunk, ChunkStatus, Request, RequestStatus, RolloutStatus
from seerd.db.codec import unpack_ints
from seerd.ownership import take_ownership
from seerd.settings import EngineConfig
from seerd.status.locate import ask_coordinator
from seerd.worker.client import CoordinatorClient, CoordinatorGone
from seerd.worker.worker import Worker
from tests.unit.helpers import ScriptedEngine, scripted_tokens, rollout_weights
from tests.unit.test_export_live import GROUPS, N, build_run

# Answers that would fool a client that believed them: a running rollout, an engine to load.
FAKE_STATUS = msgspec.json.encode(protocol.StatusReply(
    rollout_id=1, policy="seer", requests_total=1, requests_done=0, groups_total=1, groups_done=0, leases=0,
    output_tokens=0, workers_alive=0, complete=False, accepting=True, coordinator_busy_s=0.0, api_calls=0))
FAKE_CONFIG = msgspec.json.encode(protocol.EngineSettings("/models/evil", EngineConfig(), 0))


class Impostor:
    """A plain TCP server that takes over an address: it records every request whole and answers
    each with a well-formed 200 of its choosing (unsigned: it has no key)."""

    def __init__(self, answer: bytes) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.host, self.port = self.sock.getsockname()
        self.answer = answer
        self.requests: list[bytes] = []
        self.got_one = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                head, _, body = data.partition(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(body) < length:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    body += chunk
                self.requests.append(head + b"\r\n\r\n" + body)
                head = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
                        b"content-length: " + str(len(self.answer)).encode() + b"\r\n\r\n")
                conn.sendall(head + self.answer)
                self.got_one.set()

    def close(self) -> None:
        self.sock.close()


def replay(host: str, port: int, request: bytes) -> int:
    """Send `request` as captured, byte for byte; the status of the answer."""
    with socket.create_connection((host, port), timeout=10) as conn:
        conn.sendall(request)
        answer = b""
        while b"\r\n" not in answer:
            answer += conn.recv(4096)
    return int(answer.split(b" ")[1])


def serving(coordinator: Coordinator):  # noqa: ANN201
    """The coordinator's serve() as a task, and an event set once it answers."""
    ready = asyncio.Event()
    return asyncio.create_task(coordinator.serve(on_ready=lambda _host, _port: ready.set())), ready


def test_a_listener_on_a_stale_address_learns_nothing_usable_and_passes_for_no_coordinator(tmp_path):
    """The worst case: the run's coordinator lives (with the secret the clients read), and
    `coordinator.json` names an address that something else now listens on (a kill -9 leaves it
    behind; a client may read the old address beside a new secret)."""
    rundir = build_run(tmp_path / "run")
    impostor = Impostor(FAKE_STATUS)
    with take_ownership(rundir.path) as ownership:
        coordinator = Coordinator(rundir, ownership, expected_workers=1)

        async def scenario() -> tuple:
            task, ready = serving(coordinator)
            await ready.wait()
            real = rundir.read_address()
            rundir.write_address(impostor.host, impostor.port, 1)  # the stale address
            status = await asyncio.to_thread(ask_coordinator, rundir.path)
            impostor.answer = FAKE_CONFIG
            client = await CoordinatorClient.from_run_dir(rundir, patience_s=1.0)
            try:
                await client.call(protocol.CONFIG)
                worker_outcome = "believed the impostor"
            except CoordinatorGone as exc:  # no answer signed by the coordinator: none at all
                worker_outcome = str(exc)
            await client.close()
            replays = [await asyncio.to_thread(replay, *real, request) for request in impostor.requests]
            coordinator.request_stop("test over")
            await task
            return status, worker_outcome, replays

        status, worker_outcome, replays = asyncio.run(scenario())
    impostor.close()
    assert status is None  # `seerd status` did not believe the impostor's "running" answer
    assert "without the run's coordinator's signature" in worker_outcome
    captured = b"".join(impostor.requests)
    assert len(impostor.requests) >= 2 and b"Seerd-HMAC-SHA256" in captured
    for secret in (rundir.read_secret(), rundir.metrics_token_path.read_text()):
        assert secret.encode() not in captured  # neither credential ever left the client
    # What it captured is worthless at the real coordinator, though signed with the secret it holds.
    assert replays and set(replays) == {401}


def test_a_restarted_coordinator_has_a_fresh_secret_and_its_worker_follows_it(tmp_path):
    rundir = build_run(tmp_path / "run")

    def length_of(request_id: int) -> int:
        return 40 + request_id % 24

    with take_ownership(rundir.path) as ownership:
        async def scenario() -> tuple:
            first = Coordinator(rundir, ownership, expected_workers=1)
            task, ready = serving(first)
            await ready.wait()
            secret, token = rundir.read_secret(), rundir.metrics_token_path.read_text()
            address = rundir.read_address()
            client = await CoordinatorClient.from_run_dir(rundir, patience_s=60.0)
            worker = Worker(client, ScriptedEngine(length_of, max_chunks=2, pause_s=0.01), rank=0,
                            weights=rollout_weights(rundir))
            running = asyncio.create_task(worker.run())
            while first.book.state.finished_requests < 2:
                await asyncio.sleep(0.01)
            first_identity = worker.worker_id
            first.request_stop("restart")
            assert (await task).status == RolloutStatus.INTERRUPTED
            first.engine.dispose()
            # As a kill -9 leaves it: the dead coordinator's address stays behind a while.
            rundir.write_address(*address, 1)
            second = Coordinator(rundir, ownership, expected_workers=1)
            task, ready = serving(second)
            await ready.wait()
            await asyncio.wait_for(running, timeout=120)
            await client.close()
            result = await task
            fresh = rundir.read_secret(), rundir.metrics_token_path.read_text()
            second.engine.dispose()
            return result, worker, first_identity, (secret, token), fresh

        result, worker, first_identity, old, fresh = asyncio.run(scenario())
    assert old[0] != fresh[0] and old[1] != fresh[1]
    for path in (rundir.secret_path, rundir.metrics_token_path):
        assert path.stat().st_mode & 0o777 == 0o600
    assert result.status == RolloutStatus.FINISHED
    assert worker.worker_id != first_identity  # it registered again with the new coordinator
    from seerd.db import make_engine, make_sessionmaker

    engine = make_engine(rundir.db_path)
    with make_sessionmaker(engine).begin() as s:
        finished = s.scalars(select(Request)).all()
        assert len(finished) == GROUPS * N and {r.status for r in finished} == {RequestStatus.FINISHED}
        for request in finished:  # every token once, across the restart
            tokens = [t for blob in s.scalars(select(Chunk.token_ids).where(
                Chunk.request_id == request.id, Chunk.status == ChunkStatus.DONE).order_by(Chunk.seq))
                for t in unpack_ints(blob)]
            assert tokens == scripted_tokens(request.id, 0, length_of(request.id))
    engine.dispose()


def test_a_worker_waits_out_an_impostor_and_goes_on_with_the_real_coordinator(tmp_path):
    """While the run directory names the impostor, the worker sends no report there and believes
    nothing it says; once the directory names the coordinator again, the worker carries on."""
    rundir = build_run(tmp_path / "run")
    impostor = Impostor(json.dumps({"worker_id": "w", "lease_ttl_s": 5, "heartbeat_interval_s": 1}).encode())
    with take_ownership(rundir.path) as ownership:
        coordinator = Coordinator(rundir, ownership, expected_workers=1)

        async def scenario():  # noqa: ANN202
            task, ready = serving(coordinator)
            await ready.wait()
            real = rundir.read_address()
            rundir.write_address(impostor.host, impostor.port, 1)
            client = await CoordinatorClient.from_run_dir(rundir, patience_s=60.0)
            worker = Worker(client, ScriptedEngine(lambda rid: 10, max_chunks=2, pause_s=0.0), rank=0,
                            weights=rollout_weights(rundir))
            running = asyncio.create_task(worker.run())
            await asyncio.to_thread(impostor.got_one.wait, 30)
            rundir.write_address(*real, 1)  # the coordinator's address again (its restart, say)
            await asyncio.wait_for(running, timeout=120)
            await client.close()
            return worker, await task

        worker, result = asyncio.run(scenario())
    impostor.close()
    assert result.status == RolloutStatus.FINISHED and worker.stats.chunks_done > 0
    assert all(b"/v1/register" in request for request in impostor.requests)  # nothing past registering
