"""In-place continuation (`RunConfig.in_place`): a chunk reported at its budget while its engine
request runs on gets, in the report's reply, the lease the scheduler would have given at that
moment anyway; a continuation of the same request is marked `continues`. The book on real SQLite,
the worker's loops against the real API with a scripted engine."""

from __future__ import annotations

import asyncio
import time

import pytest
from sqlalchemy import select

from seerd import protocol
from seerd.book.records import ReportCall
from seerd.db import Chunk, ChunkStatus, Request, RequestStatus
from seerd.db.codec import unpack_ints
from seerd.protocol import ChunkReport
from seerd.server.app import CoordinatorControl, create_app
from seerd.worker.client import CoordinatorClient
from seerd.worker.worker import Worker
from tests.unit.helpers import ScriptedEngine, loopback_socket, make_book, rows, scripted_tokens, served
from tests.unit.test_worker_answers import SECRET


def register(book, name="w0", rank=0, now=1000.0, max_chunks=8):
    return book.register(rank=rank, address="test", max_chunks=max_chunks, kv_capacity_tokens=100_000,
                         worker_id=name, now=now).id


def running_on(grant, token=7):
    n = grant.max_tokens
    return ChunkReport(grant.chunk_id, grant.epoch, [token] * n, [-1.0] * n, "length", running_on=True)


def test_a_request_kept_on_its_worker_continues_without_its_context(tmp_path):
    book = make_book(tmp_path, chunk_tokens=16, prompt_rows=rows(groups=1, n=1, max_tokens=40), in_place=True)
    w = register(book)
    (first,) = book.lease(w, wanted=1, now=1000.0)
    assert first.run_on and first.response_remaining == 40 and not first.continues
    outcomes, (second,) = book.report_and_continue(w, [running_on(first)], now=1001.0)
    assert outcomes[0].accepted
    assert second.continues and second.request_id == first.request_id and second.prompt_token_ids == []
    assert (second.max_tokens, second.response_remaining, second.run_on) == (16, 24, True)
    outcomes, (third,) = book.report_and_continue(w, [running_on(second)], now=1002.0)
    assert third.continues and (third.max_tokens, third.run_on) == (8, False)  # the last chunk: nothing past it
    outcomes, grants = book.report_and_continue(
        w, [ChunkReport(third.chunk_id, third.epoch, [7] * 8, [-1.0] * 8, "length")], now=1003.0)
    assert outcomes[0].accepted and grants == [] and book.is_complete()
    with book.sessions.begin() as s:
        request = s.scalars(select(Request)).one()
        assert (request.status, request.generated_tokens, request.num_chunks) == (RequestStatus.FINISHED, 40, 3)


def test_a_slot_the_scheduler_gives_to_another_request_carries_no_continuation(tmp_path):
    # seer serves probes shortest generated first: the waiting probe (0 tokens) goes before the one
    # that just reported 16 (each group of n=1 is its own probe).
    book = make_book(tmp_path, policy="seer", chunk_tokens=16, prompt_rows=rows(groups=2, n=1, max_tokens=40),
                     in_place=True)
    w = register(book, max_chunks=1)
    (first,) = book.lease(w, wanted=1, now=1000.0)
    _, (grant,) = book.report_and_continue(w, [running_on(first)], now=1001.0)
    assert grant.request_id != first.request_id and not grant.continues and grant.prompt_token_ids
    # The reported request waits in the queue with its tokens durable; its next lease carries its context.
    (later,) = book.lease(register(book, "w1", rank=1), wanted=1, now=1002.0)
    assert later.request_id == first.request_id and not later.continues
    assert later.prompt_token_ids[-16:] == [7] * 16


def test_a_request_moved_after_running_in_place_gets_its_whole_response_as_context(tmp_path):
    # The book keeps no copy of a response running in place (at a GPU job's scale, gigabytes in
    # flight): its context lives in the worker's engine request, and a lease that moves it reads
    # its response so far from the database.
    book = make_book(tmp_path, chunk_tokens=16, prompt_rows=rows(groups=1, n=1, max_tokens=64), in_place=True)
    w = register(book)
    (first,) = book.lease(w, wanted=1, now=1000.0)
    _, (second,) = book.report_and_continue(w, [running_on(first, token=7)], now=1001.0)
    _, (third,) = book.report_and_continue(w, [running_on(second, token=8)], now=1002.0)
    assert second.continues and third.continues and book.progress[first.request_id].tokens is None
    # Its worker gives it back unrun (shutting down): it runs elsewhere with every token so far.
    assert book.release(w, third.chunk_id, third.epoch, "shutting down", now=1003.0)
    (moved,) = book.lease(register(book, "w1", rank=1), wanted=1, now=1004.0)
    assert moved.request_id == first.request_id and not moved.continues
    assert moved.prompt_token_ids[len(first.prompt_token_ids):] == [7] * 16 + [8] * 16
    book.report_and_continue("w1", [ChunkReport(moved.chunk_id, moved.epoch, [9] * 3, [-1.0] * 3, "stop")], now=1005.0)
    with book.sessions.begin() as s:
        tokens = [t for c in s.scalars(select(Chunk).where(Chunk.status == ChunkStatus.DONE).order_by(Chunk.seq))
                  for t in unpack_ints(c.token_ids)]
    assert book.is_complete() and tokens == [7] * 16 + [8] * 16 + [9] * 3


def test_no_continuation_for_a_duplicate_a_rejected_or_a_finished_report(tmp_path):
    book = make_book(tmp_path, chunk_tokens=16, prompt_rows=rows(groups=1, n=2, max_tokens=40), in_place=True)
    w = register(book)
    first, other = book.lease(w, wanted=2, now=1000.0)
    _, grants = book.report_and_continue(w, [running_on(first)], now=1001.0)
    assert len(grants) == 1
    _, again = book.report_and_continue(w, [running_on(first)], now=1001.5)  # the same report once more
    assert again == []
    stopped = ChunkReport(other.chunk_id, other.epoch, [7] * 3, [-1.0] * 3, "stop", running_on=True)
    outcomes, grants = book.report_and_continue(w, [stopped], now=1002.0)  # finished: no slot to fill
    assert outcomes[0].accepted and outcomes[0].request_finished and grants == []
    _, grants = book.report_and_continue(w, [running_on(first)], now=1003.0, may_lease=False)  # draining
    assert grants == []


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "resubmitted"])
def test_a_finished_chunks_slot_is_leased_in_the_reports_reply_when_the_worker_wants_it(tmp_path, in_place):
    book = make_book(tmp_path, chunk_tokens=16, prompt_rows=rows(groups=2, n=2, max_tokens=40), in_place=in_place)
    w = register(book, max_chunks=2)
    first, second = book.lease(w, wanted=2, now=1000.0)
    finished = ChunkReport(first.chunk_id, first.epoch, [7] * 3, [-1.0] * 3, "stop")
    outcomes, grants = book.report_and_continue(w, [finished], now=1001.0, wanted=5)
    # One slot was freed; the worker's capacity (2 chunks, one still held) caps what it asked for.
    assert outcomes[0].request_finished and len(grants) == 1
    assert grants[0].request_id not in (first.request_id, second.request_id) and not grants[0].continues
    _, none = book.report_and_continue(w, [ChunkReport(grants[0].chunk_id, grants[0].epoch, [7] * 2, [-1.0] * 2,
                                                        "stop")], now=1002.0, wanted=1, may_lease=False)
    assert none == []  # draining: nothing new, whatever the worker wants


def test_without_in_place_grants_never_run_on(tmp_path):
    book = make_book(tmp_path, chunk_tokens=16, prompt_rows=rows(groups=1, n=1, max_tokens=40))
    w = register(book)
    (grant,) = book.lease(w, wanted=1, now=1000.0)
    assert not grant.run_on
    _, grants = book.report_and_continue(w, [running_on(grant)], now=1001.0)  # a worker that claims it anyway
    assert all(not g.continues for g in grants)


def length_of(request_id: int) -> int:
    return 5 + request_id * 13 % 60


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "resubmitted"])
def test_a_worker_continues_requests_in_place_and_each_token_lands_once(tmp_path, in_place):
    book = make_book(tmp_path, chunk_tokens=8, lease_ttl_s=30.0, prompt_rows=rows(groups=3, n=2, max_tokens=64),
                     now=time.time(), in_place=in_place)
    engine = ScriptedEngine(length_of, max_chunks=8, pause_s=0.01, chunk_tokens=8)
    worker = run_worker(book, engine)
    assert worker.fatal is None and book.is_complete()
    with book.sessions.begin() as s:
        chunks = s.scalar(select(Chunk.id).order_by(Chunk.id.desc()).limit(1))
        for request in s.scalars(select(Request)):
            assert (request.status, request.generated_tokens) == (RequestStatus.FINISHED, length_of(request.id))
            tokens = [t for blob in s.scalars(select(Chunk.token_ids).where(
                Chunk.request_id == request.id, Chunk.status == ChunkStatus.DONE).order_by(Chunk.seq))
                for t in unpack_ints(blob)]
            assert tokens == scripted_tokens(request.id, 0, length_of(request.id))
    # One engine request per response when each continues in place (8 slots, 6 requests: the
    # scheduler always keeps them); one per chunk otherwise.
    assert len(engine.opened) == (6 if in_place else chunks)
    assert not worker.held and not worker.held_by_chunk


def run_worker(book, engine: ScriptedEngine, worker_type: type | None = None, client_type: type | None = None,  # noqa: ANN001
               control: CoordinatorControl | None = None) -> Worker:
    """A worker with `engine` against the real API over `book`, on a loopback socket, to the end."""
    sock, address = loopback_socket()
    app = create_app(control or CoordinatorControl(book, clock=time.time), SECRET, address=address)

    async def scenario() -> Worker:
        async with served(app, sock) as url:
            worker = (worker_type or Worker)((client_type or CountingClient)(url, SECRET), engine, rank=0)
            try:
                await asyncio.wait_for(worker.run(), timeout=60)
            finally:
                await worker.client.close()
            return worker

    return asyncio.run(scenario())


class CountingClient(CoordinatorClient):
    """The real client, counting its calls by endpoint."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.calls: dict[str, int] = {}

    async def call(self, endpoint, body=None):  # noqa: ANN001, ANN201
        self.calls[endpoint.path] = self.calls.get(endpoint.path, 0) + 1
        return await super().call(endpoint, body)


def test_a_worker_fills_a_finished_chunks_slot_from_the_reports_reply_not_a_lease_call(tmp_path):
    # Ten one-chunk responses through two slots: after the first lease, each report's reply brings
    # the next chunk while the queue has one; lease calls come back only once the queue is empty.
    book = make_book(tmp_path, chunk_tokens=64, lease_ttl_s=30.0, prompt_rows=rows(groups=5, n=2, max_tokens=64),
                     now=time.time())
    engine = ScriptedEngine(length_of, max_chunks=2, pause_s=0.01, chunk_tokens=64)
    worker = run_worker(book, engine)
    assert worker.fatal is None and book.is_complete() and len(engine.opened) == 10
    # The first lease, and the long polls of the last two slots (at most one each, ended by the
    # run's completion); without the report's lease, a lease call after each report (5 here).
    assert worker.client.calls[protocol.LEASE.path] <= 3, worker.client.calls


class BeatDue(Worker):
    """A worker whose heartbeat is due (most of its interval has passed) at its first report, and
    whose heartbeat loop would call on its own only in days: what its reports carry is all there is."""

    async def register(self) -> None:
        await super().register()
        self.heartbeat_interval_s = 1e6
        self.beat_at = time.monotonic() - 0.9e6


class RecordingClient(CountingClient):
    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.bodies: list = []

    async def call(self, endpoint, body=None):  # noqa: ANN001, ANN201
        self.bodies.append(body)
        return await super().call(endpoint, body)


def test_a_heartbeat_due_rides_on_the_workers_next_report_instead_of_a_call_of_its_own(tmp_path):
    book = make_book(tmp_path, chunk_tokens=8, lease_ttl_s=30.0, prompt_rows=rows(groups=2, n=2, max_tokens=32),
                     now=time.time(), in_place=True)
    engine = ScriptedEngine(length_of, max_chunks=4, pause_s=0.01, chunk_tokens=8)
    control = CoordinatorControl(book)
    worker = run_worker(book, engine, BeatDue, RecordingClient, control)
    assert worker.fatal is None and book.is_complete()
    reports = [body for body in worker.client.bodies if isinstance(body, protocol.ReportBody)]
    assert reports[0].heartbeat is not None and reports[0].heartbeat.worker_id == worker.worker_id
    assert protocol.HEARTBEAT.path not in worker.client.calls  # not one heartbeat call
    assert worker.worker_id in control.worker_stats  # the figures came with the report
    assert worker.heartbeat_interval_s < 1e6  # the coordinator's interval, from the report's reply


def test_a_report_names_the_context_of_each_request_left_waiting_once_its_group_commit_leased(tmp_path):
    # Two workers report in one group commit. w0's request continues in place; w1's is stopped
    # (w1 is drained: `may_lease=False`) and no lease of the commit takes it, so it waits: its
    # outcome carries its context (prompt + tokens), which says whom waking could help.
    book = make_book(tmp_path, chunk_tokens=16, prompt_rows=rows(groups=2, n=1, max_tokens=40, prompt_len=5),
                     in_place=True, first_chunk_spread=0.0)
    w0, w1 = register(book), register(book, "w1", rank=1)
    (a,) = book.lease(w0, wanted=1, now=1000.0)
    (b,) = book.lease(w1, wanted=1, now=1000.0)
    (outcomes0, grants0), (outcomes1, grants1) = book.report_calls(
        [ReportCall(w0, [running_on(a)], True, 0), ReportCall(w1, [running_on(b)], False, 0)], now=1001.0)
    assert grants0[0].continues and outcomes0[0].queued_context is None
    assert grants1 == [] and outcomes1[0].queued_context == 5 + 16
