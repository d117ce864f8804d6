#!/usr/bin/env python
"""Memory of the coordinator's lease book per request and per worker, measured (tracemalloc).

For each size, a real run database with R requests (groups of `--n`, prompts of `--prompt-tokens`)
is created and loaded into a `LeaseBook` as the coordinator loads it; then W workers register
and each leases `--chunks-per-worker` chunks (context and all, as grants carry them). What
Python allocated for the book is measured after each step, so the table gives bytes per queued
request and per worker with its leases. The process's imports (SQLAlchemy, the scheduler) are
excluded: they are the same at any size.

    .venv/bin/python tools/bench_coordinator_memory.py [--requests 10000,100000] [--workers 128,512]
                                                       [--n 8] [--prompt-tokens 1024] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from seerd.config import RunConfig  # noqa: E402
from seerd.coordinator.book import LeaseBook  # noqa: E402
from seerd.coordinator.create import create_rollout  # noqa: E402
from seerd.db import make_engine, make_sessionmaker  # noqa: E402
from seerd.db.migrate import upgrade  # noqa: E402
from seerd.io.prompts import PromptRow  # noqa: E402
from seerd.scheduler.registry import make_policy  # noqa: E402


def run_database(work: Path, requests: int, n: int, prompt_tokens: int, synchronous: str = "NORMAL"):  # noqa: ANN201
    """A real run database of `requests` queued requests (groups of `n`, prompts of
    `prompt_tokens`, a seer rollout with chunks of 512): (its engine, sessions, rollout id)."""
    engine = make_engine(work / "state.db", synchronous=synchronous)
    upgrade(engine)
    sessions = make_sessionmaker(engine)
    rows = [PromptRow(f"p{g}", tuple((g * 7 + i) % 1000 for i in range(prompt_tokens)), n, 4096, {}, g + 1)
            for g in range(requests // n)]
    config = RunConfig(input_path="in.jsonl", model_path="model", policy="seer", chunk_tokens=512)
    with sessions.begin() as session:
        rollout_id = create_rollout(session, config, rows, input_sha256="0" * 64, now=0.0)
    return engine, sessions, rollout_id


def measure(requests: int, workers: int, n: int, prompt_tokens: int, chunks_per_worker: int) -> dict:
    engine, sessions, rollout_id = run_database(Path(tempfile.mkdtemp(prefix="seerd-mem-")), requests, n,
                                                prompt_tokens)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    book = LeaseBook(sessions, rollout_id, make_policy("seer"), chunk_tokens=512, lease_ttl_s=30.0, seed=0,
                     vocab_size=1024)
    started = time.perf_counter()
    book.load(1.0)
    load_s = time.perf_counter() - started
    gc.collect()
    loaded = tracemalloc.get_traced_memory()[0]
    for rank in range(workers):
        book.register(rank=rank, address="x", max_chunks=256, kv_capacity_tokens=10**7, worker_id=f"w{rank}", now=2.0)
    gc.collect()
    registered = tracemalloc.get_traced_memory()[0]
    grants = [book.lease(f"w{rank}", chunks_per_worker, 3.0) for rank in range(workers)]
    leased = sum(map(len, grants))
    del grants  # sent and gone; what the book keeps of a lease stays
    gc.collect()
    after_leases = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    book.close()
    engine.dispose()
    return {"requests": requests, "workers": workers, "leased_chunks": leased, "load_s": load_s,
            "bytes_per_request": (loaded - base) / requests,
            "bytes_per_worker": (registered - loaded) / workers,
            "bytes_per_leased_chunk": (after_leases - registered) / max(1, leased),
            "book_mb": (after_leases - base) / 2**20}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", default="10000,100000")
    parser.add_argument("--workers", default="128,512")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--chunks-per-worker", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = [measure(r, w, args.n, args.prompt_tokens, args.chunks_per_worker)
               for r in map(int, args.requests.split(",")) for w in map(int, args.workers.split(","))]
    if args.json:
        print(json.dumps(results))
        return 0
    print(f"prompts of {args.prompt_tokens} tokens, groups of {args.n}, {args.chunks_per_worker} chunks leased per worker")
    print("| requests | workers | book MB | bytes / request | bytes / worker | bytes / leased chunk | load s |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['requests']} | {r['workers']} | {r['book_mb']:.0f} | {r['bytes_per_request']:.0f} "
              f"| {r['bytes_per_worker']:.0f} | {r['bytes_per_leased_chunk']:.0f} | {r['load_s']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
