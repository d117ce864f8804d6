"""CPU time of this process, in total and per thread: where a daemon's CPU went (the event loop
parsing calls, the state thread writing them, the ownership heartbeat), figures that on a machine
whose cores the engines need are time taken from the engines."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field


# Helper processes whose CPU counts as this daemon's (the coordinator's API fronts): pid -> name.
_helpers: dict[int, str] = {}


def count_helper(pid: int, name: str) -> None:
    """Count process `pid`'s CPU in this process's snapshots, as a thread called `name`."""
    _helpers[pid] = name


def forget_helper(pid: int) -> None:
    _helpers.pop(pid, None)


@dataclass(frozen=True)
class CpuSnapshot:
    process_s: float  # this process's CPU seconds, its helpers' included
    threads_s: dict[str, float] = field(default_factory=dict)  # thread name -> its CPU seconds so far

    @classmethod
    def now(cls) -> CpuSnapshot:
        threads = thread_cpu_seconds()
        helpers = {name: seconds for pid, name in list(_helpers.items())
                   if (seconds := _process_cpu_seconds(pid)) is not None}
        return cls(time.process_time() + sum(helpers.values()), {**threads, **helpers})

    def since(self, earlier: CpuSnapshot) -> dict[str, float]:
        """CPU seconds per thread between `earlier` and this snapshot (threads alive at this one)."""
        return {name: round(s - earlier.threads_s.get(name, 0.0), 3) for name, s in self.threads_s.items()}


def _process_cpu_seconds(pid: int) -> float | None:
    """A helper's CPU seconds so far (None once it is gone: a front started again starts from 0,
    and what the dead one spent since the last snapshot is not counted)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds() -> dict[str, float]:
    """Each live thread's CPU seconds by its Python name (threads Python did not start, a
    library's, are summed as "other"), from /proc; empty where there is none."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    ticks = os.sysconf("SC_CLK_TCK")
    seconds: dict[str, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return seconds
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        name = names.get(int(tid), "other")
        seconds[name] = seconds.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return seconds


class ThreadClock:
    """The calling thread's CPU time and run-queue wait, from the kernel's schedstat: a step
    whose wall time exceeds its CPU time waited either runnable with no core free (run-queue
    wait: other processes or threads held both cores) or blocked (the GIL another thread of the
    process held, a lock, the disk). Open it in the thread it measures; without /proc the wait reads 0."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None
        self.slices = 0  # times the thread was put on a core so far, as of the last `read` (0 without /proc)

    def read(self) -> tuple[float, float]:
        """(CPU seconds, run-queue seconds) of this thread so far."""
        if self._fd is None:
            return time.thread_time(), 0.0
        on_cpu_ns, waiting_ns, slices = os.pread(self._fd, 64, 0).split()
        self.slices = int(slices)
        return int(on_cpu_ns) / 1e9, int(waiting_ns) / 1e9

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class Laps:
    """Time spent per named phase of one piece of work, into `held` (name -> [count, seconds]),
    as `SlowTurns` keeps it: `lap(name)` charges the time since the previous lap to `name`."""

    def __init__(self, held: dict[str, list]) -> None:
        self.held = held
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        spent = self.held.setdefault(name, [0, 0.0])
        spent[0] += 1
        spent[1] += now - self._last
        self._last = now
