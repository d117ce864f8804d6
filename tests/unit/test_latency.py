"""The coordinator's own answer times (seerd/coordinator/latency.py): percentiles from 5%-wide
buckets agree with the exact ones."""

from __future__ import annotations

import random

import pytest

from seerd.coordinator.latency import BUCKET_RATIO, CallLatencies


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
