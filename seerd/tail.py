"""The tail: the last 10% of requests to finish, and when it starts.

One definition for the simulator (`SimResult.tail_time_s`) and `seerd report`: the tail time is
the time spent only on the last 10% of requests, from the moment 90% of them had finished to
the end.
"""

from __future__ import annotations

from collections.abc import Iterable


def finishes_before_tail(total: int) -> int:
    """How many of `total` requests finish before the tail: ceil(0.9 total), the request that
    completes the first 90% included."""
    return -(-9 * total // 10)


def tail_start(finish_times: Iterable[float], total: int | None = None) -> float | None:
    """When 90% of `total` requests (default: as many as `finish_times`) had finished.

    None while fewer than that have finished (an interrupted run), or with no requests at all.
    """
    ordered = sorted(finish_times)
    total = len(ordered) if total is None else total
    k = finishes_before_tail(total)
    if k < 1 or len(ordered) < k:
        return None
    return ordered[k - 1]
