"""Liveness by progress (`seerd.book.liveness`): on the real lease book (SQLite) with moved
time. A worker whose engine stops stepping loses its leases within the stall bound although its
heartbeats go on, and is taken out; a worker whose engine fails what others run is taken out; a
poison request takes out nobody. The API tells a taken-out worker so, and its client raises."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import select

from seerd import protocol
from seerd.book.book import MAX_FAILED_ATTEMPTS, RetiredWorker
from seerd.book.liveness import RETIRE_AFTER_REFUTED, STALL_STEPS, stall_bound
from seerd.db import Event, Worker, WorkerStatus
from seerd.protocol import ChunkReport, EngineProgress, HeartbeatBody
from seerd.server.app import CoordinatorControl, create_app
from seerd.status.snapshot import read_snapshot
from seerd.worker.client import CoordinatorClient, Retired
from seerd.worker.engine import StepClock
from tests.unit.helpers import loopback_socket, make_book, rows, served
from tests.unit.test_leases import full_report, register
from tests.unit.test_worker_answers import SECRET

TTL = 10.0
FAILURE = "ValueError('refused by this engine')"


def beat(book, worker, grants, now, steps, longest_step_s=0.1, generating=None):  # noqa: ANN001, ANN201
    generating = len(grants) if generating is None else generating
    return book.heartbeat(worker, [g.chunk_id for g in grants], now,
                          engine=EngineProgress(steps, longest_step_s, generating))


def events(book, kind):  # noqa: ANN001, ANN201
    with book.sessions.begin() as s:
        return s.execute(select(Event.worker_id, Event.data_json).where(Event.kind == kind)).all()


def test_a_stepping_engine_keeps_its_leases_past_the_ttl(tmp_path):
    book = make_book(tmp_path, lease_ttl_s=TTL, prompt_rows=rows(groups=1, n=2))
    w = register(book)
    grants = book.lease(w, wanted=2, now=1000.0)
    for i, now in enumerate(range(1002, 1062, 2)):  # a minute of heartbeats, each after a step
        beat(book, w, grants, float(now), steps=i + 1)
        assert book.expire(float(now)) == 0
    assert set(book.state.leases) == {g.chunk_id for g in grants}


def test_a_stopped_engine_under_a_live_worker_loses_its_leases_and_the_worker_is_taken_out(tmp_path):
    book = make_book(tmp_path, lease_ttl_s=TTL, prompt_rows=rows(groups=1, n=2))
    stuck, healthy = register(book, "stuck"), register(book, "healthy", rank=1)
    grants = book.lease(stuck, wanted=2, now=1000.0)
    beat(book, stuck, grants, 1001.0, steps=5)  # it stepped once after the lease, then stopped
    now = 1001.0
    while now < 1001.0 + TTL:  # heartbeats go on; the step counter does not move
        now += 2.0
        beat(book, stuck, grants, now, steps=5)
        beat(book, healthy, [], now, steps=0)
        assert book.expire(now) == 0 and book.known_worker(stuck)
    now += 2.0
    beat(book, healthy, [], now, steps=0)
    assert book.expire(now) == 2  # its two requests back in the queue: the daemon serves waiting calls
    assert not book.state.leases and not book.known_worker(stuck)
    with pytest.raises(RetiredWorker) as retired:
        beat(book, stuck, grants, now, steps=5)
    assert "no progress for 12s" in retired.value.reason
    regrants = book.lease(healthy, wanted=2, now=now)  # its chunks run elsewhere at once
    assert {g.chunk_id for g in regrants} == {g.chunk_id for g in grants}
    assert all(g.epoch == 2 for g in regrants)
    assert [w for w, _ in events(book, "worker_retired")] == [stuck]
    assert len(events(book, "lease_revoked")) == 2
    with book.sessions.begin() as s:
        assert s.get(Worker, stuck).status == WorkerStatus.GONE
    shown = {w["worker_id"]: w for w in read_snapshot(tmp_path, now=now)["workers"]}  # `seerd status`
    assert "no progress" in shown[stuck]["taken_out"] and shown[healthy]["taken_out"] is None


def test_the_stall_bound_grows_with_the_engines_longest_step(tmp_path):
    assert stall_bound(TTL, 0.5) == TTL
    assert stall_bound(TTL, 20.0) == STALL_STEPS * 20.0
    book = make_book(tmp_path, lease_ttl_s=TTL, prompt_rows=rows(groups=1, n=1))
    w = register(book)
    grants = book.lease(w, wanted=1, now=1000.0)
    beat(book, w, grants, 1001.0, steps=3, longest_step_s=20.0)  # a slow engine: 20 s steps
    for now in (1021.0, 1041.0, 1061.0, 1080.0):  # one 80 s step: slow, not stuck
        beat(book, w, grants, now, steps=3, longest_step_s=20.0)
        assert book.expire(now) == 0
    book.expire(1001.0 + STALL_STEPS * 20.0 + 1.0)
    assert not book.state.leases and not book.known_worker(w)


def test_an_idle_engine_is_not_stuck_nor_one_whose_chunks_wait_for_their_reports(tmp_path):
    book = make_book(tmp_path, lease_ttl_s=TTL, prompt_rows=rows(groups=1, n=1))
    idle = register(book, "idle")
    for now in range(1002, 1060, 2):  # an idle engine does not step: it holds nothing, all is well
        beat(book, idle, [], float(now), steps=7)
    assert book.expire(1060.0) == 0 and book.known_worker(idle)
    waiting = book.lease(idle, wanted=1, now=1060.0)
    for now in range(1062, 1120, 2):  # its chunk is done in the engine; its report takes long to pass
        beat(book, idle, waiting, float(now), steps=8, generating=0)
        assert book.expire(float(now)) == 0
    assert book.known_worker(idle) and book.report(idle, full_report(waiting[0]), now=1120.0).accepted


def test_an_engine_that_does_not_tell_its_steps_is_renewed_by_heartbeats(tmp_path):
    book = make_book(tmp_path, lease_ttl_s=TTL, prompt_rows=rows(groups=1, n=1))
    w = register(book)
    grants = book.lease(w, wanted=1, now=1000.0)
    for now in range(1002, 1060, 2):  # no `engine` in its heartbeats: each renews, as before
        book.heartbeat(w, [g.chunk_id for g in grants], float(now))
        assert book.expire(float(now)) == 0
    assert set(book.state.leases) == {grants[0].chunk_id}
    book.expire(1060.0 + TTL + 0.5)  # until they stop
    assert not book.state.leases


def fail(book, worker, grant, now):  # noqa: ANN001, ANN201
    assert book.release(worker, grant.chunk_id, grant.epoch, FAILURE, now, failed=True)


def test_a_worker_whose_engine_fails_what_others_run_is_taken_out(tmp_path):
    book = make_book(tmp_path, chunk_tokens=16, prompt_rows=rows(groups=2, n=2, max_tokens=32))
    bad, good = register(book, "bad"), register(book, "good", rank=1)
    now = 1000.0
    grants = book.lease(bad, wanted=RETIRE_AFTER_REFUTED, now=now)
    for grant in grants:
        fail(book, bad, grant, now)
    assert book.known_worker(bad)  # failures alone say nothing yet: they may be poison requests
    for i, grant in enumerate(book.lease(good, wanted=RETIRE_AFTER_REFUTED, now=now + 1)):
        assert book.report(good, full_report(grant), now=now + 2).accepted
        assert book.known_worker(bad) == (i + 1 < RETIRE_AFTER_REFUTED)  # each one ran elsewhere
    (retired,) = events(book, "worker_retired")
    assert retired.worker_id == bad and "failed 3 chunks in a row" in retired.data_json
    assert book.known_worker(good)


def test_a_good_chunk_ends_the_streak_and_poison_requests_take_out_nobody(tmp_path):
    book = make_book(tmp_path, chunk_tokens=16, prompt_rows=rows(groups=4, n=2, max_tokens=16))
    a, b = register(book, "a"), register(book, "b", rank=1)
    now = 1000.0
    poison, *rest = book.lease(a, wanted=8, now=now)  # one chunk per request, all on a
    # Poison: every engine fails it until it ends failed.
    for attempt in range(MAX_FAILED_ATTEMPTS):
        fail(book, grant_holder(book, poison), poison, now)
        now += 1.0
        if attempt + 1 < MAX_FAILED_ATTEMPTS:
            (poison,) = book.lease(b, wanted=1, now=now) or book.lease(a, wanted=1, now=now)
    assert book.state.failed_requests == 1
    # Two failures that b then runs, a good chunk of a's own, two more: never three in a row.
    for failing, good in ((rest[0:2], rest[2]), (rest[3:5], rest[5])):
        for grant in failing:
            fail(book, a, grant, now)
        for grant in book.lease(b, wanted=2, now=now):
            assert book.report(b, full_report(grant), now=now).accepted
        assert book.report(a, full_report(good), now=now).accepted
    for grant in rest[6:]:
        assert book.report(a, full_report(grant), now=now).accepted
    assert book.is_complete()
    assert book.known_worker(a) and book.known_worker(b) and not events(book, "worker_retired")


def grant_holder(book, grant):  # noqa: ANN001, ANN201
    return book.state.leases[grant.chunk_id].worker_id


def test_the_step_clock_counts_steps_and_forgets_an_old_slow_one():
    clock = StepClock()
    clock.record(9.0)  # a warm-up step
    for _ in range(StepClock.WINDOW - 1):
        clock.record(0.01)
    assert clock.progress(1) == EngineProgress(StepClock.WINDOW, 9.0, 1)  # remembered a window longer
    for _ in range(StepClock.WINDOW):
        clock.record(0.02)
    assert clock.progress(0) == EngineProgress(2 * StepClock.WINDOW, 0.02, 0)


def test_the_api_tells_a_taken_out_worker_to_exit(tmp_path):
    book = make_book(tmp_path, lease_ttl_s=TTL, prompt_rows=rows(groups=1, n=1))
    w = register(book)
    grants = book.lease(w, wanted=1, now=1000.0)
    beat(book, w, grants, 1001.0, steps=1)
    book.expire(1001.0 + TTL + 1.0)
    sock, address = loopback_socket()
    app = create_app(CoordinatorControl(book, clock=lambda: 1013.0), SECRET, address=address)

    async def scenario() -> None:
        async with served(app, sock) as url:
            await calls(CoordinatorClient(url, SECRET))

    async def calls(client: CoordinatorClient) -> None:
        with pytest.raises(Retired, match="taken out: its engine made no progress"):
            await client.call(protocol.HEARTBEAT, HeartbeatBody(w, [grants[0].chunk_id], {},
                                                                EngineProgress(1, 0.1, 1)))
        with pytest.raises(Retired):
            await client.call(protocol.REPORT, protocol.ReportBody(w, [ChunkReport(
                grants[0].chunk_id, grants[0].epoch, [1], [-1.0], "length")]))
        await client.close()

    asyncio.run(scenario())
