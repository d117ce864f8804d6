#!/usr/bin/env python
"""What one lease costs the coordinator's state thread, by chunks per lease: the start-up fill's price.

A real run database with R queued requests (groups of `--n`, prompts of `--prompt-tokens`,
synchronous FULL as the daemon runs it) is loaded into a `LeaseBook`, W workers register, one
lease builds seer's index (timed apart), and then each worker leases K chunks, for each K asked
(each K with fresh workers), every call timed: the plan, the lease's transaction and the grants,
as `CoordinatorControl.run` calls `LeaseBook.lease`. The HTTP around a call is not in it.
`--joining`: each worker registers just before its lease, as in the start-up fill (registrations
and first leases interleaved on the state thread), its registration timed apart.

    .venv/bin/python tools/bench/lease_cost.py [--requests 100000] [--workers 100] [--chunks 1,4,32] [--joining] [--json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tools.bench.runner import print_json  # noqa: E402

from tools.bench.coordinator_memory import run_database  # noqa: E402
from seerd.book.book import LeaseBook  # noqa: E402
from seerd.scheduler.registry import make_policy  # noqa: E402


def loaded_book(requests: int, n: int, prompt_tokens: int, work: Path) -> LeaseBook:
    _, sessions, rollout_id = run_database(work, requests, n, prompt_tokens, synchronous="FULL")
    book = LeaseBook(sessions, rollout_id, make_policy("seer"), chunk_tokens=512, lease_ttl_s=30.0, seed=0,
                     vocab_size=1024)
    book.load(1.0)
    return book


def measure(requests: int, workers: int, chunks: list[int], n: int, prompt_tokens: int,
            joining: bool = False) -> dict:
    book = loaded_book(requests, n, prompt_tokens, Path(tempfile.mkdtemp(prefix="seerd-lease-cost-")))
    max_chunks = max(chunks)
    registered = 0

    def fresh_worker() -> str:
        nonlocal registered
        worker_id = f"w{registered}"
        book.register(rank=registered, address="x", max_chunks=max_chunks, kv_capacity_tokens=10**7,
                      worker_id=worker_id, now=2.0)
        registered += 1
        return worker_id

    started = time.perf_counter()
    book.lease(fresh_worker(), 1, 3.0)  # the first lease builds seer's index of the queue
    index_s = time.perf_counter() - started
    rows = []
    for k in chunks:
        ids = [] if joining else [fresh_worker() for _ in range(workers)]
        times, registrations, granted = [], [], 0
        for index in range(workers):
            if joining:
                began = time.perf_counter()
                ids.append(fresh_worker())
                registrations.append(time.perf_counter() - began)
            began = time.perf_counter()
            granted += len(book.lease(ids[index], k, 3.0))
            times.append(time.perf_counter() - began)
        rows.append({"chunks_per_lease": k, "leases": workers, "granted": granted,
                     "median_ms": 1e3 * statistics.median(times), "per_grant_us": 1e6 * sum(times) / max(1, granted),
                     "register_median_ms": 1e3 * statistics.median(registrations) if joining else None})
    book.close()
    return {"requests": requests, "workers": workers, "index_build_s": index_s, "rows": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=100, help="leases timed for each chunk count")
    parser.add_argument("--chunks", default="1,4,32")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--joining", action="store_true", help="each worker registers just before its lease")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = measure(args.requests, args.workers, [int(k) for k in args.chunks.split(",")], args.n,
                     args.prompt_tokens, args.joining)
    if args.json:
        print_json(result)
        return 0
    print(f"{result['requests']} queued requests (prompts of {args.prompt_tokens} tokens, groups of {args.n}); "
          f"seer's index built in {result['index_build_s']:.2f} s at the first lease")
    joined = " | median ms per registration" if args.joining else ""
    print(f"| chunks per lease | leases | median ms per lease | us per chunk granted | 512 such leases, s{joined} |")
    print("|---|---|---|---|---|" + ("---|" if args.joining else ""))
    for row in result["rows"]:
        registration = f" {row['register_median_ms']:.2f} |" if args.joining else ""
        print(f"| {row['chunks_per_lease']} | {row['leases']} | {row['median_ms']:.2f} | {row['per_grant_us']:.0f} "
              f"| {512 * row['median_ms'] / 1e3:.2f} |{registration}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
