"""How long the coordinator itself takes to answer, per endpoint.

The workers time their calls (tools/load.py reads their figures), but a call's time at a worker
includes its own process's event loop, which answers hundreds of simulated workers in a load
test. These are the coordinator's side: from the request's signature check to its answer's
last byte handed to the server, a lease's long-poll wait for work taken out. Counts in buckets
5% wide from 10 us up, so a run of millions of calls keeps a few kilobytes, and a percentile is
known to within 5%.
"""

from __future__ import annotations

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
