"""Group commit: report calls that queue while the state thread is busy are committed together,
in one durable transaction (`CoordinatorControl.report`, `LeaseBook.report_calls`), each answered
as if alone. Deterministic: the state thread is held busy until every call has queued."""

from __future__ import annotations

import asyncio
import sqlite3
import threading

import pytest
from sqlalchemy import text

from seerd import protocol
from seerd.book.book import LeaseBook, UnknownWorker
from seerd.book.records import ReportCall
from seerd.book.records import BookBroken
from seerd.db.base import CommitTimes
from seerd.protocol import ChunkReport, EngineSettings, LeaseBody, RegisterBody, ReportBody
from seerd.server.app import CoordinatorControl, create_app
from seerd.settings import EngineConfig
from seerd.worker.client import CoordinatorClient
from tests.unit.helpers import VOCAB_SIZE, FakeClock, loopback_socket, make_book, rows, served

SECRET = "s3cret-token"
WORKERS = 5


def _served_book(tmp_path):  # noqa: ANN001, ANN202
    """A book of WORKERS groups of 2 under `divided`, its app and the socket it will serve on."""
    clock = FakeClock()
    book = make_book(tmp_path, policy="divided", prompt_rows=rows(groups=WORKERS, n=2, max_tokens=20), now=clock())
    control = CoordinatorControl(book, clock=clock)
    sock, address = loopback_socket()
    app = create_app(control, SECRET, address=address)
    app.state.engine_settings = EngineSettings("m", EngineConfig(), 0)
    return book, control, app, sock


def test_report_calls_queued_while_the_state_thread_is_busy_share_one_durable_commit(tmp_path):
    book, control, app, sock = _served_book(tmp_path)
    book.answer_slice_s = float("inf")  # the leases in one slice, however slow the machine (see below)

    async def scenario() -> list:
        async with served(app, sock) as url:
            clients = [CoordinatorClient(url, SECRET, patience_s=5.0) for _ in range(WORKERS)]
            grants = []
            for rank, client in enumerate(clients):
                reg = await client.call(protocol.REGISTER, RegisterBody(f"w{rank}", rank, "x", max_chunks=1,
                                                                        kv_capacity_tokens=1000))
                (grant,) = (await client.call(protocol.LEASE, LeaseBody(reg.worker_id, 1))).chunks
                grants.append((reg.worker_id, grant))
            durable_before, relaxed_before = CommitTimes.durable, CommitTimes.relaxed
            release = threading.Event()
            blocker = asyncio.ensure_future(control.run(release.wait, 30))  # the state thread, busy
            sent = [asyncio.ensure_future(client.call(protocol.REPORT, ReportBody(worker, [
                ChunkReport(grant.chunk_id, grant.epoch, [5] * 4, [-0.5] * 4, "stop")], wanted=1)))
                for client, (worker, grant) in zip(clients, grants)]
            while len(control._reports) < WORKERS:  # every call queued behind the busy state thread
                await asyncio.sleep(0.01)
            release.set()
            replies = await asyncio.gather(*sent)
            await blocker
            assert CommitTimes.durable - durable_before == 1  # one fsync for the five calls
            assert CommitTimes.relaxed - relaxed_before == 1  # and one transaction for their five leases
            for client in clients:
                await client.close()
            return [(reply, grant) for reply, (_, grant) in zip(replies, grants)]

    answered = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert (control.report_commits, control.reports_committed) == (1, WORKERS)
    # The state thread's turns as the coordinator records them: one commit, holding every call.
    turns = control.turns.figures()
    assert control.largest_turn["reports"] == WORKERS
    assert turns["reports ran"]["calls"] == turns["reports waited"]["calls"] == 1
    # And call by call: queued to its turn, to its answer set on the loop, to its handler going on.
    phases = [turns[f"report call {phase}"] for phase in ("waited", "answered", "resumed")]
    assert [figures["calls"] for figures in phases] == [WORKERS] * 3
    assert phases[0]["max_ms"] <= phases[1]["max_ms"] <= phases[2]["max_ms"]
    # Where the report turn's wall went (the kernel's figures for the state thread): its CPU and
    # its wait for a core fit inside it, and the turn's record says the same. (The times it was
    # put on a core may be 0: a turn the thread ran through without being switched out.)
    wall, cpu, run_queue, slices = control.turn_seconds["reports"]
    assert 0 < cpu <= wall and 0 <= run_queue <= wall and slices >= 0
    (report_turn,) = [t for t in control.slow_turns.figures()["slowest"] if "report_calls" in t["held"]]
    assert report_turn["held"]["thread cpu"] == [slices, round(1e3 * cpu, 1)]
    assert report_turn["held"]["run queue"] == [1, round(1e3 * run_queue, 1)]
    for reply, grant in answered:
        assert [(r.chunk_id, r.accepted, r.duplicate) for r in reply.results] == [(grant.chunk_id, True, False)]
        # Each call's lease, in the same state-thread call: the freed slot runs the group's sibling.
        assert len(reply.grants) == 1 and reply.grants[0].request_id != grant.request_id
    assert book.state.finished_requests == WORKERS


def test_lease_calls_queued_while_the_state_thread_is_busy_share_one_transaction(tmp_path):
    # `CoordinatorControl.lease`: the lease calls of one state-thread turn plan in arrival order,
    # each seeing the ones before (no chunk twice), and commit once.
    book, control, app, sock = _served_book(tmp_path)

    async def scenario() -> tuple[list, int]:
        async with served(app, sock) as url:
            clients = [CoordinatorClient(url, SECRET, patience_s=5.0) for _ in range(WORKERS)]
            workers = [(await client.call(protocol.REGISTER, RegisterBody(f"w{rank}", rank, "x", max_chunks=2,
                                                                          kv_capacity_tokens=1000))).worker_id
                       for rank, client in enumerate(clients)]
            relaxed_before = CommitTimes.relaxed
            holding, release = threading.Event(), threading.Event()
            blocker = asyncio.ensure_future(control.run(lambda: holding.set() or release.wait(30)))
            while not holding.is_set():  # the state thread busy before any lease queues (else its turn takes some)
                await asyncio.sleep(0.01)
            sent = [asyncio.ensure_future(client.call(protocol.LEASE, LeaseBody(worker, 2)))
                    for client, worker in zip(clients, workers)]
            while len(control._calls) < WORKERS:  # every call queued behind the busy state thread
                await asyncio.sleep(0.01)
            release.set()
            replies = await asyncio.gather(*sent)
            await blocker
            committed = CommitTimes.relaxed - relaxed_before
            for client in clients:
                await client.close()
            return [reply.chunks for reply in replies], committed

    granted, committed = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert committed == 1  # one transaction for the five calls' leases
    assert [len(chunks) for chunks in granted] == [2] * WORKERS
    chunk_ids = [grant.chunk_id for chunks in granted for grant in chunks]
    assert len(set(chunk_ids)) == 2 * WORKERS and len(book.state.leases) == 2 * WORKERS
    assert control.largest_turn["calls"] == WORKERS


def test_in_a_group_commit_an_unknown_worker_fails_its_call_alone(tmp_path):
    clock = FakeClock()
    book = make_book(tmp_path, policy="divided", prompt_rows=rows(groups=1, n=2, max_tokens=20), now=clock())
    book.register(rank=0, address="x", max_chunks=1, kv_capacity_tokens=1000, worker_id="w0", now=clock())
    (grant,) = book.lease("w0", 1, clock())
    report = ChunkReport(grant.chunk_id, grant.epoch, [5] * 4, [-0.5] * 4, "stop")
    ghost, real = book.report_calls([ReportCall("ghost", [report]), ReportCall("w0", [report], wanted=1)], clock())
    assert isinstance(ghost, UnknownWorker)
    outcomes, grants = real
    assert [o.accepted for o in outcomes] == [True] and len(grants) == 1
    assert book.state.finished_requests == 1


def test_a_lease_write_the_database_refuses_after_leases_were_applied_stops_the_book_and_loses_nothing(tmp_path):
    """The leases of one state-thread call share a transaction, each applied to the book as it is
    planned (the next plan must see it): when the database refuses a later one (here a trigger,
    as a full disk would), the book is ahead of the database and refuses every change; a book
    loaded again from the database (a resumed run) holds no lease the database lacks."""
    clock = FakeClock()
    book = make_book(tmp_path, policy="divided", prompt_rows=rows(groups=2, n=2, max_tokens=20), now=clock())
    for rank in range(2):
        book.register(rank=rank, address="x", max_chunks=1, kv_capacity_tokens=1000, worker_id=f"w{rank}",
                      now=clock())
    with book.writer.begin() as conn:
        conn.execute(text("CREATE TRIGGER refuse_w1 BEFORE INSERT ON events WHEN NEW.kind = 'chunk_leased' "
                          "AND NEW.worker_id = 'w1' BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END"))
    with pytest.raises(BookBroken, match="disk is full"):
        book.lease_calls([("w0", 1, ()), ("w1", 1, ())], clock())
    assert "disk is full" in book.broken
    for change in (lambda: book.lease("w0", 1, clock()), lambda: book.expire(clock()),
                   lambda: book.report_calls([ReportCall("w0", [])], clock())):
        with pytest.raises(BookBroken):
            change()
    with book.writer.begin() as conn:
        assert conn.execute(text("select count(*) from chunks")).scalar_one() == 0  # w0's lease rolled back
    book.close()
    again = LeaseBook(book.sessions, book.rollout_id, book.policy, chunk_tokens=16, lease_ttl_s=10.0, seed=0,
                      vocab_size=VOCAB_SIZE)
    again.load(clock())
    assert not again.state.leases and len(again.state.queue) == 4


def _reported_leases(tmp_path, workers: int):  # noqa: ANN202
    """A book of `workers` groups of 2 under `divided`, each worker holding one chunk, and the
    report call of each that finishes it and wants one more."""
    clock = FakeClock()
    book = make_book(tmp_path, policy="divided", prompt_rows=rows(groups=workers, n=2, max_tokens=20), now=clock())
    calls = []
    for rank in range(workers):
        book.register(rank=rank, address="x", max_chunks=1, kv_capacity_tokens=1000, worker_id=f"w{rank}",
                      now=clock())
        (grant,) = book.lease(f"w{rank}", 1, clock())
        calls.append(ReportCall(f"w{rank}", [ChunkReport(grant.chunk_id, grant.epoch, [5] * 4, [-0.5] * 4, "stop")],
                                wanted=1))
    return book, clock, calls


def test_a_report_turn_hands_out_each_slice_of_leases_as_it_commits(tmp_path):
    """`report_calls` commits its calls' leases in slices of `answer_slice_s` and hands each
    slice's replies out before it plans the next: with a slice of 0 every call is a slice, its
    lease committed and answered before the next call plans."""
    book, clock, calls = _reported_leases(tmp_path, 3)
    book.answer_slice_s = 0.0
    handed = []

    def hand_out(first: int, replies: list) -> None:
        with book.writer.begin(durable=False) as conn:  # committed: a reader sees the slice's leases
            leased = conn.execute(text("select count(*) from chunks where status = 'leased'")).scalar_one()
        handed.append((first, len(replies), leased, len(book.state.leases)))

    relaxed_before = CommitTimes.relaxed
    replies = book.report_calls(calls, clock(), hand_out=hand_out)
    # Each call its own slice, in order; when a slice is handed out only its leases and the
    # earlier ones exist (the next call has not planned yet), and they are committed.
    assert handed == [(0, 1, 1, 1), (1, 1, 2, 2), (2, 1, 3, 3)]
    assert CommitTimes.relaxed - relaxed_before >= 3
    assert [len(grants) for _, grants in replies] == [1, 1, 1]
    assert len({grants[0].chunk_id for _, grants in replies}) == 3


def test_a_slice_whose_leases_the_database_refuses_fails_alone_after_the_slices_before_were_handed_out(tmp_path):
    """The slices before a failed one were committed and handed out (their grants stand, durable
    in the database); the failed one's calls get the error (the caller answers them 5xx), its
    lease rolled back: refused before it was applied, the book stays whole."""
    book, clock, calls = _reported_leases(tmp_path, 2)
    book.answer_slice_s = 0.0
    with book.writer.begin() as conn:
        conn.execute(text("CREATE TRIGGER refuse_w1 BEFORE INSERT ON events WHEN NEW.kind = 'chunk_leased' "
                          "AND NEW.worker_id = 'w1' BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END"))
    handed = []
    with pytest.raises(sqlite3.IntegrityError, match="disk is full"):
        book.report_calls(calls, clock(), hand_out=lambda first, replies: handed.append((first, replies)))
    assert [(first, len(replies[0][1])) for first, replies in handed] == [(0, 1)]  # w0's grant was handed out
    with book.writer.begin() as conn:
        holders = conn.execute(text("select lease_holder from chunks where status = 'leased'")).scalars().all()
    assert holders == ["w0"] and [lease.worker_id for lease in book.state.leases.values()] == ["w0"]
    assert book.broken is None and book.state.finished_requests == 2  # both reports stand
