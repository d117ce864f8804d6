"""The KV pool's budget on a fake master: when to trim, whose blocks go, and when it stops."""

from __future__ import annotations

import asyncio
import re

import pytest

from seerd.book.records import WaitingRequest
from seerd.kvpool.host import (
    CHECK_EVERY_S, CHECK_NEAR_BUDGET_S, TRIM_ABOVE, TRIM_BELOW, PoolHost, TrimBudget, queued_longest,
)
from seerd.kvpool.keys import request_pattern
from seerd.kvpool.service import EVICTION_HIGH_WATERMARK
from seerd.kvpool.store import MiB
from seerd.protocol import ChunkReport
from tests.unit.helpers import make_book, rows

CAPACITY = 100 * MiB
BLOCK = MiB


class FakePool:
    """A master and a store in one: keys of one size, figures that follow removals."""

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.removals: list[tuple[str, bool]] = []
        self.failing = False

    def hold(self, group_id: int, scope: str, blocks: int) -> None:
        self.keys |= {f"seerd-kv/run/g{group_id}/{scope}/{i:032x}" for i in range(blocks)}

    def held(self, group_id: int, scope: str) -> int:
        return sum(key.startswith(f"seerd-kv/run/g{group_id}/{scope}/") for key in self.keys)

    # the service
    def check(self) -> bool:
        return False

    def stats(self) -> dict:
        return {"bytes_used": len(self.keys) * BLOCK, "capacity_bytes": CAPACITY, "keys": len(self.keys)}

    # the store
    def remove_by_regex(self, pattern: str, force: bool = False) -> int:
        if self.failing:
            return -1
        self.removals.append((pattern, force))
        gone = {key for key in self.keys if re.search(pattern, key)}
        self.keys -= gone
        return len(gone)


def pool_host(pool: FakePool) -> PoolHost:
    host = PoolHost(pool, "run", local_host="127.0.0.1")
    host._store = pool
    return host


def check(host: PoolHost, waiting: list[WaitingRequest]) -> list[WaitingRequest | None]:
    """One check with the given queue; returns the `after` of each call to `queued_longest`."""
    asked = []

    async def queued_longest(limit: int, after: WaitingRequest | None) -> list[WaitingRequest]:
        asked.append(after)
        return waiting[:limit]

    host._checked_at = 0.0
    asyncio.run(host.check(queued_longest))
    return asked


def test_trimming_starts_and_stops_below_mooncakes_own_eviction():
    assert TRIM_BELOW < TRIM_ABOVE < EVICTION_HIGH_WATERMARK


@pytest.mark.parametrize("figures", [
    {"bytes_used": 69 * MiB, "capacity_bytes": CAPACITY, "keys": 69},
    {"bytes_used": 90 * MiB, "keys": 90},  # the master did not say its capacity
    {},
])
def test_no_budget_needed_below_the_high_watermark_or_without_figures(figures):
    assert TrimBudget.needed(figures) is None


def test_below_the_high_watermark_nothing_is_trimmed():
    pool = FakePool()
    pool.hold(1, "r1", 69)
    host = pool_host(pool)
    assert check(host, [WaitingRequest(1, 1, 5.0)]) == []  # the book was not even asked
    assert pool.removals == [] and host.latest["trimmed_requests"] == 0


def test_budget_is_met_once_the_estimate_is_under_the_low_watermark():
    budget = TrimBudget.needed({"bytes_used": 75 * MiB, "capacity_bytes": CAPACITY, "keys": 75})
    assert (budget.used_bytes, budget.target_bytes, budget.block_bytes) == (75 * MiB, 60 * MiB, MiB)
    budget.removed(15)
    assert not budget.met  # exactly at the low watermark is not under it
    budget.removed(1)
    assert budget.met


def test_the_longest_queued_go_first_one_at_a_time_until_under_the_low_watermark():
    pool = FakePool()
    pool.hold(1, "p", 10)  # prompt blocks: never trimmed
    for request_id, blocks in ((11, 5), (12, 0), (13, 8), (14, 6), (15, 5)):
        pool.hold(1, f"r{request_id}", blocks)
    pool.hold(2, "r21", 41)  # 75 blocks of 100: over 70%
    waiting = [WaitingRequest(1, rid, float(t)) for t, rid in enumerate((11, 12, 13, 14, 15))]
    host = pool_host(pool)

    assert check(host, waiting) == [None]
    # 75 - 5 - 0 - 8 = 62 blocks is not under 60; after request 14, 56 is: 15 keeps its blocks.
    removed = [pattern for pattern, _ in pool.removals]
    assert removed == [request_pattern("run", 1, rid) for rid in (11, 12, 13, 14)]
    assert not any(force for _, force in pool.removals)  # a block being read keeps its lease
    assert (pool.held(1, "r15"), pool.held(1, "p"), pool.held(2, "r21")) == (5, 10, 41)
    figures = host.latest
    assert figures["bytes_used"] == 56 * MiB
    trimmed = (figures["trimmed_requests"], figures["trimmed_blocks"], figures["trimmed_bytes"])
    assert trimmed == (3, 19, 19 * MiB)

    pool.hold(2, "r22", 20)  # over budget again: the next trim starts after the last one dealt with
    assert check(host, waiting[4:]) == [waiting[3]]
    assert pool.held(1, "r15") == 0 and host.latest["trimmed_requests"] == 4


def test_a_running_request_keeps_its_blocks_whatever_the_budget(tmp_path):
    book = make_book(tmp_path, prompt_rows=rows(groups=1, n=3))
    worker = book.register(rank=0, address="test", max_chunks=8, kv_capacity_tokens=100_000,
                           worker_id="w0", now=1000.0).id
    grants = book.lease(worker, wanted=3, now=1000.0)
    for t, grant in zip((1001.0, 1002.0), grants[:2]):  # two wait for their next chunk, one runs
        n = grant.max_tokens
        assert book.report(worker, ChunkReport(grant.chunk_id, grant.epoch, [7] * n, [-1.0] * n, "length"),
                           now=t).accepted
    group_id = book.state.requests[grants[0].request_id].group_id
    pool = FakePool()
    pool.hold(group_id, "p", 2)
    for grant, blocks in zip(grants, (4, 4, 80)):
        pool.hold(group_id, f"r{grant.request_id}", blocks)
    host = pool_host(pool)

    asked = []

    async def asking(limit: int, after: WaitingRequest | None) -> list[WaitingRequest]:
        asked.append(limit)
        return queued_longest(book.state, limit, after)

    asyncio.run(host.check(asking))
    assert asked and host.latest["trimmed_requests"] == 2  # every waiting one, and still over budget
    assert pool.held(group_id, f"r{grants[2].request_id}") == 80  # the running request's
    assert pool.held(group_id, "p") == 2  # its group's prompt blocks, which it needs too


def test_a_failing_store_stops_the_trim():
    pool = FakePool()
    for request_id in (1, 2):
        pool.hold(1, f"r{request_id}", 40)
    pool.failing = True
    host = pool_host(pool)
    check(host, [WaitingRequest(1, 1, 1.0), WaitingRequest(1, 2, 2.0)])
    assert host.latest["remove_errors"] == 1 and host.latest["trimmed_requests"] == 0
    pool.failing = False
    assert check(host, [WaitingRequest(1, 1, 1.0)]) == [None]  # not passed over: tried again


@pytest.mark.parametrize(("held_blocks", "next_check_after_s"), [(30, CHECK_EVERY_S), (65, CHECK_NEAR_BUDGET_S)])
def test_the_pool_is_read_more_often_once_past_the_low_watermark(monkeypatch, held_blocks, next_check_after_s):
    pool = FakePool()
    pool.hold(1, "r11", held_blocks)
    host = pool_host(pool)
    now = [1000.0]
    monkeypatch.setattr("seerd.kvpool.host.time.monotonic", lambda: now[0])
    calls = []
    pool.check = lambda: calls.append(now[0]) or False
    asyncio.run(host.check())
    for waited in (next_check_after_s - 0.01, next_check_after_s):
        now[0] = 1000.0 + waited
        asyncio.run(host.check())
    assert calls == [1000.0, 1000.0 + next_check_after_s]
