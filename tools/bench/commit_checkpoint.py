#!/usr/bin/env python
"""Durable commit latency with the background WAL checkpoints as the coordinator runs them, and
without: does a checkpoint's fsync of the database file hold the commits' WAL fsyncs behind it?

The coordinator's writer (`seerd.db.base.Writer`) commits every report durably (synchronous
FULL: an fsync of the WAL each) and, past `CHECKPOINT_WAL_BYTES` of WAL, copies the WAL into the
database on a thread of its own (PASSIVE: never blocks the writer's lock, but it writes and
fsyncs the database file). `tools/bench/load.py` saw single report commits of 150-380 ms about once per
10 s. This writes rows of the load test's size at its rate, on one thread, through the real
Writer, with the checkpoint threshold at its value, at a quarter of it, and with checkpoints
off (the WAL grows), interleaved round by round, and prints each configuration's commit
latency percentiles and their ratio to the coordinator's setting.

    .venv/bin/python tools/bench/commit_checkpoint.py [--seconds 30] [--rounds 2] [--rate 100] [--row-bytes 3000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from sqlalchemy import text  # noqa: E402

from seerd.db.base import Writer, make_engine  # noqa: E402

CONFIGS = {"as run (4 MiB)": 4 << 20, "a quarter (1 MiB)": 1 << 20, "no checkpoints": None}


def one_run(threshold: int | None, seconds: float, rate: float, row_bytes: int) -> tuple[list[float], int]:
    """Commit latencies (s) of `rate` durable commits a second for `seconds`, and checkpoints made."""
    with tempfile.TemporaryDirectory(dir=REPO) as work:  # on the disk the runs use, not a tmpfs
        engine = make_engine(Path(work) / "bench.db")
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE chunks (id INTEGER PRIMARY KEY, tokens BLOB)"))
        writer = Writer(engine)
        if threshold is None:
            writer.CHECKPOINT_WAL_BYTES = writer.INLINE_CHECKPOINT_WAL_BYTES = 1 << 62
        else:
            writer.CHECKPOINT_WAL_BYTES = threshold
        payload = os.urandom(row_bytes)
        latencies = []
        started = time.monotonic()
        next_at = started
        while time.monotonic() - started < seconds:
            began = time.perf_counter()
            with writer.begin(durable=True) as conn:
                conn.execute(text("INSERT INTO chunks (tokens) VALUES (:t)"), {"t": payload})
            latencies.append(time.perf_counter() - began)
            next_at += 1.0 / rate
            time.sleep(max(0.0, next_at - time.monotonic()))
        checkpoints = writer.checkpoints
        writer.close()
        engine.dispose()
    return latencies, checkpoints


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rate", type=float, default=100.0, help="durable commits a second")
    parser.add_argument("--row-bytes", type=int, default=3000, help="bytes written per commit")
    args = parser.parse_args()
    runs: dict[str, list[tuple[list[float], int]]] = {name: [] for name in CONFIGS}
    for _ in range(args.rounds):
        for name, threshold in CONFIGS.items():
            runs[name].append(one_run(threshold, args.seconds, args.rate, args.row_bytes))
    print(f"{args.rate:.0f} durable commits/s of {args.row_bytes} bytes, {args.seconds:.0f} s x {args.rounds} rounds")
    print("| checkpoints | commits | checkpoints made | p50 ms | p99 ms | p99.9 ms | max ms | p99 x as run |")
    print("|---|---|---|---|---|---|---|---|")
    reference = statistics.median(percentile(lat, 0.99) for lat, _ in runs["as run (4 MiB)"])
    for name, results in runs.items():
        lat = [x for run, _ in results for x in run]
        p99 = statistics.median(percentile(run, 0.99) for run, _ in results)
        print(f"| {name} | {len(lat)} | {sum(c for _, c in results)} | {1e3 * percentile(lat, 0.5):.2f} "
              f"| {1e3 * p99:.1f} | {1e3 * percentile(lat, 0.999):.1f} | {1e3 * max(lat):.1f} | {p99 / reference:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
