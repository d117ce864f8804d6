"""A worker process (`python -m seerd.worker`): its engine started and warmed up, then a `Worker`
(`seerd.worker.worker`) per rollout: one for `seerd run`, one per batch under `seerd serve`, the
engine reloaded in place with each batch's weights. Exits 0 when done, 3 when the coordinator is
gone past the worker's patience, 4 when its engine died or the coordinator took it out."""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import os
import signal
import sys
import time
from pathlib import Path

from seerd.event_loop import run_event_loop
from seerd.kvpool.pool import reset_pool_stats
from seerd.protocol import BATCH_GROUPS_WAIT, CONFIG, CONFIG_AFTER_BATCH, Endpoint, EngineSettings
from seerd.rundir import RunDir
from seerd.settings import Sampling
from seerd.worker.client import CoordinatorClient, CoordinatorGone, Retired, WeightsMismatch
from seerd.worker.engine import Engine
from seerd.worker.engines import start_engine
from seerd.worker.worker import LoadedWeights, Worker

log = logging.getLogger("seerd.worker")


async def warm_up(engine: Engine) -> None:
    """One tiny request before registering: the engine's first step (lazy initialisation, seconds
    on some platforms) is paid before any chunk waits on it, and the step clock the coordinator
    judges progress by has its first figure. Not a seerd chunk id: no drafts, no KV pool."""
    await engine.run("seerd-warm-up", [1, 2, 3, 4], 2, Sampling(temperature=0.0))
    if engine.counters is not None:  # the engine's figures are of the rollout only
        engine.counters.reset()


async def amain(run_dir: RunDir, rank: int, patience_s: float, address_timeout_s: float = 120.0) -> int:
    client = await CoordinatorClient.from_run_dir(run_dir, patience_s=patience_s,
                                                  address_timeout_s=address_timeout_s)
    settings = await client.call_until_answered(CONFIG)  # under `seerd serve` between batches: its --model
    started = time.monotonic()
    engine = start_engine(settings.model_path, settings.engine, settings.seed, settings.spec, str(run_dir.path),
                          settings.kv_pool)
    await warm_up(engine)
    log.info("engine ready in %.1fs", time.monotonic() - started)
    weights = LoadedWeights(settings.weights_version, 0.0)
    worker: Worker | None = None
    stopping = asyncio.Event()  # a signal: between two batches of `seerd serve` too, not only in one

    def stop(name: str) -> None:
        stopping.set()
        if worker is not None:
            worker.stop(name)

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop, signal.Signals(signum).name)
    try:
        ran: int | None = None  # `seerd serve`: the batch this worker ran last
        while not stopping.is_set():
            if settings.serving and (settings.batch is None or settings.batch == ran):
                settings = await until_stopped(next_batch(client, ran), stopping)
                if settings is None:
                    break
            if settings.weights_version != weights.version:  # the engine stays up, loaded with the batch's
                weights = LoadedWeights(settings.weights_version, await engine.reload_weights(settings.model_path))
                log.info("loaded %s in %.2fs", weights.version, weights.reload_s)
            if engine.counters is not None:  # the figures are of a rollout only
                engine.counters.reset()
            reset_pool_stats()
            worker = Worker(client, engine, rank, weights)
            if stopping.is_set():  # during the reload
                break
            try:
                await worker.run_to_end()
            except WeightsMismatch as exc:  # `seerd serve` went on to a batch under other weights
                log.info("%s", exc)
            if worker.stopped_by or worker.fatal is not None or not settings.serving:
                break
            await worker.drop_engine_requests()
            ran = settings.batch
    except Retired as exc:  # its leases already run elsewhere; its engine may not stop politely
        log.error("exiting: the coordinator took this worker out: %s", exc)
        shutdown_within(engine, ENGINE_SHUTDOWN_S)
        logging.shutdown()
        os._exit(4)
    finally:
        engine.shutdown()
        await client.close()
    if worker is not None and worker.fatal is not None:
        log.error("exiting: %s", worker.fatal)
        return 4
    if worker is not None:
        log.info("done: %d chunks, %d tokens", worker.stats.chunks_done, worker.stats.tokens_out)
    return 0


async def until_stopped(waiting, stopping: asyncio.Event):  # noqa: ANN001, ANN201
    """`waiting`'s result, or None once `stopping` is set first (the wait is cancelled)."""
    wait, stop = asyncio.ensure_future(waiting), asyncio.ensure_future(stopping.wait())
    await asyncio.wait({wait, stop}, return_when=asyncio.FIRST_COMPLETED)
    stop.cancel()
    if not wait.done():
        wait.cancel()
        return None
    return wait.result()


BATCH_POLL_S = 0.2  # between two calls for the next batch when the serve answered at once
BATCH_WAIT_S = 5.0  # how long the serve may hold one


async def next_batch(client: CoordinatorClient, after: int | None) -> EngineSettings:
    """`seerd serve`: the engine settings of the next batch to run, one other than `after` (the
    serve holds the call until one is mounted: protocol.CONFIG_AFTER_BATCH)."""
    held = Endpoint("GET", f"{CONFIG.path}?{CONFIG_AFTER_BATCH}={-1 if after is None else after}"
                           f"&{BATCH_GROUPS_WAIT}={BATCH_WAIT_S}", None, EngineSettings)
    while True:
        settings = await client.call_until_answered(held)
        if not settings.serving or (settings.batch is not None and settings.batch != after):
            return settings
        await asyncio.sleep(BATCH_POLL_S)


ENGINE_SHUTDOWN_S = 10.0


def shutdown_within(engine, timeout_s: float) -> None:  # noqa: ANN001
    """Shut the engine down on a thread, waiting at most `timeout_s` (a stuck engine may never
    return); what is left is killed with the process (and its group, by the reaper)."""
    import threading

    stopper = threading.Thread(target=engine.shutdown, name="engine-shutdown", daemon=True)
    stopper.start()
    stopper.join(timeout_s)


def start_group_reaper(poll_s: float = 0.5) -> None:
    """Fork a watchdog that kills this worker's process group once the worker is gone.

    vLLM's engine-core processes never exit when their frontend dies (SIGKILL, or SIGTERM during
    engine start-up); they hold GBs of KV cache. Only done when the worker leads its own process
    group (local mode), so that nothing else is in the group.
    """
    worker_pid = os.getpid()
    if os.getpgid(0) != worker_pid:
        return
    if os.fork() != 0:
        return
    try:  # the watchdog: imports nothing, touches nothing of the worker's
        os.closerange(3, 256)
        while os.getppid() == worker_pid:
            time.sleep(poll_s)
        os.killpg(worker_pid, signal.SIGKILL)  # kills this watchdog last, with the rest
    finally:
        os._exit(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m seerd.worker", description="seerd worker (one vLLM engine)")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--patience", type=float, default=60.0,
                        help="seconds without an answer from the coordinator before giving up")
    parser.add_argument("--wait-for-coordinator", type=float, default=120.0, metavar="SECONDS",
                        help="how long to wait for the run directory's coordinator address file")
    args = parser.parse_args(argv)
    # Slurm's warning signal (`--signal`, submitit's USR2) reaches every job step; the coordinator
    # decides what a warning means (drain, requeue), so a worker keeps generating until told.
    for warning in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(warning, signal.SIG_IGN)
    start_group_reaper()
    # A native crash (SIGILL from a kernel this CPU cannot run, SIGSEGV) leaves the Python stack
    # that reached it in the log, which the supervisor quotes when it says how the worker ended.
    faulthandler.enable()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return run_event_loop(amain(RunDir(Path(args.run_dir).resolve()),
                                    args.rank, args.patience, args.wait_for_coordinator))
    except CoordinatorGone as exc:
        log.error("%s", exc)
        return 3


if __name__ == "__main__":
    sys.exit(main())
