"""The coordinator's memory projected at its start (coordinator/footprint.py): a run whose book
would not fit in the memory available is refused with what it needs, its state untouched."""

from __future__ import annotations

import logging

import pytest
from sqlalchemy import select

from seerd.coordinator import daemon
from seerd.coordinator.daemon import Coordinator
from seerd.coordinator.footprint import (
    BYTES_PER_REQUEST, PROCESS_BYTES, Footprint, NotEnoughMemory, check_footprint, mem_available_bytes, run_footprint,
)
from seerd.db import Rollout, make_engine
from seerd.ownership import take_ownership
from tests.unit.helpers import rows
from tests.unit.test_export_live import GROUPS, N, build_run

# The million requests: 125,000 groups of 8 with prompts of 1,024 tokens, on 1,000 workers.
MILLION = Footprint(requests=1_000_000, prompt_tokens=125_000 * 1024, workers=1000)


def test_a_million_requests_project_to_about_two_gib_as_measured_per_request():
    # The benchmark's 1.7-1.8 KB a request at this prompt length, and the process's 0.6 GB.
    assert 1_600 * 1_000_000 < MILLION.projected_bytes - PROCESS_BYTES < 1_850 * 1_000_000
    check_footprint(MILLION, available=8 << 30)  # fits: no error


def test_a_run_that_cannot_fit_is_refused_with_what_it_needs_and_one_that_barely_fits_warned(caplog):
    with pytest.raises(NotEnoughMemory, match=r"1,000,000 requests .* ~2\.\d GiB, and this machine has 1\.0 GiB"):
        check_footprint(MILLION, available=1 << 30)
    with caplog.at_level(logging.WARNING, logger="seerd.coordinator"):
        check_footprint(MILLION, available=3 << 30)
    assert "of the 3.0 GiB available" in caplog.text
    check_footprint(MILLION, available=None)  # unknown (no /proc/meminfo): no opinion


def test_the_coordinator_refuses_to_start_a_run_the_memory_cannot_hold_and_leaves_it_as_it_was(tmp_path, monkeypatch):
    rundir = build_run(tmp_path / "run")
    engine = make_engine(rundir.db_path)
    footprint = run_footprint(engine, 1, workers=2)
    assert footprint == Footprint(requests=GROUPS * N, prompt_tokens=sum(len(r.prompt_token_ids) for r in rows(groups=GROUPS)),
                                  workers=2)
    with engine.connect() as conn:
        before = conn.execute(select(Rollout.status, Rollout.started_at, Rollout.status_reason)).one()
    monkeypatch.setattr(daemon, "mem_available_bytes", lambda: PROCESS_BYTES + BYTES_PER_REQUEST)  # less than it needs
    with take_ownership(rundir.path) as ownership, pytest.raises(NotEnoughMemory, match="GiB available"):
        Coordinator(rundir, ownership)
    with engine.connect() as conn:
        assert conn.execute(select(Rollout.status, Rollout.started_at, Rollout.status_reason)).one() == before
    engine.dispose()


def test_this_machine_reports_the_memory_it_has_available():
    available = mem_available_bytes()
    assert available is not None and available > PROCESS_BYTES
