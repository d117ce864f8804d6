"""A stopping coordinator answers its long-polling lease calls at once, not at their deadline
(`protocol.LEASE_LONG_POLL_S`): a real coordinator (HTTP on loopback, SQLite) and a client."""

from __future__ import annotations

import asyncio
import time

from seerd import protocol
from seerd.coordinator.daemon import Coordinator
from seerd.ownership import take_ownership
from seerd.protocol import LeaseBody, RegisterBody
from seerd.worker.client import CoordinatorClient
from tests.unit.helpers import rollout_weights
from tests.unit.test_export_live import build_run
from tests.unit.test_stale_address import serving


def test_a_stopping_coordinator_answers_its_long_polling_lease_calls_at_once(tmp_path):
    rundir = build_run(tmp_path / "run")
    with take_ownership(rundir.path) as ownership:
        coordinator = Coordinator(rundir, ownership, expected_workers=1)
        weights = rollout_weights(rundir)

        async def scenario() -> tuple:
            task, ready = serving(coordinator)
            await ready.wait()
            client = await CoordinatorClient.from_run_dir(rundir, patience_s=30.0)
            registered = await client.call(protocol.REGISTER, RegisterBody(
                "w", 0, "x", max_chunks=1, kv_capacity_tokens=10_000, weights_version=weights.version))
            first = await client.call(protocol.LEASE, LeaseBody(registered.worker_id, 1))
            started = time.monotonic()
            polling = asyncio.create_task(client.call(
                protocol.LEASE, LeaseBody(registered.worker_id, 1, protocol.LEASE_LONG_POLL_S)))
            await asyncio.sleep(0.3)
            waited = not polling.done()  # its one slot is taken: nothing to give it, so it waits
            coordinator.request_stop("test over")
            reply = await polling
            took = time.monotonic() - started
            await client.close()
            await task
            return first, waited, reply, took

        first, waited, reply, took = asyncio.run(scenario())
    assert len(first.chunks) == 1 and waited
    assert reply.chunks == [] and not reply.done
    assert took < protocol.LEASE_LONG_POLL_S / 2, took  # answered when the stop came, not at its deadline
