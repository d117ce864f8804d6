"""The coordinator's cyclic garbage collector, kept off the calls' path.

CPython's full (generation-2) pass walks every tracked object not frozen, with the GIL held: the
event loop and the state thread both stop for it. Left automatic, it ran every few seconds over
the imports (torch's, vLLM's) and the lease book, 0.35-0.4 s each; once the heap was frozen after
the book's load, the state that replaced the frozen objects as the run went on (requests re-queued,
leases, progress) grew back to 0.16-0.48 s passes every 2-7 s at 512 workers (a `gc.callbacks`
probe, tools/bench/load.py), the loop stalled up to 0.5 s each time and lease and report p99 were in
seconds.

So the keeper takes full passes out of the collector's hands (its generation-2 threshold out of
reach; the young generations stay automatic: they are cheap and collect most garbage) and makes
them itself, small: every `FREEZE_S` it collects what is not frozen, which is only what survived
since the last tick, and freezes the survivors. Frozen objects are still freed by refcounting;
only a cycle among objects frozen while alive waits, for a full pass over everything, which the
keeper makes when the process's resident memory has grown by `FULL_PASS_GROWTH` since the last
one (CPython's own rule for its full passes is a quarter more long-lived objects; memory stands
in for the count, because `gc.get_freeze_count` walks every frozen object, ~0.1 s with the GIL
held at 100,000 requests, and a count kept by adding each pass's survivors only grows, as frozen
objects freed by refcounting are never subtracted: it called for a 0.8 s full pass every minute
or two). A rollout's live state stays about the same size, so that long stop is rare; one
every 10 minutes, tried first, made a 40 s tail of multi-second calls each time.
"""

from __future__ import annotations

import gc
import os
import resource
import time
from collections.abc import Callable

FREEZE_S = 0.5
FULL_PASS_GROWTH = 0.25
# Generation-2 passes only when the keeper asks (the count it compares never gets there).
NEVER = 1 << 30


class HeapKeeper:
    def __init__(self, clock: Callable[[], float] = time.monotonic, *, freeze_s: float = FREEZE_S,
                 full_pass_growth: float = FULL_PASS_GROWTH, rss: Callable[[], int] | None = None) -> None:
        self.clock = clock
        self.rss = rss or resident_bytes
        self.freeze_s, self.full_pass_growth = freeze_s, full_pass_growth
        self._threshold: tuple[int, int, int] | None = None
        self._frozen_at = 0.0
        self._rss_after_full = 0  # resident bytes after the last full pass (or `settle`)
        self.passes = 0  # small passes made, and their time
        self.pass_s = 0.0
        self.longest_pass_s = 0.0
        self.full_passes = 0
        self.longest_full_pass_s = 0.0

    def settle(self) -> None:
        """Once the book is loaded: everything alive now (imports, book) out of reach, and full
        passes left to `tick`."""
        if self._threshold is None:
            self._threshold = gc.get_threshold()
            young, middle, _ = self._threshold
            gc.set_threshold(young, middle, NEVER)
        gc.collect()
        gc.freeze()
        self._frozen_at, self._rss_after_full = self.clock(), self.rss()

    def tick(self) -> None:
        """Called often (the daemon's watch loop): a small pass every `freeze_s`; a full one when
        resident memory grew by `full_pass_growth` since the last."""
        if self._threshold is None:
            return
        now = self.clock()
        if now - self._frozen_at < self.freeze_s:
            return
        if self.rss() > self._rss_after_full * (1 + self.full_pass_growth):
            took = _timed_pass(full=True)
            self.full_passes += 1
            self.longest_full_pass_s = max(self.longest_full_pass_s, took)
            self._rss_after_full = self.rss()
        else:
            took = _timed_pass(full=False)
            self.passes += 1
            self.pass_s += took
            self.longest_pass_s = max(self.longest_pass_s, took)
        self._frozen_at = now

    def close(self) -> None:
        """The collector as it was (a process that goes on after the coordinator, a test's)."""
        if self._threshold is not None:
            gc.unfreeze()
            gc.set_threshold(*self._threshold)
            self._threshold = None

    def figures(self) -> dict:
        return {"gc_passes": self.passes, "gc_pass_s": round(self.pass_s, 3),
                "gc_longest_pass_s": round(self.longest_pass_s, 3), "gc_full_passes": self.full_passes,
                "gc_longest_full_pass_s": round(self.longest_full_pass_s, 3)}


def _timed_pass(*, full: bool) -> float:
    """One collection (over everything if `full`, else over what is not frozen), then everything
    alive frozen; its seconds."""
    started = time.perf_counter()
    if full:
        gc.unfreeze()
    gc.collect()
    gc.freeze()
    return time.perf_counter() - started


def resident_bytes() -> int:
    """This process's resident memory now (Linux's /proc), else its peak so far."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
