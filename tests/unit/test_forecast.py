"""seer's group forecast: growth ratios learned from completed groups, and what the lease book
does with them (fed at every group completion, rebuilt the same after a restart)."""

from __future__ import annotations

import random

import pytest

from seerd.protocol import ChunkReport
from seerd.scheduler import QueuedRequest
from seerd.scheduler.forecast import GrowthRatios, GrowthTable, group_forecast
from tests.unit.helpers import make_book, reopen, rows


def view(*, estimate, finished, n=4, longest_unfinished=0, max_tokens=1000, generated=0):
    return QueuedRequest(1, 0, 0, 1, 10, generated, max_tokens, False, estimate, None, 0.0, n, finished,
                         longest_unfinished)


def test_ratios_are_the_final_longest_over_the_longest_of_the_first_k():
    table = GrowthTable(quantile=1.0, min_groups=1)
    table.observe_completed([10, 40, 20, 80])  # in finish order
    assert table.current.ratios == {(4, 1): 8.0, (4, 2): 2.0, (4, 3): 2.0}


def test_the_table_keeps_the_quantile_per_group_size_and_finished_count():
    table = GrowthTable(quantile=0.9, min_groups=10)
    for growth in range(1, 11):  # groups whose longest grew 1x .. 10x after the first finish
        table.observe_completed([100, 100 * growth])
    assert table.current.ratio(2, 1) == 10.0  # the 0.9 quantile of 1..10: index 9 of 10
    for _ in range(3):
        table.observe_completed([5, 5, 5])
    assert table.current.ratio(3, 2) == 1.0  # 13 completed: refreshed again
    assert table.current.ratio(2, 1) == 10.0
    assert table.current.ratio(8, 1) == 1.0  # no group of 8 completed: no growth assumed


def test_no_ratios_before_enough_groups_completed_and_few_refreshes_after():
    table = GrowthTable(quantile=1.0, min_groups=8)
    refreshed_at, version = [], 0
    for completed in range(1, 201):
        table.observe_completed([10, 20])
        if table.current.version != version:
            refreshed_at.append(completed)
            version = table.current.version
    # First at the 8th group, then only when completed groups grew by a quarter: a policy's
    # queue index is rebuilt a dozen times in a rollout, not at every finish.
    assert refreshed_at == [8, 10, 13, 17, 22, 28, 35, 44, 55, 69, 87, 109, 137, 172]
    assert table.current.ratio(2, 1) == 2.0


def test_forecast_rules():
    growth = GrowthRatios(1, {(4, 1): 3.0, (4, 2): 1.5})
    # Nothing finished: the group's start value (max_tokens, or a prior), or what runs, scaled.
    assert group_forecast(view(estimate=1000, finished=0), growth) == 1000
    assert group_forecast(view(estimate=200, finished=0), growth) == 200  # a prior
    assert group_forecast(view(estimate=200, finished=0, longest_unfinished=100), growth) == 300
    # Finished ones scaled by the ratio for as many finishes; what runs scaled by the 1-finish ratio.
    assert group_forecast(view(estimate=100, finished=2), growth) == 150
    assert group_forecast(view(estimate=100, finished=2, longest_unfinished=80), growth) == 240
    assert group_forecast(view(estimate=500, finished=1), growth) == 1000  # capped at max_tokens
    assert group_forecast(view(estimate=100, finished=3), growth) == 100  # no ratio learned: 1


def test_ratios_shrink_for_tight_groups_and_grow_for_spread_ones():
    def learned(spread):
        rng = random.Random(1)
        table = GrowthTable()
        for _ in range(100):
            base = rng.lognormvariate(7, 1)
            table.observe_completed(sorted(round(base * rng.lognormvariate(0, spread)) for _ in range(8)))
        return table.current.ratio(8, 1)

    assert learned(0.02) < 1.1 < 2.0 < learned(0.4)


def test_bad_quantile_is_refused():
    with pytest.raises(ValueError, match="quantile"):
        GrowthTable(quantile=0.0)


def _finish(book, worker, grant, n, now):
    report = ChunkReport(grant.chunk_id, grant.epoch, [7] * n, [-1.0] * n, "stop")
    assert book.report(worker, report, now=now).accepted


def test_the_lease_book_learns_from_completed_groups_and_a_restart_rebuilds_the_same(tmp_path):
    book = make_book(tmp_path, policy="seer", chunk_tokens=64, prompt_rows=rows(groups=14, n=2, max_tokens=64))
    worker = book.register(rank=0, address="test", max_chunks=64, kv_capacity_tokens=10**6, worker_id="w",
                           now=1000.0).id
    grants = book.lease(worker, wanted=64, now=1000.0)
    by_group: dict[int, list] = {}
    for grant in grants:
        by_group.setdefault(book.state.requests[grant.request_id].group_id, []).append(grant)
    now = 1001.0
    for i, (gid, pair) in enumerate(sorted(by_group.items())):
        first, second = sorted(pair, key=lambda g: g.request_id)
        _finish(book, worker, first, 10, now)
        if i < 12:  # twelve groups complete, the last two keep one response running
            _finish(book, worker, second, 10 + 3 * i, now + 0.5)
        now += 1.0
    assert book.state.growth.completed_groups == 12
    learned = book.state.growth.current
    assert learned.version >= 1 and learned.ratio(2, 1) == 4.0  # refreshed at 12: quantile 0.9 of 1.0 .. 4.3
    restarted = reopen(book, now=now)
    assert restarted.state.growth.current == learned
    # Queued views carry what the forecast needs: size, finishes, longest unfinished so far.
    (queued,) = [r for r in restarted.state.queue if r.group_finished == 1][:1]
    assert (queued.group_size, queued.group_finished) == (2, 1)
    assert group_forecast(queued, learned) == 40


def test_the_book_persists_each_groups_forecast_and_status_reads_it(tmp_path):
    """The forecast `seerd status` counts the time left with is the coordinator's own, written to
    prompt_groups.forecast_tokens on its tick: equal to the scheduler state's, rewritten only on change."""
    from sqlalchemy import select

    from seerd.db import Group
    from seerd.status.snapshot import read_snapshot

    book = make_book(tmp_path, policy="seer", chunk_tokens=64, prompt_rows=rows(groups=3, n=2, max_tokens=64))
    worker = book.register(rank=0, address="test", max_chunks=64, kv_capacity_tokens=10**6, worker_id="w",
                           now=1000.0).id

    def persisted():
        with book.sessions() as session:
            return dict(session.execute(select(Group.id, Group.forecast_tokens)).all())

    assert book.persist_soft_state() == 3 and set(persisted().values()) == {64}  # nothing finished: max_tokens
    assert book.persist_soft_state() == 0  # unchanged: nothing written
    grants = sorted(book.lease(worker, wanted=64, now=1000.0), key=lambda g: g.request_id)
    _finish(book, worker, grants[0], 10, 1001.0)  # group 1's first response: its forecast drops to 10
    assert book.persist_soft_state() == 1
    assert persisted() == {gid: book.state.forecast(gid) for gid in book.state.groups}
    assert persisted()[grants[0].group_id] == 10
    snapshot = read_snapshot(tmp_path, now=1002.0)
    # Unfinished: one response of group 1 (forecast 10) and four of groups 2-3 (64 each), none started.
    assert snapshot["output_tokens_expected"] == snapshot["output_tokens"] + 10 + 4 * 64


def test_the_tick_writes_a_bounded_number_of_forecasts_and_catches_up_on_later_ticks(tmp_path):
    """Every group's forecast comes due at once (the first tick, a new growth table); the tick
    writes at most `forecasts_limit` a call, and the calls together write exactly what one
    unbounded call would have."""
    from sqlalchemy import select

    from seerd.db import Group

    book = make_book(tmp_path, policy="seer", chunk_tokens=64, prompt_rows=rows(groups=7, n=2, max_tokens=64))
    written = [book.persist_soft_state(forecasts_limit=3) for _ in range(4)]
    assert written == [3, 3, 1, 0]
    with book.sessions() as session:
        persisted = dict(session.execute(select(Group.id, Group.forecast_tokens)).all())
    assert persisted == {gid: book.state.forecast(gid) for gid in book.state.groups} and len(persisted) == 7
