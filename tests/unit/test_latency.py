"""The coordinator's own answer times (seerd/server/latency.py): percentiles from 5%-wide
buckets agree with the exact ones."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from seerd.server.latency import BUCKET_RATIO, CallLatencies, PlansPerCall, SlowTurns, watch_loop_lag


def test_bucketed_percentiles_are_within_a_bucket_of_the_exact_ones():
    rng = random.Random(0)
    latencies = CallLatencies()
    seconds = [rng.lognormvariate(-6, 1.5) for _ in range(20_000)]  # ~2.5 ms median, a long tail
    for s in seconds:
        latencies.add("/v1/report", s)
    ordered = sorted(seconds)
    for q in (0.5, 0.9, 0.99):
        exact = ordered[int(q * len(ordered)) - 1]
        assert exact <= latencies.percentile("/v1/report", q) <= exact * BUCKET_RATIO ** 2, q
    figures = latencies.figures()["/v1/report"]
    assert figures["calls"] == len(seconds) and figures["max_ms"] == pytest.approx(1e3 * ordered[-1])


def test_an_endpoint_without_calls_has_no_figures_and_tiny_times_are_kept():
    latencies = CallLatencies()
    assert latencies.figures() == {} and latencies.percentile("/v1/lease", 0.99) == 0.0
    latencies.add("/v1/lease", 0.0)
    latencies.add("/v1/lease", -1e-6)  # a clock step: counted in the first bucket, not an error
    assert latencies.figures()["/v1/lease"]["calls"] == 2


def test_the_slowest_turns_are_kept_with_what_they_ran_overall_and_per_window():
    turns = SlowTurns(keep=3, window_s=10.0)
    ran = [0.001 * (i % 17) for i in range(100)]  # one turn a second, from t = 100 s
    for i, seconds in enumerate(ran):
        turns.add(100.0 + i, seconds, {"lease": [i % 5 + 1, seconds]})
    figures = turns.figures()
    assert [t["ran_ms"] for t in figures["slowest"]] == [16.0] * 3  # the three turns of 16 ms
    assert figures["slowest"][0]["held"] == {"lease": [figures["slowest"][0]["held"]["lease"][0], 16.0]}
    windows = figures["by_window"]
    assert len(windows) == 10 and [w["at_s"] // 10 for w in windows] == list(range(10))
    for w, window in enumerate(windows):  # each window's slowest, at its own time since the first turn
        assert window["ran_ms"] == pytest.approx(1e3 * max(ran[10 * w: 10 * w + 10]))


def test_plans_per_lease_call_count_the_calls_served_and_not():
    plans = PlansPerCall()
    for count in [1] * 90 + [2] * 9 + [7]:
        plans.add(count, served=True)
    plans.add(3, served=False)
    plans.add(0, served=False)  # an empty queue: no plan at all
    assert plans.figures() == {"served": {"calls": 100, "plans": 90 + 18 + 7, "p99_plans": 2, "max_plans": 7},
                               "not_served": {"calls": 2, "plans": 3, "p99_plans": 3, "max_plans": 3}}


def test_the_loop_lag_watch_records_a_blocked_loop():
    async def scenario() -> CallLatencies:
        latencies = CallLatencies()
        watch = asyncio.create_task(watch_loop_lag(latencies, every_s=0.01))
        await asyncio.sleep(0.05)
        time.sleep(0.2)  # the loop held, as by a long callback
        await asyncio.sleep(0.05)
        watch.cancel()
        return latencies

    figures = asyncio.run(scenario()).figures()["event loop late"]
    assert figures["calls"] >= 3 and figures["max_ms"] >= 150
