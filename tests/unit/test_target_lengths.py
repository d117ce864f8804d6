"""Target lengths (benchmark rows): workers end responses there; the scheduler never sees them."""

from __future__ import annotations

import dataclasses
import re

import msgspec
import pytest
from sqlalchemy import select

from seerd.db import Group, Request, RequestTarget
from seerd.io.export import collect_rows
from seerd.io.prompts import PromptRow
from seerd.protocol import ChunkGrant, ChunkReport
from seerd.scheduler import Plan, QueuedRequest, Snapshot, WorkerLoad, make_policy
from seerd.scheduler.records import GroupRecord, LeaseRecord, RequestRecord, WorkerRecord
from seerd.settings import Sampling
from seerd.worker.worker import generation_budget, reported_finish_reason
from tests.unit.helpers import make_book

TARGETS = {0: (5, 40, 17), 1: (33, 32, 1), 2: (16, 16, 40)}


def target_rows(with_targets: bool = True) -> list[PromptRow]:
    return [PromptRow(f"p{g}", tuple(range(10 + g, 17 + g)), 3, 40, {}, g + 1,
                      TARGETS[g] if with_targets else None) for g in TARGETS]


def register(book, name="w0", rank=0, max_chunks=4, kv=100_000):  # noqa: ANN001, ANN201
    return book.register(rank=rank, address="test", max_chunks=max_chunks, kv_capacity_tokens=kv,
                         worker_id=name, now=1000.0).id


def obey_target(grant: ChunkGrant) -> ChunkReport:
    """What a worker does with a grant: stop at the target if it comes within this chunk."""
    n, reason = grant.max_tokens, "length"
    if grant.target_remaining is not None and grant.target_remaining <= grant.max_tokens:
        n, reason = grant.target_remaining, "length_target"
    return ChunkReport(grant.chunk_id, grant.epoch, [7] * n, [-0.5] * n, reason)


def test_targets_are_stored_apart_and_reach_only_the_grant(tmp_path):
    book = make_book(tmp_path, chunk_tokens=16, prompt_rows=target_rows())
    with book.sessions.begin() as s:
        stored = s.execute(select(Group.group_index, Request.response_index, RequestTarget.target_length)
                           .join(Request, Request.id == RequestTarget.request_id)
                           .join(Group, Group.id == Request.group_id)).all()
    assert {(g, k): t for g, k, t in stored} == {(g, k): t for g, ts in TARGETS.items() for k, t in enumerate(ts)}
    w = register(book, max_chunks=16)
    remaining_seen = []
    while not book.is_complete():
        for grant in book.lease(w, wanted=16, now=1001.0):
            remaining_seen.append(grant.target_remaining)
            assert book.report(w, obey_target(grant), now=1001.0).accepted
    assert 40 - 16 in remaining_seen and 40 - 32 in remaining_seen  # the remainder shrinks chunk by chunk
    with book.sessions.begin() as s:
        rows, total = collect_rows(s.connection(), book.rollout_id)
        rows = list(rows)  # read within the transaction
    assert total == 9
    assert {(r["group_index"], r["response_index"]): r["length"] for r in rows} == {
        (g, k): t for g, ts in TARGETS.items() for k, t in enumerate(ts)}
    assert {r["finish_reason"] for r in rows} == {"length_target"}
    # A target equal to max_tokens still ends with "length_target"; the estimate is the observed length.
    assert book.state.groups[book.state.requests[next(iter(book.state.requests))].group_id].estimate == 40


def test_eos_before_the_target_stays_stop(tmp_path):
    book = make_book(tmp_path, chunk_tokens=16, prompt_rows=target_rows())
    w = register(book, max_chunks=16)
    grant = next(g for g in book.lease(w, wanted=16, now=1001.0) if g.target_remaining == 5)
    assert book.report(w, ChunkReport(grant.chunk_id, grant.epoch, [7, 2], [-1.0, -1.0], "stop"), now=1002.0)
    with book.sessions.begin() as s:
        assert s.get(Request, grant.request_id).finish_reason == "stop"


def test_a_plain_length_report_at_the_target_still_ends_the_response(tmp_path):
    book = make_book(tmp_path, chunk_tokens=16, prompt_rows=target_rows())
    w = register(book, max_chunks=16)
    grant = next(g for g in book.lease(w, wanted=16, now=1001.0) if g.target_remaining == 16)
    assert book.report(w, ChunkReport(grant.chunk_id, grant.epoch, [7] * 16, [-1.0] * 16, "length"),
                       now=1002.0).request_finished
    with book.sessions.begin() as s:
        assert s.get(Request, grant.request_id).finish_reason == "length_target"


@pytest.mark.parametrize("tokens,reason,message", [
    (6, "length", "pass the response's target length 5"),
    (4, "length_target", "the target is 5"),
])
def test_reports_that_contradict_the_target_are_refused(tmp_path, tokens, reason, message):
    book = make_book(tmp_path, chunk_tokens=16, prompt_rows=target_rows())
    w = register(book, max_chunks=16)
    grant = next(g for g in book.lease(w, wanted=16, now=1001.0) if g.target_remaining == 5)
    outcome = book.report(w, ChunkReport(grant.chunk_id, grant.epoch, [7] * tokens, [-1.0] * tokens, reason),
                          now=1002.0)
    assert not outcome.accepted and re.search(message, outcome.reason)
    assert grant.chunk_id not in book.state.leases and book.state.is_queued(grant.request_id)  # it runs again


def test_length_target_without_a_target_is_refused(tmp_path):
    book = make_book(tmp_path, chunk_tokens=16, prompt_rows=target_rows(with_targets=False))
    w = register(book)
    grant = book.lease(w, wanted=1, now=1001.0)[0]
    assert grant.target_remaining is None
    outcome = book.report(w, ChunkReport(grant.chunk_id, grant.epoch, [7], [-1.0], "length_target"), now=1002.0)
    assert not outcome.accepted and "without a target length" in outcome.reason


def test_no_scheduler_type_has_a_place_for_targets():
    for cls in (QueuedRequest, Snapshot, WorkerLoad, GroupRecord, RequestRecord, WorkerRecord, LeaseRecord):
        assert not [f.name for f in dataclasses.fields(cls) if "target" in f.name], cls


class RecordingPolicy:
    """Wraps a real policy and keeps a frozen copy of every snapshot it is shown and plan it returns."""

    def __init__(self, name: str) -> None:
        self.inner = make_policy(name)
        self.name = name
        self.seen: list[tuple] = []

    def plan(self, snapshot: Snapshot) -> Plan:
        plan = self.inner.plan(snapshot)
        frozen = dataclasses.replace(snapshot, queued=tuple(snapshot.queued.fcfs()),
                                     group_binding=dict(snapshot.group_binding),
                                     group_indices=dict(snapshot.group_indices))
        self.seen.append((frozen, plan))
        return plan


@pytest.mark.parametrize("policy", ["seer", "divided", "group"])
def test_the_scheduler_sees_the_same_rollout_with_and_without_targets(tmp_path, policy):
    """Two runs in which responses end at the same lengths: by target (length_target) in one, by EOS
    (stop) in the other. Every snapshot the policy sees and every plan it makes are identical."""
    recorded, grants_seen = {}, {}
    for with_targets in (True, False):
        book = make_book(tmp_path / str(with_targets), policy=policy, chunk_tokens=16,
                         prompt_rows=target_rows(with_targets))
        book.policy = RecordingPolicy(policy)
        natural_length = {rid: TARGETS[book.state.groups[r.group_id].index][r.response_index]
                          for rid, r in book.state.requests.items()}
        workers = [register(book, "w0", 0, max_chunks=2), register(book, "w1", 1, max_chunks=3)]
        now, grants = 1001.0, []
        while not book.is_complete():
            for worker in workers:
                for grant in book.lease(worker, wanted=3, now=now):
                    grants.append(grant)
                    if with_targets:
                        report = obey_target(grant)
                    else:  # the model "emits EOS" where the target would have ended it
                        left = natural_length[grant.request_id] - (book.state.requests[grant.request_id].generated)
                        n = min(left, grant.max_tokens)
                        report = ChunkReport(grant.chunk_id, grant.epoch, [7] * n, [-0.5] * n,
                                             "stop" if n == left else "length")
                    book.report(worker, report, now=now + 0.5)
                now += 1.0
        recorded[with_targets] = book.policy.seen
        grants_seen[with_targets] = grants
    assert len(recorded[True]) >= (2 if policy == "group" else 6)  # group hands out all at once
    assert recorded[True] == recorded[False]
    # The only difference is in what the workers were told.
    assert all(g.target_remaining is not None for g in grants_seen[True])
    assert all(g.target_remaining is None for g in grants_seen[False])
    strip = [msgspec.structs.replace(g, target_remaining=None) for g in grants_seen[True]]
    assert strip == grants_seen[False]


def test_worker_cuts_the_budget_at_the_target_and_names_the_reason():
    def grant(max_tokens: int, target_remaining: int | None = None) -> ChunkGrant:
        return ChunkGrant(1, 1, 1, [1, 2], max_tokens, Sampling(), 0.0, target_remaining)

    plain = grant(16)
    assert generation_budget(plain) == 16 and reported_finish_reason(plain, "length", 16) == "length"
    near = grant(16, 5)
    assert generation_budget(near) == 5
    assert reported_finish_reason(near, "length", 5) == "length_target"
    assert reported_finish_reason(near, "stop", 3) == "stop"  # EOS came first
    assert reported_finish_reason(near, "stop", 5) == "stop"  # EOS as the target's last token
    far = grant(16, 40)
    assert generation_budget(far) == 16 and reported_finish_reason(far, "length", 16) == "length"
    exact = grant(16, 16)
    assert reported_finish_reason(exact, "length", 16) == "length_target"
    assert reported_finish_reason(exact, "length", 9) == "length"  # the model's context ran out first


def test_an_export_in_batches_writes_what_one_batch_writes_in_group_order(tmp_path, monkeypatch):
    from seerd.io import export
    from seerd.rundir import RunDir

    book = make_book(tmp_path, chunk_tokens=16, prompt_rows=target_rows(), now=1000.0)
    w = register(book, max_chunks=16)
    while not book.is_complete():
        for grant in book.lease(w, wanted=16, now=1001.0):
            assert book.report(w, obey_target(grant), now=1001.0).accepted
    written = {}
    for batch in (2, 10_000):  # several batches with a short last one, and all in one
        monkeypatch.setattr(export, "EXPORT_GROUPS", batch)
        monkeypatch.setattr(export, "EXPORT_BATCH", batch)
        out = RunDir(tmp_path / f"out{batch}")
        out.path.mkdir()
        with book.sessions.begin() as s:
            result = export.export_run(s, book.rollout_id, out)
        assert result.complete and result.responses == 9
        written[batch] = (out.jsonl_path.read_text(), export.pq.read_table(out.parquet_path).to_pylist())
    assert written[2] == written[10_000]
    order = [(row["group_index"], row["response_index"]) for row in written[2][1]]
    assert order == sorted(order) and len(order) == 9
