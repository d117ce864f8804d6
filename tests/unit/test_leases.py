"""Lease logic on a real SQLite database with an injected clock: expiry, fencing, duplicates."""

from __future__ import annotations

from sqlalchemy import func, select

from seerd.book.book import MAX_FAILED_ATTEMPTS, UnknownWorker
from seerd.db import Chunk, ChunkStatus, Event, Group, Request, RequestStatus
from seerd.kvpool.host import queued_longest
from seerd.protocol import ChunkReport
from tests.unit.helpers import make_book, reopen, rows

import pytest


def register(book, name="w0", rank=0, now=1000.0, max_chunks=8, kv=100_000):
    return book.register(rank=rank, address="test", max_chunks=max_chunks, kv_capacity_tokens=kv,
                         worker_id=name, now=now).id


def full_report(grant, n=None, reason="length", token=7):
    n = grant.max_tokens if n is None else n
    return ChunkReport(grant.chunk_id, grant.epoch, [token] * n, [-1.0] * n, reason)


def test_lease_hands_out_chunk_sized_budgets_with_context(tmp_path):
    book = make_book(tmp_path, chunk_tokens=16)
    w = register(book)
    grants = book.lease(w, wanted=8, now=1000.0)
    assert len(grants) == 4  # 2 groups x n=2
    assert all(g.max_tokens == 16 and g.epoch == 1 for g in grants)
    assert grants[0].prompt_token_ids == list(range(10, 15))
    # Second chunk of a request carries prompt + first chunk's tokens.
    assert book.report(w, full_report(grants[0]), now=1001.0).accepted
    (again,) = [g for g in book.lease(w, wanted=8, now=1001.0) if g.request_id == grants[0].request_id]
    assert again.prompt_token_ids == list(range(10, 15)) + [7] * 16
    assert again.max_tokens == 16


def test_last_chunk_budget_is_what_remains(tmp_path):
    book = make_book(tmp_path, chunk_tokens=16, prompt_rows=rows(groups=1, n=1, max_tokens=40))
    w = register(book)
    budgets = []
    for t in range(3):
        (grant,) = book.lease(w, wanted=1, now=1000.0 + t)
        budgets.append(grant.max_tokens)
        book.report(w, full_report(grant), now=1000.5 + t)
    assert budgets == [16, 16, 8]
    assert book.is_complete()
    # The generation phase ends at the report that finished the last request (the export after
    # it is not the engines' time): what the coordinator's CPU share is measured over.
    assert (book.first_lease_at, book.completed_at) == (1000.0, 1002.5)
    assert book.completed_cpu is not None and book.completed_cpu.process_s >= book.first_lease_cpu.process_s
    with book.sessions.begin() as s:
        req = s.scalars(select(Request)).one()
        assert (req.status, req.generated_tokens, req.num_chunks, req.finish_reason) == (
            RequestStatus.FINISHED, 40, 3, "length")


def test_expired_lease_requeues_and_fences_the_stale_report(tmp_path):
    book = make_book(tmp_path, lease_ttl_s=10.0, prompt_rows=rows(groups=1, n=1),
                     first_chunk_spread=0.0)  # the regrant's budget is the whole chunk
    slow = register(book, "slow", now=1000.0)
    (grant,) = book.lease(slow, wanted=1, now=1000.0)
    assert book.expire(now=1005.0) == 0
    assert book.expire(now=1010.5) == 1
    fast = register(book, "fast", rank=1, now=1010.5)
    (regrant,) = book.lease(fast, wanted=1, now=1011.0)
    assert regrant.chunk_id == grant.chunk_id and regrant.epoch == grant.epoch + 1
    # The slow worker finally reports its old epoch: rejected, counts nothing.
    outcome = book.report(slow, full_report(grant, token=1), now=1012.0)
    assert not outcome.accepted and "stale" in outcome.reason
    assert book.report(fast, full_report(regrant, token=2), now=1012.0).accepted
    assert book.state.output_tokens == 16
    with book.sessions.begin() as s:
        chunk = s.get(Chunk, grant.chunk_id)
        assert chunk.status == ChunkStatus.DONE and chunk.attempt == 2 and chunk.lease_holder == "fast"
        assert s.get(Request, regrant.request_id).generated_tokens == 16
        assert s.scalar(select(func.count()).select_from(Event).where(Event.kind == "lease_expired")) == 1


def test_workers_first_leases_are_shortened_by_rank_so_their_first_boundaries_spread(tmp_path):
    # Engines started together would reach their first chunk boundaries together and report at
    # once; each worker's first lease is shorter by a fraction of up to FIRST_CHUNK_SPREAD of a
    # chunk, spread over ranks. Its later leases are whole chunks.
    from seerd.scheduler.state import FIRST_CHUNK_SPREAD, first_chunk_tokens

    book = make_book(tmp_path, chunk_tokens=64, prompt_rows=rows(groups=8, n=2, max_tokens=1000))
    workers = [register(book, f"w{rank}", rank=rank) for rank in range(8)]
    firsts = [book.lease(w, wanted=1, now=1000.0)[0].max_tokens for w in workers]
    assert firsts == [first_chunk_tokens(64, rank) for rank in range(8)]
    assert firsts[0] == 64 and len(set(firsts)) == 8
    assert all(64 * (1 - FIRST_CHUNK_SPREAD) <= budget <= 64 for budget in firsts)
    assert [book.lease(w, wanted=1, now=1001.0)[0].max_tokens for w in workers] == [64] * 8
    unspread = make_book(tmp_path, chunk_tokens=64, prompt_rows=rows(groups=2, n=1, max_tokens=1000),
                         db_name="unspread.db", first_chunk_spread=0.0)
    assert unspread.lease(register(unspread, "w5", rank=5), wanted=1, now=1000.0)[0].max_tokens == 64


def test_report_after_expiry_but_before_release_is_rejected(tmp_path):
    book = make_book(tmp_path, lease_ttl_s=10.0, prompt_rows=rows(groups=1, n=1))
    w = register(book)
    (grant,) = book.lease(w, wanted=1, now=1000.0)
    book.expire(now=1020.0)
    assert not book.report(w, full_report(grant), now=1021.0).accepted
    assert book.state.output_tokens == 0


def test_heartbeat_extends_only_leases_the_worker_still_runs(tmp_path):
    book = make_book(tmp_path, lease_ttl_s=10.0, prompt_rows=rows(groups=1, n=2))
    w = register(book)
    a, b = book.lease(w, wanted=2, now=1000.0)
    abort = book.heartbeat(w, running=[a.chunk_id, 999], now=1008.0)
    assert abort == [999]  # unknown to the coordinator: the worker must drop it
    assert book.expire(now=1012.0) == 1  # b was not extended
    assert set(book.state.leases) == {a.chunk_id}


def test_duplicate_report_is_idempotent(tmp_path):
    book = make_book(tmp_path, prompt_rows=rows(groups=1, n=1))
    w = register(book)
    (grant,) = book.lease(w, wanted=1, now=1000.0)
    first = book.report(w, full_report(grant), now=1001.0)
    second = book.report(w, full_report(grant), now=1002.0)
    assert first.accepted and not first.duplicate
    assert second.accepted and second.duplicate
    assert book.state.output_tokens == 16
    with book.sessions.begin() as s:
        assert s.get(Request, grant.request_id).generated_tokens == 16
        assert s.scalar(select(func.count()).select_from(Chunk)) == 1


def test_report_from_another_worker_with_the_right_epoch_is_rejected(tmp_path):
    book = make_book(tmp_path, prompt_rows=rows(groups=1, n=1))
    w, other = register(book, "a"), register(book, "b", rank=1)
    (grant,) = book.lease(w, wanted=1, now=1000.0)
    assert not book.report(other, full_report(grant), now=1001.0).accepted
    assert book.report(w, full_report(grant), now=1001.0).accepted


def test_a_bad_report_is_rejected_stores_nothing_and_its_chunk_runs_again_until_its_request_fails(tmp_path):
    book = make_book(tmp_path, prompt_rows=rows(groups=1, n=1))
    w = register(book)
    now = 1000.0
    for attempt, (bad, why) in enumerate((
        (lambda g: ChunkReport(g.chunk_id, g.epoch, [1] * 17, [0.0] * 17, "length"), "budget"),
        (lambda g: ChunkReport(g.chunk_id, g.epoch, [1, 2], [0.0], "length"), "logprobs"),
        (lambda g: ChunkReport(g.chunk_id, g.epoch, [1], [0.0], "weird"), "finish_reason"),
    ), 1):
        (grant,) = book.lease(w, wanted=1, now=now)
        assert grant.epoch == attempt  # the same chunk row, leased again after each rejection
        outcome = book.report(w, bad(grant), now=now)
        assert not outcome.accepted and why in outcome.reason
        assert outcome.rerun == (attempt < MAX_FAILED_ATTEMPTS)
        assert grant.chunk_id not in book.state.leases and book.state.output_tokens == 0
        now += 1
    # The third rejection is the request's third failed chunk: it ends failed, and the run with it.
    assert "its request failed" in outcome.reason and book.is_complete()
    assert book.lease(w, wanted=1, now=now) == []
    with book.sessions.begin() as s:
        assert s.scalar(select(func.count()).select_from(Chunk)) == 1
        kinds = s.scalars(select(Event.kind).where(Event.kind.in_(("report_rejected", "request_failed")))).all()
        assert kinds == ["report_rejected", "report_rejected", "request_failed"]


def test_stop_finishes_the_request_and_updates_the_group_estimate(tmp_path):
    book = make_book(tmp_path, prompt_rows=rows(groups=1, n=2, max_tokens=40))
    w = register(book)
    a, b = book.lease(w, wanted=2, now=1000.0)
    book.report(w, full_report(a, n=5, reason="stop"), now=1001.0)
    with book.sessions.begin() as s:
        group = s.scalars(select(Group)).one()
        assert group.length_estimate == 5 and group.finished_requests == 1
    book.report(w, full_report(b), now=1001.0)
    (b2,) = book.lease(w, wanted=2, now=1002.0)
    book.report(w, full_report(b2, n=3, reason="stop"), now=1003.0)
    with book.sessions.begin() as s:
        group = s.scalars(select(Group)).one()
        assert group.length_estimate == 19 and group.finished_requests == 2 and group.finished_at == 1003.0
    assert book.is_complete()


def test_unknown_worker_must_register(tmp_path):
    book = make_book(tmp_path)
    with pytest.raises(UnknownWorker):
        book.lease("nobody", wanted=1, now=1000.0)


def test_restart_requeues_leases_and_fences_the_old_coordinators_workers(tmp_path):
    book = make_book(tmp_path, prompt_rows=rows(groups=1, n=2))
    w = register(book)
    a, b = book.lease(w, wanted=2, now=1000.0)
    book.report(w, full_report(a), now=1001.0)
    restarted = reopen(book, now=1002.0)
    assert restarted.state.leases == {} and restarted.state.output_tokens == 16
    with pytest.raises(UnknownWorker):  # workers of the dead coordinator must register again
        restarted.report(w, full_report(b), now=1003.0)
    w2 = register(restarted, "w0", now=1003.0)
    assert w2 != w  # a new identity: old-epoch reports cannot pass as this worker's
    grants = restarted.lease(w2, wanted=2, now=1003.0)
    assert sorted(g.request_id for g in grants) == sorted([a.request_id, b.request_id])
    regrant_b = next(g for g in grants if g.request_id == b.request_id)
    assert regrant_b.chunk_id == b.chunk_id and regrant_b.epoch == b.epoch + 1


def test_release_puts_the_chunk_back(tmp_path):
    book = make_book(tmp_path, prompt_rows=rows(groups=1, n=1))
    w = register(book)
    (grant,) = book.lease(w, wanted=1, now=1000.0)
    assert book.release(w, grant.chunk_id, grant.epoch, "engine error", now=1001.0)
    assert not book.release(w, grant.chunk_id, grant.epoch, "again", now=1001.0)
    (again,) = book.lease(w, wanted=1, now=1002.0)
    assert again.chunk_id == grant.chunk_id and again.epoch == 2


def test_chunk_seeds_differ_per_request_and_chunk_but_repeat_per_run(tmp_path):
    book = make_book(tmp_path, prompt_rows=rows(groups=2, n=2))
    w = register(book)
    seeds = [g.sampling.seed for g in book.lease(w, wanted=8, now=1000.0)]
    assert len(set(seeds)) == 4
    other = make_book(tmp_path, prompt_rows=rows(groups=2, n=2), db_name="other.db")
    w2 = register(other)
    assert [g.sampling.seed for g in other.lease(w2, wanted=8, now=1000.0)] == seeds


def test_queued_longest_names_requests_that_ran_oldest_first(tmp_path):
    book = make_book(tmp_path, prompt_rows=rows(groups=3, n=2))  # 6 requests
    w = register(book)
    grants = book.lease(w, wanted=4, now=1000.0)  # two never run: they hold no pool blocks
    for t, grant in zip((1003.0, 1001.0, 1002.0), grants[:3]):
        assert book.report(w, full_report(grant), now=t).accepted  # back in the queue at t
    running = grants[3].request_id
    oldest_first = [grants[1].request_id, grants[2].request_id, grants[0].request_id]

    waiting = queued_longest(book.state, 10)
    assert [v.request_id for v in waiting] == oldest_first
    assert running not in {v.request_id for v in waiting}
    assert [v.queued_at for v in waiting] == [1001.0, 1002.0, 1003.0]
    assert all(v.group_id == book.state.requests[v.request_id].group_id for v in waiting)
    assert [v.request_id for v in queued_longest(book.state, 2)] == oldest_first[:2]
    assert [v.request_id for v in queued_longest(book.state, 10, after=waiting[0])] == oldest_first[1:]
    assert queued_longest(book.state, 10, after=waiting[-1]) == []


def test_a_seer_book_builds_its_queue_index_as_it_loads_and_its_first_lease_uses_it(tmp_path, monkeypatch):
    # Built by the first lease instead, every first lease of the start-up fill waited behind it.
    from seerd.scheduler import queue as queue_module
    from seerd.scheduler.seer import SeerPolicy

    built = []
    index_init = queue_module._Index.__init__

    def counted(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        built.append(1)
        index_init(self, *args, **kwargs)

    monkeypatch.setattr(queue_module._Index, "__init__", counted)
    book = make_book(tmp_path / "prepared", policy="seer", prompt_rows=rows(groups=4, n=3))
    assert len(built) == 1
    grants = book.lease(register(book), wanted=5, now=1000.0)
    assert len(built) == 1 and len(grants) == 5
    # The same first plan as a book whose index the first lease builds.
    monkeypatch.delattr(SeerPolicy, "prepare")
    cold = make_book(tmp_path / "cold", policy="seer", prompt_rows=rows(groups=4, n=3))
    assert len(built) == 1
    cold_grants = cold.lease(register(cold), wanted=5, now=1000.0)
    assert len(built) == 2
    assert [g.request_id for g in cold_grants] == [g.request_id for g in grants]
