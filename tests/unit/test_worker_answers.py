"""No answer of the coordinator ends a worker: its client and its loops against the real API (the
lease book on SQLite) behind a wrapper that fails chosen calls as a troubled coordinator would."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
from sqlalchemy import select

from seerd import protocol
from seerd.db import Chunk, ChunkStatus, Request, RequestStatus
from seerd.db.codec import unpack_ints
from seerd.protocol import ErrorReply, LeaseBody, RegisterBody
from seerd.server.app import CoordinatorControl, create_app
from seerd.signing import REPLY_HEADER, Mac, body_digest, call_key, parse_authorization, reply_mac
from seerd.worker.client import CoordinatorClient, CoordinatorGone, CoordinatorRefused, NotRegistered
from seerd.worker.worker import Worker
from tests.unit.helpers import ScriptedEngine, loopback_socket, make_book, rows, scripted_tokens, served

SECRET = "s3cret-token"


class Faults:
    """The real app behind a wrapper that answers planned calls itself: `before` the app sees them,
    or `after` it handled them (the answer lost on the way back). Its answers are signed as the
    coordinator signs them (for `address`): they are the coordinator's, only troubled."""

    def __init__(self, app, plan: dict[str, list[tuple[int, str, str]]],  # noqa: ANN001
                 address: str) -> None:
        self.app = app
        self.plan = plan  # path -> [(status, error code, "before" | "after")], in the order they strike
        self.struck: list[tuple[str, int, str]] = []
        self.mac = Mac(call_key(SECRET, address))

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        faults = self.plan.get(scope.get("path"), [])
        if scope["type"] != "http" or not faults:
            return await self.app(scope, receive, send)
        status, code, when = faults.pop(0)
        if when == "after":
            async def lost(_message) -> None:  # noqa: ANN001
                return None

            await self.app(scope, receive, lost)
        self.struck.append((scope["path"], status, when))
        body = msgspec.json.encode(ErrorReply(f"injected {status}", code))
        nonce = parse_authorization(dict(scope["headers"])[b"authorization"].decode()).nonce
        timestamp = f"{time.time():.3f}"
        signature = f"{timestamp} {reply_mac(self.mac, nonce, status, timestamp, body_digest(body))}"
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (REPLY_HEADER.encode(), signature.encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        return None


def length_of(request_id: int) -> int:
    return 5 + request_id * 3 % 11


def test_a_worker_finishes_the_rollout_through_5xx_4xx_and_a_coordinator_that_forgot_it(tmp_path):
    book = make_book(tmp_path, chunk_tokens=4, lease_ttl_s=1.0, prompt_rows=rows(groups=3, n=2, max_tokens=16),
                     now=time.time())
    control = CoordinatorControl(book, clock=time.time)
    sock, address = loopback_socket()
    app = Faults(create_app(control, SECRET, address=address), {
        protocol.REGISTER.path: [(503, "", "before")],
        protocol.LEASE.path: [(422, "", "before")],
        # A failed commit (the book never saw it), then a commit whose answer was lost: the
        # worker sends the same report again, and it counts once.
        protocol.REPORT.path: [(500, "", "before"), (500, "", "after")],
        protocol.HEARTBEAT.path: [(400, "", "before"), (404, protocol.UNKNOWN_WORKER, "before")],
    }, address)

    async def scenario() -> Worker:
        async with served(app, sock) as url:
            return await run_worker(url)

    async def run_worker(url: str) -> Worker:
        worker = Worker(CoordinatorClient(url, SECRET), ScriptedEngine(length_of, max_chunks=2, pause_s=0.05), rank=0)

        async def daemon_tick() -> None:  # what the coordinator's tick does: leases of the forgotten identity expire
            while True:
                if await control.run(book.expire, time.time()):
                    control.work_queued()
                await asyncio.sleep(0.1)

        ticking = asyncio.create_task(daemon_tick())
        try:
            await asyncio.wait_for(worker.run(), timeout=60)
        finally:
            ticking.cancel()
            await worker.client.close()
        return worker

    worker = asyncio.run(scenario())
    assert all(not faults for faults in app.plan.values()), app.struck  # every fault struck
    assert worker.fatal is None and book.is_complete()
    assert "+" in worker.worker_id  # it registered again after the 404, under a new identity
    with book.sessions.begin() as s:
        for request in s.scalars(select(Request)):
            assert (request.status, request.generated_tokens) == (RequestStatus.FINISHED, length_of(request.id))
            tokens = [t for blob in s.scalars(select(Chunk.token_ids).where(
                Chunk.request_id == request.id, Chunk.status == ChunkStatus.DONE).order_by(Chunk.seq))
                for t in unpack_ints(blob)]
            assert tokens == scripted_tokens(request.id, 0, length_of(request.id))  # each token once


def test_the_client_retries_5xx_and_raises_a_4xx_to_its_caller(tmp_path):
    book = make_book(tmp_path, prompt_rows=rows(groups=1, n=1))
    sock, address = loopback_socket()
    app = Faults(create_app(CoordinatorControl(book), SECRET, address=address), {
        protocol.REGISTER.path: [(500, "", "before"), (502, "", "before"), (413, "", "before")],
        protocol.LEASE.path: [(404, "", "before")],  # a 404 without the code: not "register again"
    }, address)

    async def scenario() -> None:
        async with served(app, sock) as url:
            await calls(CoordinatorClient(url, SECRET))

    async def calls(client: CoordinatorClient) -> None:
        body = RegisterBody("w", 0, "x", max_chunks=1, kv_capacity_tokens=100)
        with pytest.raises(CoordinatorRefused, match="413: POST /v1/register: injected 413"):
            await client.call(protocol.REGISTER, body)  # after two 5xx, each retried
        registered = await client.call(protocol.REGISTER, body)
        with pytest.raises(CoordinatorRefused, match="404"):
            await client.call(protocol.LEASE, LeaseBody(registered.worker_id, 1))
        with pytest.raises(NotRegistered, match="unknown worker ghost"):
            await client.call(protocol.LEASE, LeaseBody("ghost", 1))
        await client.close()

    asyncio.run(scenario())
    assert [status for _, status, _ in app.struck] == [500, 502, 413, 404]


def test_only_a_coordinator_gone_past_the_patience_ends_the_client():
    async def scenario() -> float:
        client = CoordinatorClient("http://127.0.0.1:9", SECRET, patience_s=0.5)  # nothing listens there
        started = time.monotonic()
        with pytest.raises(CoordinatorGone, match="unreachable for 0s"):
            await client.call(protocol.CONFIG)
        await client.close()
        return time.monotonic() - started

    assert 0.5 <= asyncio.run(scenario()) < 5.0
