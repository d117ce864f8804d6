#!/usr/bin/env python
"""What a group commit's leases cost the state thread: `LeaseBook.report_calls` with W report calls
at once (as `CoordinatorControl.report` hands it the calls that queued meanwhile), each reporting
its worker's chunks finished and wanting as many new ones: the thread's CPU and wall time per
call, median over `--rounds` group commits after the workers' first leases.

A real run database (`bench_coordinator_memory.run_database`: seer, groups of 8, synchronous
FULL as the daemon runs it) of `--requests` queued requests. It measures the checkout it is run
from (its root goes first on the import path): a change is measured by running it in both
checkouts, alternated:

    .venv/bin/python tools/bench/group_leases.py [--calls 500] [--requests 20000] [--chunks 4] [--rounds 6]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench.coordinator_memory import run_database  # noqa: E402
from seerd.book.book import LeaseBook  # noqa: E402
from seerd.book.records import ReportCall  # noqa: E402
from seerd.protocol import ChunkReport  # noqa: E402
from seerd.scheduler.registry import make_policy  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=500, help="report calls in one group commit (one per worker)")
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--chunks", type=int, default=4, help="chunks each worker holds, reports and leases again")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    _, sessions, rollout_id = run_database(Path(tempfile.mkdtemp(prefix="seerd-leases-")), args.requests, 8, 256,
                                           synchronous="FULL")
    book = LeaseBook(sessions, rollout_id, make_policy("seer"), chunk_tokens=64, lease_ttl_s=3600.0, seed=0,
                     vocab_size=1024, in_place=True, first_chunk_spread=0.0)
    now = 1.0
    book.load(now)
    for rank in range(args.calls):
        book.register(rank=rank, address="x", max_chunks=args.chunks, kv_capacity_tokens=100_000,
                      worker_id=f"w{rank}", now=now)
    held = {f"w{rank}": book.lease(f"w{rank}", args.chunks, now) for rank in range(args.calls)}
    cpu, wall = [], []
    for _ in range(args.rounds):
        now += 1.0
        calls = [ReportCall(worker, [ChunkReport(g.chunk_id, g.epoch, [5] * 8, [-0.5] * 8, "stop") for g in grants],
                            wanted=len(grants)) for worker, grants in held.items()]
        cpu_at, wall_at = time.thread_time(), time.perf_counter()
        answers = book.report_calls(calls, now)
        cpu.append((time.thread_time() - cpu_at) / len(calls))
        wall.append((time.perf_counter() - wall_at) / len(calls))
        held = {call.worker_id: answer[1] for call, answer in zip(calls, answers)}
    print(f"{args.calls} report calls a group commit, {args.requests} requests, {args.chunks} chunks each: "
          f"state-thread CPU {1e3 * statistics.median(cpu):.3f} ms a call, wall {1e3 * statistics.median(wall):.3f} ms "
          f"(medians of {args.rounds}; CPU per round {[round(1e3 * c, 3) for c in cpu]})")


if __name__ == "__main__":
    main()
