#!/usr/bin/env python
"""Does `seerd status` slow the coordinator down? Report latency with and without a reader.

    .venv/bin/python tools/bench/status_reader.py [--rounds 6] [--calls 400] [--groups 200]

The writer is the coordinator's own code path, on its thread: the lease book (real SQLite in WAL
mode, synchronous=NORMAL as the daemon opens it) leasing, heartbeating and committing reports of
a synthetic engine (made-up tokens: the engine is not what is measured). The reader is a separate
process, as `seerd status` is, taking snapshots back to back (the worst case; the live view takes
one a second) or once a second. Rounds alternate between conditions so that machine noise falls
on all of them; the table gives medians over rounds of each round's median and p99 report latency,
and their ratios to the no-reader rounds.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from seerd.protocol import ChunkReport  # noqa: E402
from seerd.status.snapshot import read_snapshot  # noqa: E402
from tests.unit.helpers import make_book, rows  # noqa: E402

CONDITIONS = {"no reader": None, "reader 1/s": 1.0, "reader back to back": 0.0}


def reader(run_dir: str, pause_s: float, stop, frames) -> None:  # noqa: ANN001
    while not stop.is_set():
        read_snapshot(Path(run_dir))
        with frames.get_lock():
            frames.value += 1
        if pause_s:
            stop.wait(pause_s)


def one_round(pause_s: float | None, calls: int, groups: int) -> tuple[list[float], int]:
    """Report latencies (seconds) of `calls` report calls, with a reader process or without."""
    with tempfile.TemporaryDirectory() as tmp:
        book = make_book(Path(tmp), policy="seer", chunk_tokens=8, lease_ttl_s=60.0,
                         prompt_rows=rows(groups=groups, n=8, max_tokens=4096, prompt_len=64))
        worker = book.register(rank=0, address="bench", max_chunks=64, kv_capacity_tokens=10_000_000,
                               worker_id="w", now=1000.0).id
        stop, frames = multiprocessing.Event(), multiprocessing.Value("i", 0)
        process = None
        if pause_s is not None:
            process = multiprocessing.Process(target=reader, args=(tmp, pause_s, stop, frames))
            process.start()
            while frames.value == 0:  # the reader is up and reading before we measure
                time.sleep(0.01)
        latencies = []
        now = 1000.0
        grants = book.lease(worker, 64, now=now)
        try:
            for _ in range(calls):
                now += 0.05
                # A worker's report of 8 chunks (its batch), then its next lease and heartbeat.
                batch, grants = grants[:8], grants[8:]
                reports = [ChunkReport(g.chunk_id, g.epoch, [7] * g.max_tokens, [-0.5] * g.max_tokens, "length")
                           for g in batch]
                started = time.perf_counter()
                book.report_many(worker, reports, now=now)
                latencies.append(time.perf_counter() - started)
                grants += book.lease(worker, 64 - len(grants), now=now)
                book.heartbeat(worker, [g.chunk_id for g in grants], now=now, stats={"tokens_per_s_recent": 1.0})
        finally:
            stop.set()
            if process is not None:
                process.join()
        book.sessions.kw["bind"].dispose()
        return latencies, frames.value


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--groups", type=int, default=200)
    args = parser.parse_args()
    medians: dict[str, list[float]] = {name: [] for name in CONDITIONS}
    tails: dict[str, list[float]] = {name: [] for name in CONDITIONS}
    frames: dict[str, list[int]] = {name: [] for name in CONDITIONS}
    for round_index in range(args.rounds):
        order = list(CONDITIONS) if round_index % 2 == 0 else list(reversed(CONDITIONS))
        for name in order:
            latencies, seen = one_round(CONDITIONS[name], args.calls, args.groups)
            medians[name].append(statistics.median(latencies))
            tails[name].append(p99(latencies))
            frames[name].append(seen)
        print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr)
    base_median = statistics.median(medians["no reader"])
    base_p99 = statistics.median(tails["no reader"])
    print(f"report latency of the lease book, {args.calls} reports of 8 chunks per round, {args.rounds} rounds "
          f"(medians over rounds)")
    print(f"{'condition':<22}{'median ms':>10}{'p99 ms':>9}{'x median':>10}{'x p99':>8}{'frames/round':>14}")
    for name in CONDITIONS:
        median, tail = statistics.median(medians[name]), statistics.median(tails[name])
        print(f"{name:<22}{1000 * median:>10.2f}{1000 * tail:>9.2f}{median / base_median:>10.2f}"
              f"{tail / base_p99:>8.2f}{statistics.median(frames[name]):>14.0f}")


if __name__ == "__main__":
    main()
