"""The coordinator's HTTP API: a signature on every endpoint, and the lease/report round trip."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from starlette.testclient import TestClient

from seerd import protocol
from seerd.server.app import CoordinatorControl, create_app
from seerd.protocol import (
    BadReply, ChunkGrant, ChunkReport, EngineSettings, HeartbeatBody, HeartbeatReply, LeaseBody, RegisterBody,
    RegisterReply, ReportBody, ReportReply, ReportResult,
)
from seerd.settings import EngineConfig
from seerd.worker.client import CoordinatorClient, NotRegistered
from tests.unit.helpers import FakeClock, loopback_socket, make_book, rows, served, signed_auth

SECRET = "s3cret-token"
REGISTER = {"worker_id": "w", "rank": 0, "address": "x", "max_chunks": 1, "kv_capacity_tokens": 100}
ENDPOINTS = [
    ("GET", "/v1/config", None),
    ("GET", "/v1/status", None),
    ("GET", "/metrics", None),
    ("POST", "/v1/register", REGISTER),
    ("POST", "/v1/lease", {"worker_id": "w", "wanted": 1}),
    ("POST", "/v1/report", {"worker_id": "w", "reports": []}),
    ("POST", "/v1/release", {"worker_id": "w", "chunk_id": 1, "epoch": 1}),
    ("POST", "/v1/heartbeat", {"worker_id": "w", "running": []}),
    ("GET", "/v1/does-not-exist", None),
    ("GET", "/docs", None),
]


@pytest.fixture
def client(tmp_path):
    clock = FakeClock()
    book = make_book(tmp_path, prompt_rows=rows(groups=1, n=1, max_tokens=20), now=clock())
    app = create_app(CoordinatorControl(book, clock=clock), SECRET)
    app.state.engine_settings = EngineSettings("m", EngineConfig(), 0)
    with TestClient(app) as test_client:
        test_client.auth = signed_auth(SECRET)
        test_client.clock = clock
        test_client.book = book
        yield test_client


@pytest.mark.parametrize("method,path,body", ENDPOINTS)
@pytest.mark.parametrize("auth", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": SECRET},
                                  {"Authorization": f"Bearer {SECRET}"}, {"Authorization": f"Basic {SECRET}"},
                                  signed_auth("another secret"), signed_auth(SECRET, "127.0.0.1:8000")])
def test_an_unsigned_or_wrongly_signed_call_is_401_everywhere(client, method, path, body, auth):
    """The secret itself opens nothing (it is never sent); a signature with another key, or for
    another address, neither."""
    if isinstance(auth, dict):
        response = client.request(method, path, json=body, headers=auth, auth=None)
    else:
        response = client.request(method, path, json=body, auth=auth)
    assert response.status_code == 401
    assert response.headers["connection"] == "close"
    assert client.book.workers == {}  # nothing happened


def test_round_trip_with_the_token(client):
    reg = client.post("/v1/register", json=REGISTER).json()
    lease = client.post("/v1/lease", json={"worker_id": reg["worker_id"], "wanted": 4}).json()
    (grant,) = lease["chunks"]
    report = {"chunk_id": grant["chunk_id"], "epoch": grant["epoch"], "token_ids": [5] * 16,
              "logprobs": [-0.1] * 16, "finish_reason": "length"}
    body = {"worker_id": reg["worker_id"], "reports": [report, report]}
    results = client.post("/v1/report", json=body).json()["results"]
    assert [(r["accepted"], r["duplicate"]) for r in results] == [(True, False), (True, True)]
    status = client.get("/v1/status").json()
    assert status["output_tokens"] == 16 and status["requests_done"] == 0


def test_metrics_follow_the_book(client):
    """/metrics (Prometheus text) agrees with the book: queue, leases, tokens, per-worker gauges."""
    from prometheus_client.parser import text_string_to_metric_families

    reg = client.post("/v1/register", json=REGISTER).json()
    worker = reg["worker_id"]

    def scrape() -> dict:
        response = client.get("/metrics")
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(response.text) for s in family.samples}

    before = scrape()
    assert before[("seerd_queue_depth", (("kind", "probe"),))] == 1  # one group of one: its probe
    assert before[("seerd_leases_in_flight", ())] == 0
    (grant,) = client.post("/v1/lease", json={"worker_id": worker, "wanted": 1}).json()["chunks"]
    client.post("/v1/heartbeat", json={"worker_id": worker, "running": [grant["chunk_id"]],
                                       "stats": {"tokens_per_s_recent": 42.0, "kv_usage": 0.5}})
    during = scrape()
    assert during[("seerd_leases_in_flight", ())] == 1
    assert during[("seerd_requests", (("state", "running"),))] == 1
    assert during[("seerd_worker_running_chunks", (("worker", worker),))] == 1
    assert during[("seerd_worker_kv_reserved_tokens", (("worker", worker),))] == client.book.state.workers[worker].kv_reserved
    assert during[("seerd_worker_tokens_per_second", (("worker", worker),))] == 42.0
    assert during[("seerd_output_tokens_per_second", ())] == 42.0
    report = {"chunk_id": grant["chunk_id"], "epoch": grant["epoch"], "token_ids": [5] * 3, "logprobs": [-0.1] * 3,
              "finish_reason": "stop"}
    client.post("/v1/report", json={"worker_id": worker, "reports": [report]})
    after = scrape()
    assert after[("seerd_output_tokens_total", ())] == 3
    assert after[("seerd_requests", (("state", "finished"),))] == 1
    assert after[("seerd_tail_requests", ())] == 0  # all done: nothing left in the tail


def test_a_heartbeat_carried_by_a_report_renews_the_workers_leases_before_its_reports(tmp_path):
    # A worker that reports within its heartbeat interval needs no heartbeat call of its own: the
    # report's heartbeat runs first (the chunks it reports are still held: renewed, not aborted).
    clock = FakeClock()
    book = make_book(tmp_path, prompt_rows=rows(groups=1, n=2, max_tokens=20), now=clock())
    control = CoordinatorControl(book, clock=clock)
    with TestClient(create_app(control, SECRET)) as client:
        client.auth = signed_auth(SECRET)
        worker = client.post("/v1/register", json={**REGISTER, "max_chunks": 2}).json()["worker_id"]
        first, second = client.post("/v1/lease", json={"worker_id": worker, "wanted": 2}).json()["chunks"]
        deadline = book.state.leases[second["chunk_id"]].deadline
        clock.advance(10.0)
        report = {"chunk_id": first["chunk_id"], "epoch": first["epoch"], "token_ids": [5] * 3,
                  "logprobs": [-0.1] * 3, "finish_reason": "stop"}
        beat = {"worker_id": worker, "running": [first["chunk_id"], second["chunk_id"], 999],
                "stats": {"tokens_per_s_recent": 7.0}}
        reply = client.post("/v1/report", json={"worker_id": worker, "reports": [report], "heartbeat": beat})
        assert reply.status_code == 200
        answer = reply.json()
        assert answer["heartbeat"]["abort"] == [999] and answer["heartbeat"]["interval_s"] > 0
        assert answer["results"][0]["accepted"]
        assert book.state.leases[second["chunk_id"]].deadline == deadline + 10.0
        assert control.worker_stats[worker] == {"tokens_per_s_recent": 7.0}
        plain = client.post("/v1/report", json={"worker_id": worker, "reports": []}).json()
        assert plain["heartbeat"] is None
        for wrong in ({**beat, "worker_id": "another"}, {**beat, "leaving": True}):
            response = client.post("/v1/report", json={"worker_id": worker, "reports": [], "heartbeat": wrong})
            assert response.status_code == 422


def test_unknown_worker_gets_404_with_its_code_and_a_bad_report_is_rejected_alone(client):
    response = client.post("/v1/lease", json={"worker_id": "ghost", "wanted": 1})
    assert response.status_code == 404 and response.json()["code"] == protocol.UNKNOWN_WORKER
    reg = client.post("/v1/register", json=REGISTER).json()
    (grant,) = client.post("/v1/lease", json={"worker_id": reg["worker_id"], "wanted": 1}).json()["chunks"]
    too_long = {"chunk_id": grant["chunk_id"], "epoch": grant["epoch"], "token_ids": [1] * 999,
                "logprobs": [0.0] * 999, "finish_reason": "length"}
    response = client.post("/v1/report", json={"worker_id": reg["worker_id"], "reports": [too_long]})
    assert response.status_code == 200
    (result,) = response.json()["results"]
    assert not result["accepted"] and "budget" in result["reason"]


def test_long_poll_lease_wakes_when_a_chunk_is_requeued(tmp_path):
    import time as real_time

    clock = FakeClock()
    book = make_book(tmp_path, prompt_rows=rows(groups=1, n=1, max_tokens=40), now=clock())
    app = create_app(CoordinatorControl(book, clock=clock), SECRET)

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://coordinator",
                                     auth=signed_auth(SECRET)) as http:
            ids = []
            for rank in (0, 1):
                body = {**REGISTER, "worker_id": f"w{rank}", "rank": rank}
                ids.append((await http.post("/v1/register", json=body)).json()["worker_id"])
            (grant,) = (await http.post("/v1/lease", json={"worker_id": ids[0], "wanted": 1})).json()["chunks"]
            started = real_time.monotonic()
            waiting = asyncio.create_task(http.post("/v1/lease", json={"worker_id": ids[1], "wanted": 1,
                                                                       "wait_s": 5.0}))
            await asyncio.sleep(0.2)
            assert not waiting.done()  # nothing to lease: it waits instead of answering empty
            report = {"chunk_id": grant["chunk_id"], "epoch": grant["epoch"], "token_ids": [3] * 16,
                      "logprobs": [-0.5] * 16, "finish_reason": "length"}
            await http.post("/v1/report", json={"worker_id": ids[0], "reports": [report]})
            (second,) = (await waiting).json()["chunks"]
            return second, real_time.monotonic() - started

    second, waited = asyncio.run(scenario())
    assert second["prompt_token_ids"][-16:] == [3] * 16 and waited < 2.0


def test_a_long_poll_whose_worker_cannot_take_the_work_waits_on_to_its_deadline(tmp_path):
    # w1's KV cannot hold the request once it has 16 tokens, w0's can: the re-queued chunk is not
    # planned for w1 (`SchedulerState.room_for`), and w1's call waits on instead of answering
    # empty (which made the worker call again at once).
    clock = FakeClock()
    book = make_book(tmp_path, prompt_rows=rows(groups=1, n=1, max_tokens=40, prompt_len=5), now=clock())
    control = CoordinatorControl(book, clock=clock)
    app = create_app(control, SECRET)

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://coordinator",
                                     auth=signed_auth(SECRET)) as http:
            for rank, kv in ((0, 100), (1, 24)):
                await http.post("/v1/register", json={**REGISTER, "worker_id": f"w{rank}", "rank": rank,
                                                      "kv_capacity_tokens": kv})
            (grant,) = (await http.post("/v1/lease", json={"worker_id": "w0", "wanted": 1})).json()["chunks"]
            waiting = asyncio.create_task(http.post("/v1/lease", json={"worker_id": "w1", "wanted": 1,
                                                                       "wait_s": 1.0}))
            while not control.waiting_lease_calls:  # parked: the queue is empty
                await asyncio.sleep(0.01)
            report = {"chunk_id": grant["chunk_id"], "epoch": grant["epoch"], "token_ids": [3] * 16,
                      "logprobs": [-0.5] * 16, "finish_reason": "length"}
            await http.post("/v1/report", json={"worker_id": "w0", "reports": [report]})
            answer = (await waiting).json()
            (again,) = (await http.post("/v1/lease", json={"worker_id": "w0", "wanted": 1})).json()["chunks"]
            return answer, again

    answer, again = asyncio.run(scenario())
    assert answer["chunks"] == [] and answer["waited_s"] >= 0.95  # its deadline
    # The coordinator's own time for it leaves the wait out (seerd/server/latency.py).
    figures = control.latencies.figures()
    assert figures["/v1/lease"]["max_ms"] < 900 and figures["/v1/lease"]["calls"] == 3
    assert again["prompt_token_ids"][-16:] == [3] * 16  # left to w0, which holds room for it


def test_the_worker_client_gets_typed_replies(tmp_path):
    clock = FakeClock()
    book = make_book(tmp_path, prompt_rows=rows(groups=1, n=1, max_tokens=20), now=clock())
    sock, address = loopback_socket()
    app = create_app(CoordinatorControl(book, clock=clock), SECRET, address=address)
    app.state.engine_settings = EngineSettings("m", EngineConfig(max_num_seqs=2), 0)

    async def scenario() -> None:
        async with served(app, sock) as url:
            await calls(CoordinatorClient(url, SECRET, patience_s=1.0))

    async def calls(client: CoordinatorClient) -> None:
        settings = await client.call(protocol.CONFIG)
        assert settings == EngineSettings("m", EngineConfig(max_num_seqs=2), 0)
        reg = await client.call(protocol.REGISTER, RegisterBody("w", 0, "x", max_chunks=1, kv_capacity_tokens=100))
        assert isinstance(reg, RegisterReply) and reg.lease_ttl_s == book.lease_ttl_s
        lease = await client.call(protocol.LEASE, LeaseBody(reg.worker_id, 4))
        (grant,) = lease.chunks
        assert isinstance(grant, ChunkGrant) and not lease.done and grant.request_id in book.state.requests
        heartbeat = await client.call(protocol.HEARTBEAT, HeartbeatBody(reg.worker_id, [grant.chunk_id]))
        assert heartbeat == HeartbeatReply([], done=False, interval_s=protocol.heartbeat_interval(book.lease_ttl_s, 1))
        report = ChunkReport(grant.chunk_id, grant.epoch, [5] * 3, [-0.1] * 3, "stop")
        reply = await client.call(protocol.REPORT, ReportBody(reg.worker_id, [report]))
        assert reply == ReportReply([ReportResult(grant.chunk_id, True, False, "")], done=True)
        assert (await client.call(protocol.LEASE, LeaseBody(reg.worker_id, 1))).done
        with pytest.raises(NotRegistered, match="unknown worker ghost"):
            await client.call(protocol.LEASE, LeaseBody("ghost", 1))
        await client.close()

    asyncio.run(scenario())


def test_the_worker_client_says_when_a_reply_is_not_its_type():
    from seerd.server.auth import SignedCalls

    async def not_a_lease_reply(scope, receive, send) -> None:  # noqa: ANN001
        body = b'{"chunks": [{"chunk_id": 1}], "done": false}'
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    sock, address = loopback_socket()  # signed as the coordinator signs: believed, then decoded
    app = SignedCalls(not_a_lease_reply, SECRET, CoordinatorControl(), address=address)

    async def scenario() -> None:
        async with served(app, sock) as url:
            client = CoordinatorClient(url, SECRET)
            with pytest.raises(BadReply, match="POST /v1/lease: the reply is not a LeaseReply"):
                await client.call(protocol.LEASE, LeaseBody("w", 1))
            await client.close()

    asyncio.run(scenario())


def drafts_app(tmp_path, address: str = ""):  # noqa: ANN201
    """An API with a grouped draft server over a book of 2 groups x 2: (app, book, draft host)."""
    from seerd.drafts.host import DraftHost

    clock = FakeClock()
    book = make_book(tmp_path, prompt_rows=rows(groups=2, n=2, max_tokens=20), now=clock())
    host = DraftHost()
    app = create_app(CoordinatorControl(book, clock=clock), SECRET, drafts=host, address=address)
    host.register(list(book.state.groups))
    return app, book, host


@pytest.fixture
def drafts_client(tmp_path):
    app, book, host = drafts_app(tmp_path)
    with TestClient(app) as test_client:
        test_client.auth = signed_auth(SECRET)
        test_client.book = book
        yield test_client
    host.close()


@pytest.mark.parametrize("path,body", [("/v1/drafts/append", {"items": []}), ("/v1/drafts/fetch", {"cursors": {}}),
                                       ("/v1/drafts/stats", None)])
def test_draft_server_endpoints_need_the_token(drafts_client, path, body):
    method = "GET" if body is None else "POST"
    assert drafts_client.request(method, path, json=body, auth=None).status_code == 401
    assert drafts_client.request(method, path, json=body, auth=signed_auth("no")).status_code == 401


def test_draft_server_append_and_fetch_over_http(drafts_client):
    group = min(drafts_client.book.state.groups)
    items = [{"group": group, "request": 7, "prev_count": 0, "tokens": [1, 2, 3]},
             {"group": group, "request": 7, "prev_count": 0, "tokens": [1, 2, 3]},  # a retry: no-op
             {"group": 999, "request": 1, "prev_count": 0, "tokens": [4]}]
    results = drafts_client.post("/v1/drafts/append", json={"items": items}).json()["results"]
    assert [r["ok"] for r in results] == [True, True, False]
    assert results[1]["count"] == 3 and "999" in results[2]["error"]
    fetched = drafts_client.post("/v1/drafts/fetch", json={"cursors": {str(group): {"7": [results[0]["gen"], 1]},
                                                                      "999": {}}}).json()
    assert fetched["changes"] == {str(group): {"7": [results[0]["gen"], 1, [2, 3]]}}
    assert fetched["unknown"] == [999]
    bad = drafts_client.post("/v1/drafts/append", json={"items": [{"group": "x"}]})
    assert bad.status_code == 422
    bad = drafts_client.post("/v1/drafts/fetch", json={"cursors": {"g": {"1": [0, 0]}}})
    assert bad.status_code == 422
    bad = drafts_client.post("/v1/drafts/fetch", json={"cursors": {str(group): {"7": [-1, 0]}}})
    assert bad.status_code == 422 and "ints >= 0" in bad.json()["detail"]


def test_draft_endpoints_say_when_the_run_has_no_draft_server(client):
    response = client.post("/v1/drafts/fetch", json={"cursors": {}})
    assert response.status_code == 404 and "--spec" in response.json()["detail"]


def test_registration_carries_the_engines_kv_block_and_refuses_an_impossible_one(client):
    bad = client.post("/v1/register", json={**REGISTER, "kv_block_tokens": 101})  # > capacity 100
    assert bad.status_code == 422 and "kv_block_tokens" in bad.json()["detail"]
    reg = client.post("/v1/register", json={**REGISTER, "kv_block_tokens": 16}).json()
    assert client.book.state.workers[reg["worker_id"]].kv_block_tokens == 16
    (grant,) = client.post("/v1/lease", json={"worker_id": reg["worker_id"], "wanted": 1}).json()["chunks"]
    # The chunk reserves its context + budget rounded up to whole blocks of 16.
    assert client.book.state.workers[reg["worker_id"]].kv_reserved % 16 == 0


def test_the_draft_sync_threads_transport_appends_and_fetches_over_a_real_socket(tmp_path):
    from seerd.drafts.client import DraftTransportError, HttpTransport
    from seerd.protocol import DraftAppendItem

    sock, address = loopback_socket()
    app, book, host = drafts_app(tmp_path, address)
    group = min(book.state.groups)

    def sync_thread_calls(url: str) -> tuple:  # blocking, as on the worker's draft sync thread
        transport = HttpTransport(url, SECRET)
        appended = transport.append([DraftAppendItem(group, 7, 0, [1, 2, 3])])
        fetched = transport.fetch({group: {7: (appended[0].gen, 1)}})
        stranger = HttpTransport(url, "not the secret")
        with pytest.raises(DraftTransportError, match="401 without the run's coordinator's signature"):
            stranger.append([DraftAppendItem(group, 7, 3, [4])])
        for t in (transport, stranger):
            t.close()
        return appended, fetched

    async def scenario() -> tuple:
        async with served(app, sock) as url:
            return await asyncio.to_thread(sync_thread_calls, url)

    appended, fetched = asyncio.run(scenario())
    host.close()
    assert appended[0].ok and appended[0].count == 3
    assert fetched.changes == {group: {7: (appended[0].gen, 1, [2, 3])}}


def test_a_long_state_thread_turn_hands_over_the_answers_it_has_before_it_ends():
    # The second call of the turn only ends once the first call's answer has reached the loop: a
    # turn that answered every call at its end would never let it (the wait times out and fails).
    from seerd.server.control import ANSWERS_EVERY_S

    async def scenario() -> list[str]:
        control = CoordinatorControl()
        started, release, first_answered = threading.Event(), threading.Event(), threading.Event()

        def hold() -> str:  # keeps the state thread busy until both calls are queued behind it
            started.set()
            release.wait(10.0)
            return "hold"

        def first() -> str:
            time.sleep(2 * ANSWERS_EVERY_S)  # longer than a turn runs before it hands answers over
            return "first"

        def second() -> str:
            return "second" if first_answered.wait(10.0) else "the first answer waited for the turn's end"

        holding = asyncio.ensure_future(control.run(hold))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 10.0)
        calls = [asyncio.ensure_future(control.run(fn)) for fn in (first, second)]
        await asyncio.sleep(0)  # both queued for the next turn
        release.set()
        answers = [await holding, await calls[0]]
        first_answered.set()
        answers.append(await calls[1])
        control.close()
        return answers

    assert asyncio.run(scenario()) == ["hold", "first", "second"]
