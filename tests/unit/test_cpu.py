"""Where a daemon's CPU went, per thread (`seerd.cpu`): read from /proc for this process."""

from __future__ import annotations

import threading
import time

from seerd.cpu import CpuSnapshot


def spin(seconds: float) -> None:
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


def test_a_snapshot_splits_the_process_cpu_by_thread_name():
    before = CpuSnapshot.now()
    spun, done = threading.Event(), threading.Event()

    def busy_then_wait() -> None:
        spin(0.3)
        spun.set()
        done.wait()  # alive at the second snapshot

    thread = threading.Thread(target=busy_then_wait, name="busy-one")
    thread.start()
    spin(0.05)
    spun.wait()
    after = CpuSnapshot.now()
    done.set()
    thread.join()
    used = after.since(before)
    assert used["busy-one"] >= 0.28  # clock ticks: 10 ms resolution
    assert used["MainThread"] >= 0.04
    assert after.process_s - before.process_s >= 0.35
