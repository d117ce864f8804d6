"""The start-up gate (`--wait-for-workers`, and always for `group`): no work until every expected
worker registered; once open it stays open. It used to close again whenever a worker was taken out
or went silent mid-run, so the live workers got nothing until a replacement registered (a run of
tests/integration/test_stuck_engines.py left its requests queued for 24 s that way)."""

from __future__ import annotations

import pytest

from seerd.coordinator.daemon import Coordinator
from seerd.ownership import take_ownership
from tests.unit.helpers import rollout_weights
from tests.unit.test_export_live import build_run


@pytest.mark.parametrize("settings", [{"policy": "divided", "wait_for_workers": True}, {"policy": "group"}],
                         ids=["wait-for-workers", "group"])
def test_the_gate_opens_when_every_worker_came_and_stays_open_when_one_goes_silent(tmp_path, settings):
    rundir = build_run(tmp_path / "run", **settings)
    now = [1000.0]
    with take_ownership(rundir.path) as ownership:
        coordinator = Coordinator(rundir, ownership, expected_workers=2, clock=lambda: now[0])
        try:
            book = coordinator.book
            book.load(now[0])
            weights = rollout_weights(rundir).version

            def register(rank: int) -> str:
                return book.register(rank=rank, address=f"h:{rank}", max_chunks=4, kv_capacity_tokens=10_000,
                                     worker_id=f"w{rank}", now=now[0], weights_version=weights).id

            first = register(0)
            assert not coordinator._gate(), "one of two workers: no work yet"
            register(1)
            assert coordinator._gate()
            now[0] += 100.0  # the second worker falls silent: stale, no longer alive
            book.heartbeat(first, [], now[0])
            book.expire(now[0])
            assert book.live_count == 1
            assert coordinator._gate(), "a worker lost mid-run must not stop the others"
            assert book.lease(first, 4, now[0]), "the live worker takes the work"
        finally:
            coordinator.engine.dispose()
