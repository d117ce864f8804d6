"""Signed calls (seerd/signing.py, server/auth.py): what a signature binds, replays and
tampering refused with 401, answers a client can tell from a stranger's, clocks that disagree,
and Prometheus's read-only token."""

from __future__ import annotations

import hashlib
import hmac
import time

import pytest
from starlette.testclient import TestClient

from seerd.protocol import EngineSettings
from seerd.server.app import CoordinatorControl, create_app
from seerd.server.auth import SeenNonces
from seerd.settings import EngineConfig
from seerd.signing import (
    REPLY_HEADER, STALE_TIMESTAMP, Mac, Signer, block_key, call_key, parse_authorization, reply_mac,
)
from tests.unit.helpers import FakeClock, make_book, rows, signed_auth

SECRET = "s3cret-token"
METRICS_TOKEN = "metrics-only"
HEARTBEAT = {"worker_id": "ghost", "running": []}  # a 404 once signed: what the signature does is the point


@pytest.mark.parametrize("key", [b"k" * 32, b"", b"x" * 64, b"long" * 40])
def test_the_mac_is_hmac_sha256(key):
    for message in (b"", b"a", b"m" * 1000):
        assert Mac(key).hex(message) == hmac.new(key, message, hashlib.sha256).hexdigest()


def test_keys_differ_by_secret_address_and_purpose():
    keys = {call_key("a", "h:1"), call_key("b", "h:1"), call_key("a", "h:2"), block_key("a"), block_key("b")}
    assert len(keys) == 5 and all(len(key) == 32 for key in keys)


def test_a_reply_verifies_only_for_its_own_call_status_body_and_key():
    signer = Signer(call_key(SECRET, "h:1"))
    _, nonce = signer.sign("POST", "/v1/lease", b"{}")
    timestamp = "1700000000.000"
    mac = reply_mac(Mac(call_key(SECRET, "h:1")), nonce, 200, timestamp, hashlib.sha256(b"ok").hexdigest())
    signature = f"{timestamp} {mac}"
    assert signer.verify_reply(nonce, 200, signature, b"ok")
    assert not signer.verify_reply("another nonce", 200, signature, b"ok")
    assert not signer.verify_reply(nonce, 201, signature, b"ok")
    assert not signer.verify_reply(nonce, 200, signature, b"ok!")
    assert not signer.verify_reply(nonce, 200, None, b"ok")
    assert not Signer(call_key(SECRET, "h:2")).verify_reply(nonce, 200, signature, b"ok")


def test_a_verified_reply_sets_the_clients_clock_to_the_coordinators():
    signer = Signer(call_key(SECRET, ""), clock=lambda: 1000.0)
    _, nonce = signer.sign("GET", "/v1/status", None)
    timestamp = "4600.000"  # an hour ahead
    mac = reply_mac(signer.mac, nonce, 200, timestamp, hashlib.sha256(b"").hexdigest())
    assert signer.verify_reply(nonce, 200, f"{timestamp} {mac}", b"")
    header, _ = signer.sign("GET", "/v1/status", None)
    assert parse_authorization(header).timestamp == "4600.000"


@pytest.mark.parametrize("header", ["", "Bearer x", "Seerd-HMAC-SHA256 1 2 3",
                                    "Seerd-HMAC-SHA256 1 n " + "a" * 64 + " b",
                                    "Other 1 nonce1234 " + "a" * 64 + " " + "b" * 64])
def test_what_is_not_a_signature_does_not_parse(header):
    assert parse_authorization(header) is None


def test_seen_nonces_refuse_a_replay_and_forget_what_left_the_window():
    seen = SeenNonces()
    assert seen.add("n1", expires=130.0, now=100.0)
    assert not seen.add("n1", expires=130.0, now=101.0)
    assert seen.add("n2", expires=140.0, now=110.0)
    assert seen.add("n3", expires=170.0, now=131.0) and len(seen) == 2  # n1's time is past: forgotten
    assert not seen.add("n2", expires=140.0, now=131.0)


@pytest.fixture
def api(tmp_path):
    clock = FakeClock()
    book = make_book(tmp_path, prompt_rows=rows(groups=1, n=1, max_tokens=20), now=clock())
    control = CoordinatorControl(book, clock=clock)
    app = create_app(control, SECRET, metrics_token=METRICS_TOKEN)
    app.state.engine_settings = EngineSettings("m", EngineConfig(), 0)
    with TestClient(app) as client:
        client.control = control
        yield client


def signed_headers(method: str, path: str, body: bytes = b"", clock=time.time):  # noqa: ANN001, ANN201
    signer = Signer(call_key(SECRET, ""), clock=clock)
    header, _ = signer.sign(method, path, body)
    return {"Authorization": header, "Content-Type": "application/json"}


def test_a_signed_call_is_served_and_its_answer_signed(api):
    reply = api.get("/v1/config", auth=signed_auth(SECRET))
    assert reply.status_code == 200 and reply.extensions["seerd_verified"]
    assert REPLY_HEADER in reply.headers


def test_a_replayed_call_is_refused(api):
    body = b'{"worker_id": "ghost", "running": []}'
    headers = signed_headers("POST", "/v1/heartbeat", body)
    assert api.post("/v1/heartbeat", content=body, headers=headers).status_code == 404  # signed: got through
    replayed = api.post("/v1/heartbeat", content=body, headers=headers)
    assert replayed.status_code == 401 and "replay" in replayed.json()["detail"]
    assert api.control.refused == {"replayed": 1}


@pytest.mark.parametrize("tamper", ["body", "path", "method", "timestamp", "nonce"])
def test_a_tampered_call_is_refused(api, tamper):
    body = b'{"worker_id": "ghost", "running": []}'
    headers = signed_headers("POST", "/v1/heartbeat", body)
    scheme, timestamp, nonce, digest, mac = headers["Authorization"].split(" ")
    method, path = "POST", "/v1/heartbeat"
    if tamper == "body":
        body = b'{"worker_id": "other", "running": []}'
    elif tamper == "path":
        path = "/v1/lease"
    elif tamper == "method":
        method = "PUT"
    elif tamper == "timestamp":
        timestamp = f"{float(timestamp) - 1:.3f}"
    else:
        nonce = nonce[::-1]
    headers["Authorization"] = " ".join([scheme, timestamp, nonce, digest, mac])
    response = api.request(method, path, content=body, headers=headers)
    assert response.status_code == 401
    if tamper == "body":  # the header checked out; the body read does not match its digest
        assert "body" in response.json()["detail"] and api.control.refused == {"body_mismatch": 1}
    else:
        assert api.control.refused == {"bad_signature": 1}


def test_a_call_from_a_clock_an_hour_off_is_refused_then_signed_again_with_the_coordinators_time(api):
    def an_hour_late() -> float:
        return time.time() - 3600

    refused = api.get("/v1/config", headers=signed_headers("GET", "/v1/config", clock=an_hour_late))
    assert refused.status_code == 401 and refused.json()["code"] == STALE_TIMESTAMP
    assert REPLY_HEADER in refused.headers  # signed: the client may believe the time in it
    late = Signer(call_key(SECRET, ""), clock=an_hour_late)
    answered = api.get("/v1/config", auth=signed_auth(SECRET, signer=late))
    assert answered.status_code == 200 and answered.extensions["seerd_verified"]
    assert abs(late.offset_s - 3600) < 60


def test_refused_calls_are_counted_on_metrics(api):
    from prometheus_client.parser import text_string_to_metric_families

    for _ in range(2):
        api.get("/v1/status", auth=None)
    api.get("/v1/status", auth=signed_auth("a stranger's secret"))
    scraped = api.get("/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}).text
    refused = {s.labels["reason"]: s.value for family in text_string_to_metric_families(scraped)
               for s in family.samples if s.name == "seerd_api_refused_total"}
    assert refused == {"unsigned": 2, "bad_signature": 1}


def test_prometheus_token_opens_metrics_and_nothing_else(api):
    bearer = {"Authorization": f"Bearer {METRICS_TOKEN}"}
    assert api.get("/metrics", headers=bearer).status_code == 200
    for method, path in (("GET", "/v1/status"), ("GET", "/v1/config"), ("POST", "/metrics")):
        assert api.request(method, path, headers=bearer).status_code == 401, (method, path)
    assert api.get("/metrics", headers={"Authorization": f"Bearer {SECRET}"}).status_code == 401
    assert api.get("/metrics", auth=signed_auth(SECRET)).status_code == 200  # a signed scrape, too
