"""A worker's last figures outlive the run: when the rollout is done each worker says goodbye with
its final figures, the coordinator waits for it and writes them before it retires the workers, so
`seerd status` of a finished run shows every chunk (and drafted token) however short the run was
next to the heartbeat interval. The real coordinator (HTTP on loopback, SQLite) and real workers
whose engines are scripted (no vLLM)."""

from __future__ import annotations

import asyncio

from seerd.coordinator.daemon import Coordinator
from seerd.db import RolloutStatus
from seerd.ownership import take_ownership
from seerd.status.snapshot import read_snapshot
from seerd.worker.client import CoordinatorClient
from seerd.worker.worker import Worker
from tests.unit.helpers import ScriptedEngine, rollout_weights
from tests.unit.test_export_live import build_run


def test_each_workers_final_figures_are_in_the_database_after_the_run(tmp_path):
    rundir = build_run(tmp_path / "run")
    coordinator = Coordinator(rundir, take_ownership(rundir.path), expected_workers=2)

    async def scenario():  # noqa: ANN202
        ready = asyncio.Event()
        serving = asyncio.create_task(coordinator.serve(on_ready=lambda _host, _port: ready.set()))
        await ready.wait()
        host, port = rundir.read_address()
        workers = [Worker(CoordinatorClient(f"http://{host}:{port}", rundir.read_secret()),
                          ScriptedEngine(lambda rid: 24 + rid % 16, max_chunks=2, pause_s=0.005), rank,
                      rollout_weights(rundir))
                   for rank in (0, 1)]

        async def run_then_leave(worker: Worker) -> None:  # what the worker process does (worker.main.amain)
            await worker.run()
            await worker.say_goodbye()

        await asyncio.gather(*(run_then_leave(w) for w in workers))
        for worker in workers:
            await worker.client.close()
        return workers, await serving

    workers, result = asyncio.run(scenario())
    assert result.status == RolloutStatus.FINISHED
    shown = {w["worker_id"]: w for w in read_snapshot(rundir.path)["workers"]}
    for worker in workers:
        assert worker.stats.chunks_done > 0
        assert shown[worker.worker_id]["chunks_done"] == worker.stats.chunks_done
        assert shown[worker.worker_id]["tokens_out"] == worker.stats.tokens_out
        assert shown[worker.worker_id]["state"] == "gone"
