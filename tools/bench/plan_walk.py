#!/usr/bin/env python
"""What seer's plan costs when the queue is long and the asking workers' KV is tight.

The state thread's plans at 512 workers and 100,000 requests (`tools/bench/load.py`) walk ~100-150
queued requests each once the workers' KV fills (~200 s in), 95% of them passed over because
they do not fit the asking worker's KV but fit another's, and a third to a half of the plans stop
at `MAX_PASSED_OVER` with nothing (docs/journal/2026-11-30.md, seventeenth session). This reproduces that
state without a daemon: a queue of `--queued` requests (groups of 8, a `--requeued` share of
them re-queued with a home among the workers, the rest fresh) and `--workers` workers of the cpu-tiny engine (32
sequences, 5,120 KV tokens in blocks of 16), then `--plans` plans of seer, each for a random
worker, at three levels of KV room left on the workers, side by side in one run: the time per
plan, the requests each walked (both passes), the plans that passed over more than
`MAX_PASSED_OVER`, those that needed a lean pass and those that gave nothing. The plans' digest
tells whether a change to the walk moved a decision: run it in both checkouts (its root goes
first on the import path) and compare.

    .venv/bin/python tools/bench/plan_walk.py [--queued 65000] [--workers 512] [--plans 3000] [--seed 0]
                                              [--requeued 0.2]
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from seerd.scheduler import QueuedRequest, RequestQueue, SeerPolicy, Snapshot, WorkerLoad, base  # noqa: E402
from seerd.scheduler.views import OpenWorkers  # noqa: E402

KV_TOKENS, BLOCK, SEQUENCES, CHUNK, MAX_TOKENS, GROUP = 5120, 16, 32, 64, 512, 8
# KV tokens left on a worker, drawn per worker: loose (room for any chunk), mixed, tight.
ROOM_LEFT = {"loose": (2048, 3072, 4096), "mixed": (128, 512, 1024, 2048, 4096),
             "tight": (0, 64, 128, 256, 384, 512)}


def queue_of(rng: random.Random, queued: int, workers: int, requeued: float) -> RequestQueue:
    requests = []
    for rid in range(queued):
        gid = rid // GROUP
        generated = 0 if rng.random() < 1 - requeued else CHUNK * rng.randint(1, 7)
        home = None if generated == 0 else f"w{rng.randrange(workers)}"
        estimate = MAX_TOKENS if rng.random() < 0.7 else rng.randint(CHUNK, MAX_TOKENS)
        probe = rid % GROUP == 0 and rng.random() < 0.05
        requests.append(QueuedRequest(
            rid, gid, gid, rid % GROUP, 50 + gid * 37 % 250, generated, MAX_TOKENS, probe, estimate, home,
            rng.uniform(0, 300), group_size=GROUP, group_finished=rng.randint(0, 3),
            group_longest_unfinished=generated))
    return RequestQueue.of(requests)


def loads_of(rng: random.Random, workers: int, room: tuple[int, ...]) -> tuple[WorkerLoad, ...]:
    return tuple(WorkerLoad(f"w{i}", i, rng.randint(18, SEQUENCES), KV_TOKENS - rng.choice(room), SEQUENCES,
                            KV_TOKENS, BLOCK) for i in range(workers))


class Walked:
    """What admission's passes (`base._admit`) take from the policy's order, plan by plan: the
    requests, the passes (a second one is the lean pass), and whether a pass stopped because it
    passed over more than `MAX_PASSED_OVER` (it then took one request more than it passed over and
    admitted: the one its check stopped at)."""

    def __init__(self) -> None:
        self.walked = self.passes = 0
        self.cut = False
        self._admit = base._admit

    def start_plan(self) -> None:
        self.walked = self.passes = 0
        self.cut = False

    def __enter__(self) -> Walked:
        def counted(snapshot, ordered, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            taken = 0

            def each():  # noqa: ANN202
                nonlocal taken
                for request in ordered:
                    taken += 1
                    yield request
            plan = self._admit(snapshot, each(), *args, **kwargs)
            self.walked += taken
            self.passes += 1
            admitted = len(plan.assignments) if plan is not None else 0
            self.cut |= plan is not None and taken - admitted - 1 > base.MAX_PASSED_OVER
            return plan
        base._admit = counted
        return self

    def __exit__(self, *exc: object) -> None:
        base._admit = self._admit


def measure(queue: RequestQueue, workers: tuple[WorkerLoad, ...], plans: int, rng: random.Random,
            digest: hashlib._Hash) -> dict:
    policy = SeerPolicy()
    loads = {w.worker_id: w for w in workers}
    summary = OpenWorkers.of(workers, CHUNK)

    def snapshot(worker: WorkerLoad, wanted: int) -> Snapshot:
        return Snapshot(300.0, worker.worker_id, wanted, workers, queue, {}, {}, CHUNK, loads_index=loads,
                        open_summary=summary)

    policy.plan(snapshot(workers[0], 1))  # builds seer's index (a start-up cost, not a plan's)
    asks = [(workers[rng.randrange(len(workers))], rng.randint(1, 4)) for _ in range(plans)]
    times, walked, cut, lean, vain = [], [], 0, 0, 0
    for worker, wanted in asks:  # timed without the counting wrapper
        started = time.perf_counter()
        plan = policy.plan(snapshot(worker, wanted))
        times.append(time.perf_counter() - started)
        vain += not plan.assignments
        digest.update(repr(plan.assignments).encode())
    with Walked() as counter:
        for worker, wanted in asks:
            counter.start_plan()
            policy.plan(snapshot(worker, wanted))
            walked.append(counter.walked)
            cut += counter.cut
            lean += counter.passes > 1
    times.sort()
    return {"mean_ms": statistics.fmean(times) * 1e3, "p50_ms": times[len(times) // 2] * 1e3,
            "p99_ms": times[int(len(times) * 0.99)] * 1e3, "walked": statistics.fmean(walked),
            "cut": cut / plans, "lean": lean / plans, "vain": vain / plans}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queued", type=int, default=65_000)
    parser.add_argument("--workers", type=int, default=512)
    parser.add_argument("--plans", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--requeued", type=float, default=0.2,
                        help="share of the queued requests that ran a chunk before (their home: a random worker)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    queue = queue_of(rng, args.queued, args.workers, args.requeued)
    digest = hashlib.sha256()
    rows = {name: measure(queue, loads_of(rng, args.workers, room), args.plans, rng, digest)
            for name, room in ROOM_LEFT.items()}
    print(f"seer plans on {args.queued:,} queued requests, {args.workers} workers, {args.plans} plans a row "
          f"(MAX_PASSED_OVER {base.MAX_PASSED_OVER})")
    print("KV room left | mean ms | p50 ms | p99 ms | mean x loose | walked | past the cut | with a lean pass | "
          "gave nothing")
    print("---|---|---|---|---|---|---|---|---")
    for name, row in rows.items():
        print(f"{name} | {row['mean_ms']:.3f} | {row['p50_ms']:.3f} | {row['p99_ms']:.3f} | "
              f"{row['mean_ms'] / rows['loose']['mean_ms']:.1f} | {row['walked']:.0f} | {row['cut']:.0%} | "
              f"{row['lean']:.0%} | {row['vain']:.0%}")
    print(f"decisions digest {digest.hexdigest()[:16]}")


if __name__ == "__main__":
    main()
