"""Poison requests end: a chunk the engine fails is retried on another worker's engine where there
is one, and after `MAX_FAILED_ATTEMPTS` its request ends `failed` with the engine's message. The
rest of the run completes; the export has the failed ones with finish_reason "error". Real SQLite,
an injected clock; no engine (the worker's release with `failed=True` is what an engine error sends).
"""

from __future__ import annotations

import json

from sqlalchemy import select

from seerd.book.book import MAX_FAILED_ATTEMPTS
from seerd.db import Chunk, ChunkStatus, Event, Request, RequestStatus
from seerd.io.export import export_run
from seerd.protocol import ChunkReport
from seerd.rundir import RunDir
from seerd.scheduler.base import failed_here
from seerd.scheduler.views import QueuedRequest
from tests.unit.helpers import make_book, reopen, rows

ERROR = "ValueError('temperature 2.5 is out of range')"


def register(book, name, rank, now=1000.0):
    return book.register(rank=rank, address="test", max_chunks=8, kv_capacity_tokens=100_000, worker_id=name,
                         now=now).id


def finish(book, worker, grant, now):
    n = grant.max_tokens
    assert book.report(worker, ChunkReport(grant.chunk_id, grant.epoch, [7] * n, [-0.5] * n, "stop"), now).accepted


def test_a_retry_goes_to_a_worker_that_has_not_failed_it_where_there_is_one():
    def queued(failed_on):
        return QueuedRequest(1, 0, 0, 0, 5, 0, 16, True, 16, None, 0.0, failed_on=frozenset(failed_on))

    assert failed_here(queued({"a"}), "a", ["a", "b"])
    assert not failed_here(queued({"a"}), "b", ["a", "b"])
    assert not failed_here(queued({"a", "b"}), "a", ["a", "b"])  # every engine failed it: anywhere
    assert not failed_here(queued({"a"}), "a", ["a"])  # no other live worker: here
    assert not failed_here(queued(()), "a", ["a", "b"])


def test_a_poison_request_fails_after_its_retries_and_the_run_completes(tmp_path):
    book = make_book(tmp_path, chunk_tokens=16, prompt_rows=rows(groups=2, n=2, max_tokens=16))
    a, b = register(book, "a", 0), register(book, "b", 1)
    grants = book.lease(a, wanted=8, now=1000.0)
    poison = grants[0].request_id
    now = 1001.0
    for other in grants[1:]:
        finish(book, a, other, now)
    holder, grant, failed_on = a, grants[0], []
    for attempt in range(1, MAX_FAILED_ATTEMPTS + 1):
        assert book.release(holder, grant.chunk_id, grant.epoch, ERROR, now, failed=True)
        failed_on.append(holder)
        now += 1.0
        if attempt == MAX_FAILED_ATTEMPTS:
            break
        # The worker that failed it asks first, but gets it only once every live worker failed it.
        again = book.lease(holder, wanted=8, now=now)
        other = b if holder == a else a
        if other not in failed_on:
            assert again == []
            holder, (grant,) = other, book.lease(other, wanted=8, now=now)
        else:
            (grant,) = again
        assert grant.request_id == poison
    assert failed_on == [a, b, b] or failed_on == [a, b, a]
    assert book.is_complete() and book.state.failed_requests == 1 and book.state.finished_requests == 3
    assert book.state.unfinished_groups == {}  # its group ended (one finished, one failed)
    assert book.state.growth.completed_groups == 1  # only the all-finished group teaches the table
    with book.sessions.begin() as session:
        request = session.get(Request, poison)
        assert (request.status, request.failed_attempts, request.error) == (RequestStatus.FAILED, 3, ERROR)
        assert request.finish_reason == "error"
        chunks = session.scalars(select(Chunk.status).where(Chunk.request_id == poison)).all()
        assert chunks == [ChunkStatus.FAILED]  # one chunk row, re-leased twice, failed at the end
        kinds = session.scalars(select(Event.kind).where(Event.request_id == poison).order_by(Event.id)).all()
        assert kinds.count("chunk_failed") == 2 and kinds[-1] == "request_failed"
        result = export_run(session, book.rollout_id, RunDir(tmp_path))
    assert (result.responses, result.responses_total, result.failed, result.complete) == (4, 4, 1, True)
    exported = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    failed = [row for row in exported if row["finish_reason"] == "error"]
    assert len(failed) == 1 and failed[0]["error"] == ERROR and failed[0]["token_ids"] == []
    assert all(row["error"] is None and row["length"] == 16 for row in exported if row not in failed)
    assert json.loads((tmp_path / "rollouts.meta.json").read_text())["failed"] == 1


def test_a_chunk_given_back_unrun_counts_no_failure_and_failures_survive_a_restart(tmp_path):
    book = make_book(tmp_path, chunk_tokens=16, prompt_rows=rows(groups=1, n=1, max_tokens=32))
    w = register(book, "a", 0)
    (grant,) = book.lease(w, wanted=8, now=1000.0)
    assert book.release(w, grant.chunk_id, grant.epoch, "worker stopped (SIGTERM)", 1001.0)
    (grant,) = book.lease(w, wanted=8, now=1002.0)
    assert book.release(w, grant.chunk_id, grant.epoch, ERROR, 1003.0, failed=True)
    assert book.progress[grant.request_id].failed_attempts == 1
    restarted = reopen(book, now=1004.0)
    assert restarted.progress[grant.request_id].failed_attempts == 1
    w2 = register(restarted, "a2", 0, now=1004.0)
    for attempt in range(2, MAX_FAILED_ATTEMPTS + 1):
        (grant,) = restarted.lease(w2, wanted=8, now=1004.0 + attempt)
        assert restarted.release(w2, grant.chunk_id, grant.epoch, ERROR, 1004.5 + attempt, failed=True)
    assert restarted.is_complete() and restarted.state.failed_requests == 1
    again = reopen(restarted, now=1010.0)  # a failed request stays failed and the run complete
    assert again.is_complete() and not len(again.state.queue) and again.state.failed_requests == 1


def test_status_and_report_show_the_failed_requests(tmp_path):
    from seerd.report.build import SUMMARY_FILE, write_report
    from seerd.status.render import render
    from seerd.status.snapshot import read_snapshot

    book = make_book(tmp_path, chunk_tokens=16, prompt_rows=rows(groups=2, n=2, max_tokens=16))
    w = register(book, "a", 0)
    grants = book.lease(w, wanted=8, now=1000.0)
    for grant in grants[1:]:
        finish(book, w, grant, 1001.0)
    grant = grants[0]
    for attempt in range(MAX_FAILED_ATTEMPTS):  # one worker only: every retry is here
        assert book.release(w, grant.chunk_id, grant.epoch, ERROR, 1002.0 + attempt, failed=True)
        if attempt < MAX_FAILED_ATTEMPTS - 1:
            (grant,) = book.lease(w, wanted=8, now=1002.5 + attempt)
    snapshot = read_snapshot(tmp_path, now=1010.0)
    assert (snapshot["requests_done"], snapshot["requests_failed"], snapshot["groups_done"]) == (3, 1, 2)
    assert snapshot["eta_s"] is None
    from io import StringIO

    from rich.console import Console

    out = StringIO()
    Console(file=out, width=100, color_system=None).print(render(snapshot))
    assert "3/4  (0 running, 1 failed)" in out.getvalue()
    write_report(tmp_path, tmp_path / "report")
    summary = (tmp_path / "report" / SUMMARY_FILE).read_text()
    assert "| requests | 4 (3 finished, 1 failed: finish_reason error in the export) |" in summary


def test_seer_leaves_no_request_between_affinity_and_a_failed_engine(tmp_path):
    """Affinity keeps a request for the worker that ran it last; when that worker's engine failed
    it, the request must go to the other worker (found on real engines: it waited forever)."""
    book = make_book(tmp_path, policy="seer", chunk_tokens=16, prompt_rows=rows(groups=1, n=1, max_tokens=32))
    a, b = register(book, "a", 0), register(book, "b", 1)
    (grant,) = book.lease(a, wanted=8, now=1000.0)
    assert book.release(a, grant.chunk_id, grant.epoch, ERROR, 1001.0, failed=True)
    assert book.lease(a, wanted=8, now=1002.0) == []  # a failed it and b has not
    (again,) = book.lease(b, wanted=8, now=1002.0)  # b's call is not left to a by affinity
    assert again.request_id == grant.request_id
