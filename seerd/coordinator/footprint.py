"""What the coordinator's memory will come to, checked at its start against what the machine has.

The lease book keeps every request of the run in memory (docs/benchmarks.md, "Coordinator memory":
tools/bench/coordinator_memory.py measured 1,628-1,792 bytes a request with prompts of 1,024
tokens in groups of 8, a quarter of it the prompts' tokens, and ~1 KB a worker with its leases),
and the process itself (its imports, the API, the database's caches) measured ~0.6 GB of RSS in
`tools/bench/load.py` runs. A run that cannot fit is refused before it starts, with what it needs, rather
than killed by the kernel's OOM killer an hour into loading and leasing (nothing would be lost:
its state is in the database; but the time would be).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

from seerd.db import Engine, queries

log = logging.getLogger("seerd.coordinator")

BYTES_PER_REQUEST = 1_300  # a request's records in the book, its prompt aside (measured 1,628-1,792 with it)
BYTES_PER_PROMPT_TOKEN = 4  # a group's prompt, kept once for its requests (int32)
BYTES_PER_WORKER = 1_024
PROCESS_BYTES = 600 << 20  # the coordinator process before its book (RSS of small load runs)
WARN_AT_SHARE = 0.5  # of the memory available: warn past it (the engines on the node need memory too)


class NotEnoughMemory(RuntimeError):
    """The run's book would not fit in the memory this machine has available."""


@dataclass(frozen=True)
class Footprint:
    requests: int
    prompt_tokens: int  # summed over the groups
    workers: int

    @property
    def projected_bytes(self) -> int:
        return (PROCESS_BYTES + BYTES_PER_REQUEST * self.requests + BYTES_PER_PROMPT_TOKEN * self.prompt_tokens
                + BYTES_PER_WORKER * self.workers)


def run_footprint(engine: Engine, rollout_id: int, workers: int) -> Footprint:
    with engine.connect() as conn:
        requests = queries.requests.count(conn, rollout_id)
        prompt_tokens = queries.groups.prompt_tokens(conn, rollout_id)
    return Footprint(int(requests), int(prompt_tokens), workers)


def mem_available_bytes() -> int | None:
    """The kernel's estimate of memory available to a new workload (MemAvailable), None where unknown."""
    with contextlib.suppress(OSError), open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def check_footprint(footprint: Footprint, available: int | None) -> None:
    """Raise `NotEnoughMemory` when the projection exceeds `available`; warn past half of it."""
    if available is None:
        return
    needed = footprint.projected_bytes
    what = (f"{footprint.requests:,} requests with {footprint.prompt_tokens:,} prompt tokens and "
            f"{footprint.workers:,} workers: the coordinator will need ~{needed / 2**30:.1f} GiB")
    if needed > available:
        raise NotEnoughMemory(f"{what}, and this machine has {available / 2**30:.1f} GiB available: run it where "
                              f"there is more memory, or split the prompts into smaller runs")
    if needed > WARN_AT_SHARE * available:
        log.warning("%s, %.0f%% of the %.1f GiB available now", what, 100 * needed / available, available / 2**30)
