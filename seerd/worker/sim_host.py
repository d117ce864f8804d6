"""Many simulated workers in one process: `python -m seerd.worker.sim_host --run-dir D --rank R
--count K` runs workers R..R+K-1 of a run on `--engine-api sim`.

Each is a `seerd.worker.worker.Worker`, exactly as a vLLM worker runs: its own HTTP client and
connections, registration, leases, reports, heartbeats, in-place continuations. Only its engine
is the simulator's model of one (`seerd.worker.sim_engine.SimEngine`). The local launcher starts
one such process per `SIM_WORKERS_PER_PROCESS` workers (seerd/launch/local.py).

At its end the process writes what its workers measured of the coordinator, the seconds of each
answered call by endpoint with the time it was sent (`CallTimings`), to `logs/sim-calls-R.json` (`tools/bench/load.py` reads them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import resource
import signal
import sys
from pathlib import Path

from seerd.event_loop import run_event_loop
from seerd.protocol import CONFIG
from seerd.rundir import RunDir, write_private
from seerd.worker.client import CallTimings, CoordinatorClient, CoordinatorGone, Retired
from seerd.worker.worker import LoadedWeights, Worker
from seerd.worker.sim_engine import start_sim_engine

log = logging.getLogger("seerd.worker.sim")

FILES_PER_WORKER = 4  # its connections to the coordinator (a long-poll lease, reports, heartbeats) and spare


def raise_open_files_limit(needed: int) -> int:
    """The soft limit on open files raised to `needed` where the hard limit allows; the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if wanted > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        soft = wanted
    if soft < needed:
        log.warning("open files limited to %d (hard limit), %d wanted: some workers may fail to connect",
                    soft, needed)
    return soft


async def serve(worker: Worker) -> int:
    """One worker's life, as `seerd.worker.main.amain` runs it (its engine is already up)."""
    try:
        await worker.run_to_end()
    except Retired as exc:  # alone among its neighbours: the others go on
        log.error("worker %s taken out by the coordinator: %s", worker.worker_id, exc)
        return 4
    finally:
        worker.engine.shutdown()
        await worker.client.close()
    return 4 if worker.fatal is not None else 0


async def host(run_dir: RunDir, first_rank: int, count: int, patience_s: float, address_timeout_s: float) -> int:
    raise_open_files_limit(64 + FILES_PER_WORKER * count)
    first = await CoordinatorClient.from_run_dir(run_dir, patience_s=patience_s, address_timeout_s=address_timeout_s)
    settings = await first.call_until_answered(CONFIG)
    await first.close()
    if settings.engine.api != "sim":
        log.error("this run's workers are vLLM engines (--engine-api %s): start them with python -m seerd.worker",
                  settings.engine.api)
        return 2
    timings = CallTimings()
    workers = []
    for rank in range(first_rank, first_rank + count):
        client = await CoordinatorClient.from_run_dir(run_dir, patience_s=patience_s, timings=timings)
        workers.append(Worker(client, start_sim_engine(settings.model_path, settings.engine, settings.seed, rank),
                              rank, LoadedWeights(settings.weights_version, 0.0)))
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, lambda name=signal.Signals(signum).name: [w.stop(name) for w in workers])
    try:
        codes = await asyncio.gather(*(serve(worker) for worker in workers))
    finally:
        write_private(run_dir.logs / f"sim-calls-{first_rank}.json", json.dumps(timings.calls))
    log.info("%d simulated workers done: %d chunks", count, sum(w.stats.chunks_done for w in workers))
    return max(codes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m seerd.worker.sim_host",
                                     description="seerd workers on simulated engines, many in one process")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--rank", type=int, default=0, help="the first worker's rank")
    parser.add_argument("--count", type=int, default=1, help="workers in this process")
    parser.add_argument("--patience", type=float, default=60.0)
    parser.add_argument("--wait-for-coordinator", type=float, default=120.0, metavar="SECONDS")
    args = parser.parse_args(argv)
    if args.count < 1:
        parser.error("--count must be at least 1")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return run_event_loop(host(RunDir(Path(args.run_dir).resolve()), args.rank, args.count, args.patience,
                                   args.wait_for_coordinator))
    except CoordinatorGone as exc:
        log.error("%s", exc)
        return 3


if __name__ == "__main__":
    sys.exit(main())
