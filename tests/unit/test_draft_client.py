"""The worker side of grouped drafting: DraftClient against a real DraftServer (through the same JSON
the HTTP API carries, in-process), and SeerdDrafter called the way vLLM's model runner calls it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest

from seerd.drafts.client import DraftClient
from seerd.drafts.host import append_items
from seerd.drafts.server import DraftServer
from seerd.protocol import (
    DRAFTS_APPEND, DRAFTS_FETCH, DraftAppendBody, DraftAppendItem, DraftAppendReply, DraftAppendResult, DraftChanges,
    DraftFetchBody,
)

GROUP = 5
MOTIF = [11, 12, 13, 14, 15, 16, 17, 18]


class InProcessTransport:
    """The coordinator's two draft endpoints without the network (bodies and replies go through
    msgspec JSON with the protocol's types, as over HTTP)."""

    def __init__(self, server: DraftServer) -> None:
        self.server = server
        self.down = False

    def append(self, items: list[DraftAppendItem]) -> list[DraftAppendResult]:
        if self.down:
            raise ConnectionError("coordinator unreachable")
        body = over_the_wire(DraftAppendBody(items), DRAFTS_APPEND.body)
        return over_the_wire(DraftAppendReply(append_items(self.server, body.items)), DRAFTS_APPEND.reply).results

    def fetch(self, cursors: dict) -> DraftChanges:
        if self.down:
            raise ConnectionError("coordinator unreachable")
        body = over_the_wire(DraftFetchBody(cursors), DRAFTS_FETCH.body)
        return over_the_wire(self.server.fetch(body.cursors), DRAFTS_FETCH.reply)


def over_the_wire(message, type_):  # noqa: ANN001, ANN201
    return msgspec.json.decode(msgspec.json.encode(message), type=type_)


@pytest.fixture
def server() -> DraftServer:
    server = DraftServer()
    server.register(GROUP, 600)
    return server


def held(server: DraftServer, group: int, request: int) -> list[int]:
    from seerd.drafts.server import UnknownRequest

    try:
        return server.tokens(group, request)
    except UnknownRequest:
        return []


def client() -> DraftClient:
    return DraftClient(None, push_batch=4)  # no background thread: the test calls sync_once


def test_a_sibling_on_another_worker_is_drafted_from(server):
    transport = InProcessTransport(server)
    worker_a, worker_b = client(), client()
    worker_a.track(GROUP, 1, prompt=[1, 2, 3], response=[])
    worker_a.extend_own(GROUP, 1, MOTIF * 2)
    worker_a.sync_once(transport)
    assert held(server, GROUP, 1) == MOTIF * 2
    index_b = worker_b.track(GROUP, 2, prompt=[1, 2, 3], response=[11, 12, 13])
    assert index_b.propose([11, 12, 13], 4).tokens == []  # B knows nothing of A yet... (own tokens only)
    worker_b.sync_once(transport)
    assert index_b.propose([11, 12, 13], 4).tokens == [14, 15, 16, 17]


def test_tokens_are_pushed_in_batches_and_the_rest_when_the_chunk_ends(server):
    transport = InProcessTransport(server)
    worker = client()
    worker.track(GROUP, 1, prompt=[1], response=[7, 7])
    worker.extend_own(GROUP, 1, [1, 2, 3])
    worker.sync_once(transport)
    assert held(server, GROUP, 1) == []  # 3 < push_batch: nothing sent yet
    worker.extend_own(GROUP, 1, [4, 5])
    worker.sync_once(transport)
    assert held(server, GROUP, 1) == []  # the first 2 tokens came from an earlier chunk: gap
    server.append(GROUP, 1, 0, [7, 7])  # ... which the coordinator appends when it commits
    assert held(server, GROUP, 1) == [7, 7, 1, 2, 3, 4, 5]
    worker.extend_own(GROUP, 1, [6])
    worker.untrack(GROUP, 1)
    worker.sync_once(transport)
    assert held(server, GROUP, 1) == [7, 7, 1, 2, 3, 4, 5, 6]
    worker.sync_once(transport)  # the finished chunk's cursor follows the server: nothing twice
    assert worker.groups[GROUP].index.length(1) == 8


def test_a_rewritten_sibling_replaces_the_local_copy(server):
    transport = InProcessTransport(server)
    worker = client()
    worker.track(GROUP, 2, prompt=[1], response=[])
    server.append(GROUP, 1, 0, MOTIF)
    worker.sync_once(transport)
    assert worker.groups[GROUP].index.length(1) == len(MOTIF)
    server.append(GROUP, 1, 4, [99, 98])  # the chunk ran again elsewhere and sampled otherwise
    worker.sync_once(transport)
    index = worker.groups[GROUP].index
    assert index.length(1) == 6
    assert index.propose([12, 13, 14], 2).tokens == [99, 98]


def test_drafting_goes_on_when_the_coordinator_is_unreachable(server):
    transport = InProcessTransport(server)
    transport.down = True
    worker = DraftClient(lambda: transport, sync_interval_s=0.01, push_batch=1)
    try:
        index = worker.track(GROUP, 1, prompt=[1, 2, 3], response=[])
        worker.extend_own(GROUP, 1, MOTIF + [11, 12, 13])
        assert index.propose(MOTIF + [11, 12, 13], 3).tokens == [14, 15, 16]
        import time

        deadline = time.monotonic() + 5
        while worker.sync_errors == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.sync_errors > 0
        transport.down = False
        while held(server, GROUP, 1) != MOTIF + [11, 12, 13] and time.monotonic() < deadline + 5:
            time.sleep(0.01)
        assert held(server, GROUP, 1) == MOTIF + [11, 12, 13]  # pushed once the server came back
    finally:
        worker.close()


def test_finished_groups_are_dropped_locally(server):
    transport = InProcessTransport(server)
    worker = client()
    worker.track(GROUP, 1, prompt=[1], response=[2])
    worker.untrack(GROUP, 1)
    server.finish(GROUP)
    worker.sync_once(transport)
    assert GROUP not in worker.groups


# ---------------------------------------------------------------- the drafter, as vLLM calls it
class FakeRunner:
    """Stands in for vLLM's model runner: the drafter finds it one frame up, as in GPUModelRunner."""

    def __init__(self, drafter) -> None:  # noqa: ANN001
        self.drafter = drafter
        self.input_batch = SimpleNamespace(req_ids=[])
        self.rows: dict[str, list[int]] = {}

    def step(self, sampled: dict[str, list[int]]) -> dict[str, list[int]]:
        self.input_batch.req_ids = list(sampled)
        for rid, tokens in sampled.items():
            self.rows.setdefault(rid, []).extend(tokens)
        width = max(len(r) for r in self.rows.values())
        token_ids = np.zeros((len(sampled), width + 16), dtype=np.int32)
        counts = np.zeros(len(sampled), dtype=np.int32)
        for i, rid in enumerate(sampled):
            token_ids[i, :len(self.rows[rid])] = self.rows[rid]
            counts[i] = len(self.rows[rid])
        return dict(zip(sampled, self.propose_draft_token_ids(list(sampled.values()), counts, token_ids)))

    def propose_draft_token_ids(self, sampled, counts, token_ids):  # noqa: ANN001, ANN201
        return self.drafter.propose(sampled, counts, token_ids, slot_mappings=None)


def make_drafter(monkeypatch, mode: str = "request", **settings):  # noqa: ANN001, ANN201
    from seerd.drafts.drafter import SETTINGS_ENV, SeerdDrafter

    monkeypatch.setenv(SETTINGS_ENV, json.dumps({"mode": mode, "adaptive": False, **settings}))
    config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=4),
                             model_config=SimpleNamespace(max_model_len=1000))
    return SeerdDrafter(config)


def test_drafter_drafts_from_the_requests_own_repetition_and_counts_acceptance(monkeypatch):
    drafter = make_drafter(monkeypatch)
    runner = FakeRunner(drafter)
    rid = "c1e1g5r9p3h-1a2b3c4d"  # with vLLM's internal suffix
    first = runner.step({rid: [1, 2, 3] + MOTIF + [11, 12, 13]})  # the prefill row: prompt 1, 2, 3
    assert first[rid] == [14, 15, 16, 17]
    runner.step({rid: [14, 15, 99]})  # two drafts accepted, then the engine sampled 99
    assert (drafter.drafted, drafter.accepted) == (4, 2)
    assert drafter.curves[True].accepted[1:4] == pytest.approx([1, 1, 0], abs=1e-3)  # a probe ("h")
    runner.step({})  # the request left the batch
    assert drafter.rows == {}


def test_drafter_leaves_foreign_requests_and_empty_rows_undrafted(monkeypatch):
    drafter = make_drafter(monkeypatch)
    runner = FakeRunner(drafter)
    drafts = runner.step({"cmpl-123": MOTIF * 3, "c2e1g5r10p0": []})
    assert drafts == {"cmpl-123": [], "c2e1g5r10p0": []}


def test_drafter_depth_follows_the_plan_and_stops_at_the_model_length(monkeypatch):
    drafter = make_drafter(monkeypatch)
    drafter.max_model_len = len(MOTIF) * 3 + 2
    runner = FakeRunner(drafter)
    drafts = runner.step({"c1e1g5r9p0": MOTIF * 3})
    assert drafts["c1e1g5r9p0"] == [11]  # room for one more token before max_model_len


def test_a_drafting_failure_costs_drafts_not_the_step(monkeypatch):
    from seerd.drafts.index import SuffixIndex

    drafter = make_drafter(monkeypatch)
    runner = FakeRunner(drafter)

    def broken(self, context, max_tokens, min_prob=0.0):  # noqa: ANN001, ANN202
        raise IndexError("a bug in the index")

    monkeypatch.setattr(SuffixIndex, "propose", broken)
    assert runner.step({"c1e1g5r9p0": MOTIF * 3}) == {"c1e1g5r9p0": []}
    assert drafter.failures == 1


def test_the_adaptive_drafter_times_each_step_with_what_it_produced_and_whether_it_drafted(monkeypatch):
    drafter = make_drafter(monkeypatch, adaptive=True)
    observed = []
    drafter.gate.observe = lambda *step: observed.append(step)  # (rows, tokens, seconds, drafted)
    now = [100.0]
    drafter.clock = lambda: now[0]
    runner = FakeRunner(drafter)
    rid = "c1e1g5r9p3"
    runner.step({rid: [1, 2, 3] + MOTIF * 2})  # the first call: no step before it to time
    assert observed == [] and drafter._drafted_last > 0  # a batch of one: the profile drafts
    now[0] += 0.012
    runner.step({rid: [11, 12, 13]})  # one engine step, which verified the first call's drafts
    assert observed == [(1, 3, pytest.approx(0.012), True)]
    now[0] += 30.0  # the engine sat idle: not a step's cost
    runner.step({rid: [14]})
    assert len(observed) == 1
    now[0] += 0.02  # a step that also prefilled another request: not a decode step's cost
    runner.step({rid: [15], "c2e1g5r10p3": [1, 2, 3, 20]})
    assert len(observed) == 1
    now[0] += 0.02
    runner.step({rid: [16], "c2e1g5r10p3": [21]})
    assert len(observed) == 2 and observed[-1][:2] == (2, 2)


def test_the_adaptive_drafter_stops_drafting_where_its_gate_says_it_does_not_pay(monkeypatch):
    drafter = make_drafter(monkeypatch, adaptive=True)
    runner = FakeRunner(drafter)
    rid = "c1e1g5r9p3"
    assert runner.step({rid: [1, 2, 3] + MOTIF * 2})[rid]  # the profile drafts for a batch of one
    drafter.gate.allows = lambda batch: False
    drafter._steps_since_plan = 100  # re-plan now (it does every few steps)
    assert runner.step({rid: [11]})[rid] == []
