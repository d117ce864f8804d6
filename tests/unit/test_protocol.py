"""The wire protocol: every message type survives msgspec JSON, grants and reports keep their wire
names, every API route is a protocol endpoint, replies that do not decode say so, engine request
ids round-trip, and the module stays light."""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import pytest

from seerd import protocol
from seerd.protocol import (
    BATCHES, BadReply, BatchBody, BatchState, ChunkGrant, ChunkIdentity, ChunkReport, DraftAppendBody, DraftAppendItem, DraftAppendReply,
    DraftAppendResult, DraftChanges, DraftFetchBody, DraftStats, EngineSettings, Endpoint, ErrorReply, HeartbeatBody,
    GroupsReply, HeartbeatReply, LeaseBody, LeaseReply, RegisterBody, RegisterReply, ReleaseBody, ReleaseReply, ReportBody,
    ReportReply, ReportResult, StatusReply, StatusSnapshot, decode_reply, parse_engine_id,
)
from seerd.settings import EngineConfig, PoolSettings, Sampling, SpecConfig

GRANT = ChunkGrant(11, 2, 5, [1, 2, 3, 9], 16, Sampling(temperature=1.0, seed=7), 1030.5, 4,
                   group_id=3, prompt_len=3, is_probe=True)
REPORT = ChunkReport(11, 2, [9, 8], [-0.5, -1.25], "length", cached_tokens=3)

# One message of every type, with no field left at its default where it has one.
MESSAGES = [
    RegisterBody("w0-host-1", 0, "host:1", 4, 1000, 16, "/ckpt/step-3@0123456789abcdef", 0.04),
    RegisterReply("w0-host-1", 30.0, 2.0),
    EngineSettings("model/", EngineConfig(max_num_seqs=4), 0, SpecConfig(mode="grouped"), PoolSettings(mode="mooncake"),
                   "model/@0123456789abcdef", True, 3),
    BatchBody("/data/prompts.jsonl", "k1", "/ckpt/step-3", 8, 256, 1.0, 0.9, 50, 7),
    BatchState(3, "running", "/ckpt/step-3@0123456789abcdef", 4, 1, 32, 9, "why", "/run/batches/3/rollouts.jsonl"),
    GroupsReply([{"group_index": 0, "prompt_id": "p0", "rows": [{"token_ids": [1, 2]}]}], 41, "running", 4),
    LeaseBody("w0", 3, 1.0),
    GRANT,
    LeaseReply([GRANT, ChunkGrant(12, 1, 6, [1], 8, Sampling(), 1031.0)], done=False, retry_after_s=0.05),
    REPORT,
    ReportBody("w0", [REPORT, ChunkReport(12, 1, [], [], "stop")]),
    ReportResult(11, True, False, ""),
    ReportReply([ReportResult(11, False, False, "lease expired")], done=True),
    ReleaseBody("w0", 11, 2, "engine failed"),
    ReleaseReply(True),
    HeartbeatBody("w0", [11, 12], {"kv_usage": 0.5, "running": {"11": {"tokens": 3}}}),
    HeartbeatReply([12], done=False),
    StatusReply(1, "seer", 8, 2, 2, 0, 3, 99, 2, False, True, 0.25, 40, {"bytes_used": 10}),
    StatusSnapshot({"schema": 1, "state": "running", "eta_s": None, "tail": [{"request_id": 3}]}),
    ErrorReply("unknown worker w9; register again", protocol.UNKNOWN_WORKER),
    DraftAppendItem(3, 5, 2, [7, 8]),
    DraftAppendBody([DraftAppendItem(3, 5, 2, [7, 8])]),
    DraftAppendResult(True, 4, 17, 2, 1, True, [9], ""),
    DraftAppendReply([DraftAppendResult(False, error="group 9 is not registered")]),
    DraftFetchBody({3: {5: (17, 2), 6: (18, 0)}}),
    DraftChanges({3: {5: (17, 2, [7, 8])}}, {3: [6]}, [9]),
    DraftStats(1, 2, 30, 4096, 136533, 5, 30, 1, 0, {"finished": 1, "expired": 0, "memory": 0}),
]


def endpoints() -> list[Endpoint]:
    return [value for value in vars(protocol).values() if isinstance(value, Endpoint)]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_through_json(message):
    wire = msgspec.json.encode(message)
    assert msgspec.json.decode(wire, type=type(message)) == message
    assert json.loads(wire)  # plain JSON: what any HTTP client sees


def test_every_endpoint_type_has_a_message_above():
    covered = {type(m) for m in MESSAGES}
    for endpoint in endpoints():
        assert endpoint.reply in covered, endpoint
        assert endpoint.body is None or endpoint.body in covered, endpoint


def test_grant_and_report_keep_their_wire_names():
    grant = json.loads(msgspec.json.encode(GRANT))
    assert list(grant) == ["chunk_id", "epoch", "request_id", "prompt_token_ids", "max_tokens", "sampling",
                           "deadline", "target_remaining", "group_id", "prompt_len", "is_probe", "run_on",
                           "response_remaining", "continues", "batch"]
    assert grant["prompt_token_ids"] == [1, 2, 3, 9] and grant["target_remaining"] == 4
    report = json.loads(msgspec.json.encode(REPORT))
    assert report == {"chunk_id": 11, "epoch": 2, "token_ids": [9, 8], "logprobs": [-0.5, -1.25],
                      "finish_reason": "length", "cached_tokens": 3, "running_on": False}
    # A report without the optional field decodes (what an older worker sent), grants as the book builds them.
    bare = msgspec.json.decode(b'{"chunk_id":1,"epoch":1,"token_ids":[],"logprobs":[],"finish_reason":"stop"}',
                               type=ChunkReport)
    assert bare.cached_tokens is None and not bare.running_on
    assert ChunkGrant(1, 1, 2, [5], 8, Sampling(), 0.0).target_remaining is None


def test_draft_ids_are_json_object_keys_on_the_wire():
    wire = json.loads(msgspec.json.encode(DraftChanges({3: {5: (17, 2, [7, 8])}}, {3: [6]}, [9])))
    assert wire == {"changes": {"3": {"5": [17, 2, [7, 8]]}}, "dropped": {"3": [6]}, "unknown": [9]}
    assert json.loads(msgspec.json.encode(DraftFetchBody({3: {5: (17, 2)}}))) == {"cursors": {"3": {"5": [17, 2]}}}


def test_every_api_route_is_a_protocol_endpoint(tmp_path):
    from seerd.server.app import CoordinatorControl, create_app
    from tests.unit.helpers import make_book, rows

    from seerd.serve.server import Server

    app = create_app(CoordinatorControl(make_book(tmp_path, prompt_rows=rows(groups=1, n=1))), "s")
    routes = {(method, route.path) for route in app.routes for method in route.methods - {"HEAD"}}
    # `seerd serve`'s own routes (batches) sit beside a batch's API, behind the same signature check.
    serve_routes = {(method, route.path) for route in Server.batch_routes(None).routes
                    for method in route.methods - {"HEAD"}}
    assert routes - {("GET", "/metrics")} == {(e.method, e.path) for e in endpoints()} - {("POST", BATCHES.path)}
    assert serve_routes == {("POST", BATCHES.path), ("GET", BATCHES.path + "/{batch:int}"),
                            ("GET", BATCHES.path + "/{batch:int}/groups")}


def test_each_report_of_a_batch_decodes_on_its_own():
    wire = msgspec.json.encode({"worker_id": "w0", "reports": [
        REPORT, ChunkReport(12, 1, [5], [float("inf")], "length"), {"chunk_id": 13, "epoch": 2, "token_ids": "x"}]})
    batch = msgspec.json.decode(wire, type=protocol.ReportBatch)
    good, infinite, wrong = (protocol.decode_report(raw) for raw in batch.reports)
    assert good == REPORT
    assert (infinite.chunk_id, infinite.epoch) == (12, 1) and "got `null`" in infinite.problem
    assert (wrong.chunk_id, wrong.epoch) == (13, 2) and "token_ids" in wrong.problem
    with pytest.raises(msgspec.ValidationError):  # not even its lease: the body is not a batch of reports
        protocol.decode_report(msgspec.Raw(b'{"epoch": 1}'))


@pytest.mark.parametrize("content", [
    b'{"chunks": [], "retry_after_s": 0.1}',  # a field missing
    b'{"chunks": [{"chunk_id": "one"}], "done": false}',  # a wrong type
    b'<html>busy</html>',  # not JSON
])
def test_a_reply_that_does_not_decode_is_a_bad_reply(content):
    with pytest.raises(BadReply, match="/v1/lease.*LeaseReply"):
        decode_reply(protocol.LEASE, content)


def test_engine_ids_round_trip():
    identity = ChunkIdentity(12, 3, 7, 99, 31, True)
    assert identity.engine_id == "c12e3g7r99p31h"
    assert parse_engine_id(identity.engine_id) == identity
    assert parse_engine_id("c12e3g7r99p31").is_probe is False
    assert parse_engine_id("c12e3g7r99p31h-94554842") == identity  # vLLM's internal suffix
    assert identity.lease_key == "c12e3"
    for foreign in ("0_c12e3g7r99p31", "c1e2", "cmpl-abc", ""):
        assert parse_engine_id(foreign) is None
    assert GRANT.identity == ChunkIdentity(11, 2, 3, 5, 3, True)
    # The rollout (a serve's batch) a chunk belongs to: the KV pool scopes its keys by it.
    in_batch = ChunkIdentity(12, 3, 7, 99, 31, True, batch=4)
    assert in_batch.engine_id == "c12e3b4g7r99p31h"
    assert parse_engine_id(in_batch.engine_id + "-94554842") == in_batch
    assert parse_engine_id("c12e3b4g7r99p31").lease_key == "c12e3"


def test_the_protocol_imports_nothing_else_of_seerd_but_its_settings_and_nothing_heavy():
    code = ("import sys, seerd.protocol; print(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('seerd', 'fastapi', 'starlette', 'httpx', 'sqlalchemy', 'numpy', 'torch', 'vllm')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "['seerd', 'seerd.protocol', 'seerd.settings']"


def test_the_heartbeat_interval_grows_with_the_workers_past_the_budget_and_stays_within_a_quarter_ttl():
    from seerd.protocol import HEARTBEATS_PER_S, heartbeat_interval

    assert heartbeat_interval(30.0, 1) == 2.0  # status stays current while heartbeats are few
    assert heartbeat_interval(30.0, int(2 * HEARTBEATS_PER_S)) == 2.0
    at_384 = heartbeat_interval(30.0, 384)
    assert at_384 == 384 / HEARTBEATS_PER_S and 384 / at_384 <= HEARTBEATS_PER_S
    assert heartbeat_interval(30.0, 100_000) == 7.5  # four heartbeats per lease TTL, whatever the count
    assert heartbeat_interval(4.0, 512) == 1.0
    assert heartbeat_interval(0.4, 1) == 0.2
    intervals = [heartbeat_interval(30.0, w) for w in range(1, 2000, 7)]
    assert intervals == sorted(intervals)
