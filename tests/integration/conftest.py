"""Fixtures of the integration tests that need a service running: the single-node Slurm cluster."""

from __future__ import annotations

import pytest

from tests.integration.slurm_harness import dev_slurm


@pytest.fixture(scope="session")
def slurm_cluster():
    """The single-node cluster, started (and installed) if needed; stopped afterwards if it was not
    running before. A cluster that cannot start fails every Slurm test: they never skip."""
    was_running = dev_slurm("status", timeout=60).returncode == 0
    started = dev_slurm("start", timeout=1200)
    if started.returncode != 0:
        pytest.fail(f"the Slurm test cluster did not start (tools/dev-slurm.sh start exited "
                    f"{started.returncode}):\n{started.stdout[-3000:]}\n{started.stderr[-3000:]}", pytrace=False)
    yield
    if not was_running:
        stopped = dev_slurm("stop", timeout=300)
        assert stopped.returncode == 0, stopped.stderr
