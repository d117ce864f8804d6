"""Reports are checked per chunk: the rules, a batch with bad chunks in it (the rest committed, the
bad ones stored nowhere and leased again), the API's answers, and its body size limit."""

from __future__ import annotations

import math

import msgspec
import pytest
from starlette.testclient import TestClient
from sqlalchemy import select

from seerd.book.report_rules import LOGPROB_ROUNDING, report_problem
from seerd.config import EngineConfig
from seerd.db import Chunk, ChunkStatus, Event, Request, RequestStatus
from seerd.protocol import ChunkReport
from seerd.server.app import CoordinatorControl, create_app
from seerd.server.guard import body_limit
from tests.unit.helpers import VOCAB_SIZE, FakeClock, make_book, rows, signed_auth

SECRET = "s3cret-token"


def report(token_ids: list[int], logprobs: list[float], finish_reason: str = "length") -> ChunkReport:
    return ChunkReport(1, 1, token_ids, logprobs, finish_reason)


@pytest.mark.parametrize("token_ids,logprobs,problem", [
    ([5, VOCAB_SIZE, 6], [-1.0] * 3, f"token_ids[1] = {VOCAB_SIZE} is outside the model's vocabulary"),
    ([5, -1], [-1.0] * 2, "token_ids[1] = -1 is outside"),
    ([5, 6], [-1.0, math.inf], "logprobs[1] = inf is not finite"),
    ([5, 6], [-math.inf, -1.0], "logprobs[0] = -inf is not finite"),
    ([5, 6], [math.nan, -1.0], "logprobs[0] = nan is not finite"),
    ([5, 6], [-1.0, -1e39], "logprobs[1] = -inf is not finite (as float32)"),  # finite in float64 only
    ([5, 6], [-1.0, 1e39], "logprobs[1] = inf is not finite"),
    ([5, 6], [0.5, -1.0], "logprobs[0] = 0.5 is positive"),
    ([5, 6], [-1.0, 2 * LOGPROB_ROUNDING], "is positive"),
])
def test_a_report_outside_the_vocabulary_or_with_an_impossible_logprob_has_a_problem(token_ids, logprobs, problem):
    assert problem in report_problem(report(token_ids, logprobs), 16, 0, None, VOCAB_SIZE)


@pytest.mark.parametrize("token_ids,logprobs", [
    ([0, VOCAB_SIZE - 1], [0.0, -30.0]),
    ([5], [LOGPROB_ROUNDING / 10]),  # float32 rounding above 0: kept as reported
    ([5], [-3.4e38]),  # the most negative float32
])
def test_reports_within_the_rules_have_no_problem(token_ids, logprobs):
    assert report_problem(report(token_ids, logprobs), 16, 0, None, VOCAB_SIZE) is None


def test_a_batch_with_bad_chunks_commits_the_rest_and_leases_the_bad_ones_again(tmp_path):
    book = make_book(tmp_path, chunk_tokens=4, prompt_rows=rows(groups=2, n=2, max_tokens=8))
    worker = book.register(rank=0, address="t", max_chunks=8, kv_capacity_tokens=100_000, worker_id="w",
                           now=1000.0).id
    good, out_of_vocabulary, infinite, positive = book.lease(worker, wanted=8, now=1000.0)
    batch = [ChunkReport(good.chunk_id, good.epoch, [7] * 4, [-0.5] * 4, "length"),
             ChunkReport(out_of_vocabulary.chunk_id, out_of_vocabulary.epoch, [7, 7, VOCAB_SIZE + 5, 7], [-0.5] * 4,
                         "length"),
             ChunkReport(infinite.chunk_id, infinite.epoch, [7] * 4, [-0.5, math.inf, -0.5, -0.5], "length"),
             ChunkReport(positive.chunk_id, positive.epoch, [7] * 4, [-0.5, -0.5, -0.5, 0.7], "length")]
    outcomes = book.report_many(worker, batch, now=1001.0)

    assert [o.accepted for o in outcomes] == [True, False, False, False]
    assert [o.rerun for o in outcomes] == [False, True, True, True]
    assert "vocabulary" in outcomes[1].reason and "not finite" in outcomes[2].reason
    assert "positive" in outcomes[3].reason
    assert book.state.output_tokens == 4 and not book.state.leases
    bad = [out_of_vocabulary, infinite, positive]
    with book.sessions.begin() as s:
        chunks = {c.id: c for c in s.scalars(select(Chunk))}
        assert chunks[good.chunk_id].status == ChunkStatus.DONE and chunks[good.chunk_id].num_tokens == 4
        for grant in bad:  # nothing stored for it; its row waits to be leased again
            chunk = chunks[grant.chunk_id]
            assert (chunk.status, chunk.num_tokens, chunk.token_ids, chunk.logprobs, chunk.lease_holder) == (
                ChunkStatus.QUEUED, 0, None, None, None)
            assert s.get(Request, grant.request_id).status == RequestStatus.QUEUED
            assert s.get(Request, grant.request_id).generated_tokens == 0
        rejected = s.execute(select(Event.chunk_id, Event.data_json).where(Event.kind == "report_rejected")).all()
    assert sorted(chunk_id for chunk_id, _ in rejected) == sorted(g.chunk_id for g in bad)
    assert all(msgspec.json.decode(data)["reason"] for _, data in rejected)  # each says why

    again = {g.request_id: g for g in book.lease(worker, wanted=8, now=1002.0)}
    for grant in bad:  # the same chunk, a new lease epoch, from the request's start
        assert (again[grant.request_id].chunk_id, again[grant.request_id].epoch) == (grant.chunk_id, grant.epoch + 1)
        assert again[grant.request_id].prompt_token_ids == grant.prompt_token_ids
    stale = book.report(worker, batch[1], now=1003.0)  # the bad report sent again: its lease is gone
    assert not stale.accepted and not stale.rerun and "stale lease" in stale.reason


@pytest.fixture
def api(tmp_path):
    clock = FakeClock()
    book = make_book(tmp_path, chunk_tokens=4, prompt_rows=rows(groups=1, n=2, max_tokens=8), now=clock())
    app = create_app(CoordinatorControl(book, clock=clock), SECRET, max_body_bytes=4096)
    with TestClient(app) as client:
        client.auth = signed_auth(SECRET)
        worker = client.post("/v1/register", json={"worker_id": "w", "rank": 0, "address": "x", "max_chunks": 2,
                                                   "kv_capacity_tokens": 10_000}).json()["worker_id"]
        client.worker = worker
        client.book = book
        yield client


def test_the_api_answers_per_chunk_even_for_a_report_that_does_not_decode(api):
    good, bad = api.post("/v1/lease", json={"worker_id": api.worker, "wanted": 2}).json()["chunks"]
    # What a worker's msgspec sends for an infinite logprob: JSON has no infinity, so null.
    body = msgspec.json.encode({"worker_id": api.worker, "reports": [
        ChunkReport(good["chunk_id"], good["epoch"], [3] * 4, [-0.1] * 4, "length"),
        ChunkReport(bad["chunk_id"], bad["epoch"], [3] * 4, [-0.1, float("inf"), -0.1, -0.1], "length")]})
    assert b"null" in body
    response = api.post("/v1/report", content=body)
    assert response.status_code == 200
    first, second = response.json()["results"]
    assert first["accepted"] and not second["accepted"]
    assert second["chunk_id"] == bad["chunk_id"] and "logprobs" in second["reason"]
    assert bad["request_id"] in {g["request_id"] for g in api.post(
        "/v1/lease", json={"worker_id": api.worker, "wanted": 2}).json()["chunks"]}
    nameless = api.post("/v1/report", json={"worker_id": api.worker, "reports": [{"token_ids": []}]})
    assert nameless.status_code == 422 and "chunk_id" in nameless.json()["detail"]  # not a batch of reports


def test_a_body_over_the_limit_is_refused_before_it_is_read(api):
    big = {"worker_id": api.worker, "reports": [], "padding": "x" * 5000}
    response = api.post("/v1/report", json=big)
    assert response.status_code == 413 and "limit is 4096" in response.json()["detail"]
    assert api.post("/v1/report", json={"worker_id": api.worker, "reports": []}).status_code == 200
    assert api.post("/v1/report", json=big, auth=None).status_code == 401  # the signature is checked first

    def chunked():  # no Content-Length: the body would have to be read to know its size
        yield b'{"worker_id": "w", '
        yield b'"reports": []}'

    response = api.post("/v1/report", content=chunked())
    assert response.status_code == 411


def test_the_default_body_limit_holds_the_largest_report_twice():
    engine = EngineConfig(max_num_seqs=64)
    limit = body_limit(engine, chunk_tokens=8192)
    worst = ChunkReport(2**31 - 1, 2**31 - 1, [-(2**31)] * 8192, [-1.2345678901234567e-308] * 8192, "length")
    largest = len(msgspec.json.encode({"worker_id": "w" * 100, "reports": [worst] * 64}))
    assert 2 * largest <= limit <= 2 * largest + (2 << 20)
    assert body_limit(EngineConfig(max_num_seqs=64, extra_args={"max_num_seqs": 128}), 8192) > limit


def test_a_worker_retired_while_its_call_waited_gets_the_404_it_acts_on(api, monkeypatch):
    """The API checks the worker, then the book's call (on the state thread) finds it retired."""
    (grant,) = api.post("/v1/lease", json={"worker_id": api.worker, "wanted": 1}).json()["chunks"]
    api.book.retire_workers()
    monkeypatch.setattr(api.book, "known_worker", lambda _worker_id: True)  # checked before the retirement
    response = api.post("/v1/heartbeat", json={"worker_id": api.worker, "running": [grant["chunk_id"]]})
    assert response.status_code == 404 and response.json()["code"] == "unknown_worker"
