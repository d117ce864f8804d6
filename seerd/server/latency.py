"""How long the coordinator itself takes to answer, per endpoint.

The workers time their calls (tools/bench/load.py reads their figures), but a call's time at a worker
includes its own process's event loop, which answers hundreds of simulated workers in a load
test. These are the coordinator's side: from the request's signature check to its answer's
last byte handed to the server, a lease's long-poll wait for work taken out. Counts in buckets
5% wide from 10 us up, so a run of millions of calls keeps a few kilobytes, and a percentile is
known to within 5%.
"""

from __future__ import annotations

import asyncio
import heapq
import math

BUCKET_RATIO = 1.05
FLOOR_S = 1e-5
# The ASGI scope key under which a handler says how long its call waited for work on purpose.
WAITED_SCOPE_KEY = "seerd.waited_s"


class CallLatencies:
    def __init__(self) -> None:
        self._counts: dict[str, dict[int, int]] = {}
        self._max_s: dict[str, float] = {}

    def add(self, endpoint: str, seconds: float) -> None:
        bucket = max(0, math.ceil(math.log(max(seconds, FLOOR_S) / FLOOR_S, BUCKET_RATIO)))
        counts = self._counts.setdefault(endpoint, {})
        counts[bucket] = counts.get(bucket, 0) + 1
        self._max_s[endpoint] = max(self._max_s.get(endpoint, 0.0), seconds)

    def percentile(self, endpoint: str, q: float) -> float:
        """The `q` quantile (0..1) of the endpoint's calls, as its bucket's upper bound (0 if none)."""
        counts = self._counts.get(endpoint, {})
        rank = q * sum(counts.values())
        seen = 0
        for bucket in sorted(counts):
            seen += counts[bucket]
            if seen >= rank:
                return min(FLOOR_S * BUCKET_RATIO ** bucket, self._max_s[endpoint])
        return 0.0

    def figures(self) -> dict[str, dict[str, float]]:
        return {endpoint: {"calls": sum(counts.values()), "p50_ms": 1e3 * self.percentile(endpoint, 0.5),
                           "p99_ms": 1e3 * self.percentile(endpoint, 0.99), "max_ms": 1e3 * self._max_s[endpoint]}
                for endpoint, counts in sorted(self._counts.items())}


class SlowTurns:
    """The `keep` slowest turns of the state thread, and the slowest of every `window_s`, each
    with what it ran (call name -> count and seconds) and when (seconds since the first turn):
    what makes a burst of slow answers, and whether bursts recur through a run."""

    def __init__(self, keep: int = 20, window_s: float = 10.0) -> None:
        self.keep, self.window_s = keep, window_s
        self._first: float | None = None
        self._turns = 0  # ties are broken by the turn's number, never by comparing what it held
        self._slowest: list[tuple[float, float, int, dict[str, list]]] = []  # a min-heap on the run time
        self._by_window: dict[int, tuple[float, float, int, dict[str, list]]] = {}

    def add(self, started: float, ran_s: float, held: dict[str, list]) -> None:
        if self._first is None:
            self._first = started
        self._turns += 1
        entry = (ran_s, started - self._first, self._turns, held)
        if len(self._slowest) < self.keep:
            heapq.heappush(self._slowest, entry)
        elif ran_s > self._slowest[0][0]:
            heapq.heapreplace(self._slowest, entry)
        window = int(entry[1] // self.window_s)
        if window not in self._by_window or ran_s > self._by_window[window][0]:
            self._by_window[window] = entry

    def since_first(self, moment: float) -> float:
        """A `time.perf_counter()` moment as these figures' `at_s` (seconds since the first turn)."""
        return moment - (self._first if self._first is not None else moment)

    def figures(self) -> dict[str, list[dict]]:
        return {"slowest": [_turn(e) for e in sorted(self._slowest, key=lambda e: -e[0])],
                "by_window": [_turn(self._by_window[w]) for w in sorted(self._by_window)]}


def _turn(entry: tuple[float, float, int, dict[str, list]]) -> dict:
    ran, at, _, held = entry
    return {"at_s": round(at, 2), "ran_ms": round(1e3 * ran, 1),
            "held": {name: [count, round(1e3 * seconds, 1)] for name, (count, seconds) in held.items()}}


class PlansPerCall:
    """How many plans the state thread made for each lease call, by whether it got work: a long
    poll woken for work it is not given plans again each time (its answer waits for each)."""

    def __init__(self) -> None:
        self._calls: dict[tuple[int, bool], int] = {}

    def add(self, plans: int, served: bool) -> None:
        self._calls[plans, served] = self._calls.get((plans, served), 0) + 1

    def figures(self) -> dict:
        def summary(served: bool) -> dict:
            counts = {plans: n for (plans, got), n in self._calls.items() if got == served}
            calls = sum(counts.values())
            ranked = sorted(counts)
            return {"calls": calls, "plans": sum(p * n for p, n in counts.items()),
                    "p99_plans": next((p for i, p in enumerate(ranked)
                                       if sum(counts[q] for q in ranked[:i + 1]) >= 0.99 * calls), 0),
                    "max_plans": max(ranked, default=0)}
        return {"served": summary(True), "not_served": summary(False)}


async def watch_loop_lag(latencies: CallLatencies, every_s: float = 0.02) -> None:
    """Until cancelled: how late the event loop wakes a sleep of `every_s`, as "event loop late"
    in `latencies`. A late wake-up is the loop held (a long callback, the GIL on another thread):
    every call in flight then waits as long."""
    loop = asyncio.get_running_loop()
    while True:
        asked = loop.time()
        await asyncio.sleep(every_s)
        latencies.add("event loop late", max(0.0, loop.time() - asked - every_s))
