"""`seerd status`: the snapshot read from a real run database (the lease book writes it, with a
synthetic engine: tokens are made up here), the frame it renders, and the command line.

The frame is pinned in tests/unit/reference/status_frame.txt. After an intended change:
SEERD_UPDATE_REFERENCE=1 pytest tests/unit/test_status.py, then review the diff.
"""

from __future__ import annotations

import json
import os
import stat
import threading
from io import StringIO
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console

from seerd.cli.main import cli
from seerd.db import RolloutStatus
from seerd.protocol import ChunkReport
from seerd.status.locate import record_slurm_job, resolve_run
from seerd.status.render import pool_line, render
from seerd.status.snapshot import UnknownRun, read_snapshot
from seerd.worker.engine import EngineLive
from seerd.worker.stats import WorkerStats
from tests.unit.helpers import make_book, rows

REFERENCE = Path(__file__).parent / "reference" / "status_frame.txt"
REQUIRED = {"state": str, "requests_total": int, "requests_done": int, "output_tokens": int, "tail": list,
            "workers": list, "policy": str, "groups_total": int, "groups_done": int, "elapsed_s": float,
            "tail_total": int, "coordinator": dict}


def register(book, name, rank, now=1000.0, max_chunks=4):
    return book.register(rank=rank, address="test", max_chunks=max_chunks, kv_capacity_tokens=1000,
                         worker_id=name, now=now).id


def report(grant, n, reason="length"):
    return ChunkReport(grant.chunk_id, grant.epoch, [7] * n, [-1.0] * n, reason)


def synthetic_run(tmp_path):
    """3 groups x 2 responses, chunk 16, two workers; at t=1010 one group done, some running."""
    book = make_book(tmp_path, policy="seer", chunk_tokens=16, prompt_rows=rows(groups=3, n=2, max_tokens=64),
                     first_chunk_spread=0.0)  # whole first chunks on both workers: the counts below
    book.set_rollout_status(RolloutStatus.RUNNING, 1000.0)
    a, b = register(book, "wa", 0), register(book, "wb", 1)
    grants = book.lease(a, 4, now=1001.0) + book.lease(b, 4, now=1001.0)
    assert len(grants) == 6
    by_request = {g.request_id: g for g in grants}
    first, second = sorted(by_request)[:2]  # group 0's two responses
    for rid in (first, second):
        grant = by_request[rid]
        holder = a if grant in grants[:4] else b
        book.report(holder, report(grant, 5 + rid, "stop"), now=1003.0)
    # The rest report a full chunk and are leased again: two chunks each, the second running.
    for grant in grants:
        if grant.request_id in (first, second):
            continue
        holder = a if grant in grants[:4] else b
        book.report(holder, report(grant, 16), now=1004.0)
    again = book.lease(a, 4, now=1005.0) + book.lease(b, 4, now=1005.0)
    return book, a, b, again


def test_snapshot_counts_progress_tail_and_workers_synthetic_engine(tmp_path):
    book, a, b, running = synthetic_run(tmp_path)
    # Worker a says how far its running chunks are (what heartbeats carry); b has been silent.
    held_by_a = [g for g in running if g.chunk_id in book.state.workers[a].chunks]
    live = {str(g.chunk_id): {"tokens": 3 + i, "changed_at": 1008.0} for i, g in enumerate(held_by_a)}
    book.heartbeat(a, [g.chunk_id for g in held_by_a], now=1009.0,
                   stats={"tokens_per_s_recent": 12.5, "kv_usage": 0.25, "running": live, "chunks_done": 4,
                          "tokens_out": 60})
    book.persist_soft_state()  # what the daemon's tick does: heartbeats are soft state
    snap = read_snapshot(tmp_path, now=1010.0)
    for key, kind in REQUIRED.items():
        assert isinstance(snap[key], kind), key
    assert (snap["state"], snap["requests_total"], snap["requests_done"]) == ("running", 6, 2)
    assert (snap["groups_total"], snap["groups_done"]) == (3, 1)
    committed = sum(r.generated for r in book.state.requests.values())
    in_flight = sum(e["tokens"] for e in live.values())
    assert snap["output_tokens_committed"] == committed
    assert snap["output_tokens"] == committed + in_flight
    assert snap["tail_total"] == len(running) == 4
    tail = snap["tail"]
    assert [t["tokens"] for t in tail] == sorted((t["tokens"] for t in tail), reverse=True)
    for t in tail:
        chunk = next(g for g in running if g.request_id == t["request_id"])
        extra = live.get(str(chunk.chunk_id), {}).get("tokens", 0)
        assert t["tokens"] == 16 + extra and t["chunks"] == 2
        assert t["worker"] == (a if chunk.chunk_id in book.state.workers[a].chunks else b)
        assert t["since_progress_s"] == pytest.approx(2.0 if extra else 5.0)  # live change, else lease
    workers = {w["worker_id"]: w for w in snap["workers"]}
    assert workers[a]["tokens_per_s"] == 12.5 and workers[a]["kv_usage"] == 0.25
    assert workers[b]["tokens_per_s"] is None
    for wid in (a, b):
        assert workers[wid]["kv_reserved_tokens"] == book.state.workers[wid].kv_reserved
        assert workers[wid]["running_chunks"] == len(book.state.workers[wid].chunks)
    # b's last heartbeat was its registration at 1000: 10 s > 3 heartbeat intervals (2 s each).
    assert not workers[a]["stale"] and workers[b]["stale"]
    assert snap["tokens_per_s_now"] == 12.5  # the live workers' own rates
    assert snap["eta_s"] is not None and snap["eta_s"] > 0
    assert snap["tail_phase"] is None  # 2 of 6 done
    assert snap["coordinator"] == {"reachable": False}
    json.dumps(snap)  # what --json prints


def test_time_left_counts_each_request_up_to_its_groups_persisted_forecast_synthetic_engine(tmp_path):
    """Expected remaining tokens: per unfinished request, its group's `forecast_tokens` (what the
    coordinator persists) less its tokens so far, never below 0; the length estimate while the
    coordinator has written no forecast, and in a database from before the column (0004)."""
    from alembic import command
    from sqlalchemy import update

    from seerd.db import Group, make_engine
    from seerd.db.migrate import alembic_config

    book, a, _, running = synthetic_run(tmp_path)
    held_by_a = [g for g in running if g.chunk_id in book.state.workers[a].chunks]
    live = {str(g.chunk_id): {"tokens": 2 + i, "changed_at": 1008.0} for i, g in enumerate(held_by_a)}
    book.heartbeat(a, [g.chunk_id for g in held_by_a], now=1009.0,
                   stats={"tokens_per_s_recent": 10.0, "running": live})
    book.persist_soft_state()  # what the daemon's tick does: heartbeats are soft state

    def expected_remaining(snap, forecast_by_group_index):
        # Every unfinished request is running here, so the tail lists them all with their tokens so far.
        assert snap["tail_total"] == len(snap["tail"]) == snap["requests_total"] - snap["requests_done"]
        return sum(max(0, forecast_by_group_index[t["group_index"]] - t["tokens"]) for t in snap["tail"])

    snap = read_snapshot(tmp_path, now=1010.0)
    assert {t["tokens"] for t in snap["tail"]} >= {16, 18}  # some with live progress, some without
    no_forecast = expected_remaining(snap, {1: 64, 2: 64})  # length_estimate = max_tokens: none finished
    assert snap["output_tokens_expected"] == snap["output_tokens"] + no_forecast
    assert snap["eta_s"] == pytest.approx(no_forecast / 10.0)

    engine = make_engine(tmp_path / "state.db", synchronous="NORMAL")
    with engine.begin() as conn:  # as the coordinator writes them
        conn.execute(update(Group).where(Group.group_index == 1).values(forecast_tokens=17))
        conn.execute(update(Group).where(Group.group_index == 2).values(forecast_tokens=40))
    snap = read_snapshot(tmp_path, now=1010.0)
    forecast = expected_remaining(snap, {1: 17, 2: 40})
    assert 0 < forecast < no_forecast
    assert snap["output_tokens_expected"] == snap["output_tokens"] + forecast
    assert snap["eta_s"] == pytest.approx(forecast / 10.0)

    with engine.begin() as conn:  # every running request past its group's forecast: time left unknown
        conn.execute(update(Group).values(forecast_tokens=16))
    snap = read_snapshot(tmp_path, now=1010.0)
    assert snap["output_tokens_expected"] == snap["output_tokens"] and snap["eta_s"] is None

    config = alembic_config(engine)
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.downgrade(config, "0004")
    engine.dispose()
    snap = read_snapshot(tmp_path, now=1010.0)
    assert snap["output_tokens_expected"] == snap["output_tokens"] + no_forecast


def test_tail_phase_starts_at_the_finish_that_passes_90_percent_synthetic_engine(tmp_path):
    book = make_book(tmp_path, policy="divided", chunk_tokens=16, prompt_rows=rows(groups=5, n=2, max_tokens=16))
    book.set_rollout_status(RolloutStatus.RUNNING, 1000.0)
    w = register(book, "w", 0, max_chunks=10)
    grants = book.lease(w, 10, now=1000.0)
    assert len(grants) == 10
    for i, grant in enumerate(sorted(grants, key=lambda g: g.request_id)):
        book.report(w, report(grant, 4, "stop"), now=1001.0 + i)  # finishes at 1001 ... 1010
        snap = read_snapshot(tmp_path, now=1020.0)
        if i < 8:
            assert snap["tail_phase"] is None
    assert snap["tail_phase"] == {"started_at": 1009.0, "duration_s": 1.0, "requests_left": 0}


def test_render_is_pinned_as_text(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "80")
    buffer = StringIO()
    Console(file=buffer).print(render(hand_made_snapshot()))
    frame = buffer.getvalue()
    if os.environ.get("SEERD_UPDATE_REFERENCE"):
        REFERENCE.write_text(frame)
    assert frame == REFERENCE.read_text()
    assert max(len(line) for line in frame.splitlines()) <= 80


def test_a_running_run_whose_coordinator_is_gone_says_how_to_go_on(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "80")
    buffer = StringIO()
    Console(file=buffer).print(render({**hand_made_snapshot(), "coordinator": {"reachable": False}}))
    assert "coordinator unreachable" in buffer.getvalue()
    assert "`seerd resume` continues the run" in buffer.getvalue()


def hand_made_snapshot() -> dict:
    tail = [{"request_id": 40 + i, "group_index": g, "response_index": r, "probe": r == 0, "tokens": tokens,
             "chunks": chunks, "worker": worker, "group_estimate": est, "group_finished": done, "group_size": 8,
             "since_progress_s": idle}
            for i, (g, r, tokens, chunks, worker, est, done, idle) in enumerate([
                (12, 0, 14_210, 4, "w1-gpu02", 16_384, 0, 1.2), (12, 5, 12_003, 3, "w0-gpu01", 16_384, 0, 0.4),
                (31, 2, 9_876, 3, "w1-gpu02", 8_200, 6, 75.0)])]
    worker = {"state": "alive", "max_chunks": 256, "kv_capacity_tokens": 1_200_000, "chunks_done": 0,
              "tokens_out": 0, "spec": None}
    return {
        "schema": 1, "run_dir": "/runs/it7", "rollout_id": 1, "policy": "seer", "state": "running",
        "state_reason": None, "now": 0.0, "created_at": 0.0, "finished_at": None, "elapsed_s": 3725.0,
        "eta_s": 412.0, "tokens_per_s_now": 21_345.6, "tokens_per_s_avg": 30_120.0,
        "groups_total": 400, "groups_done": 371, "requests_total": 3200, "requests_done": 2930,
        "requests_running": 3, "output_tokens": 61_234_567, "output_tokens_committed": 61_200_000,
        "output_tokens_expected": 66_000_000,
        "tail_phase": {"started_at": 0.0, "duration_s": 190.0, "requests_left": 270},
        "tail": tail, "tail_total": 270,
        "workers": [
            {**worker, "worker_id": "w0-gpu01", "rank": 0, "heartbeat_age_s": 0.8, "stale": False,
             "running_chunks": 1, "kv_reserved_tokens": 300_000, "kv_usage": 0.21, "tokens_per_s": 11_000.0,
             "spec": {"drafted": 1000, "accepted": 640, "acceptance": 0.64}},
            {**worker, "worker_id": "w1-gpu02", "rank": 1, "heartbeat_age_s": 14.0, "stale": True,
             "running_chunks": 2, "kv_reserved_tokens": 900_000, "kv_usage": None, "tokens_per_s": None},
        ],
        "coordinator": {"reachable": True, "accepting": True, "leases": 3},
    }


def test_status_command_once_json_and_unknown_runs_synthetic_engine(tmp_path, monkeypatch):
    synthetic_run(tmp_path)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))  # a job id cannot be asked of scontrol
    runner = CliRunner()
    result = runner.invoke(cli, ["status", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    snap = json.loads(result.output)
    assert snap["requests_total"] == 6 and snap["state"] == "running"
    once = runner.invoke(cli, ["status", str(tmp_path), "--once"])
    assert once.exit_code == 0 and "running requests, longest first (4)" in once.output
    for target in (str(tmp_path / "nope"), "987654"):
        bad = runner.invoke(cli, ["status", target, "--once"])
        assert bad.exit_code == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UnknownRun, match="no seerd run"):
        read_snapshot(empty)
    (empty / "state.db").write_bytes(b"not a database" * 100)
    unreadable = runner.invoke(cli, ["status", str(empty), "--json"])
    assert unreadable.exit_code == 3 and "cannot read" in unreadable.output


def test_a_slurm_job_id_finds_its_run_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    record_slurm_job("4242", run_dir)
    assert resolve_run("4242") == run_dir.resolve()
    entry = tmp_path / "state" / "seerd" / "slurm-jobs" / "4242"
    assert stat.S_IMODE(entry.stat().st_mode) == 0o600
    assert stat.S_IMODE(entry.parent.stat().st_mode) == 0o700


def test_worker_stats_count_a_finished_chunk_once():
    clock = FakeTime()
    stats = WorkerStats(clock=clock)
    live = EngineLive(at=0.0, kv_usage=0.5, progress={"c1e1": 10, "c2e1": 4})
    first = stats.payload({1: ("c1e1", 0), 2: ("c2e1", 0)}, live)
    assert first["running"] == {"1": {"tokens": 10, "changed_at": 100.0}, "2": {"tokens": 4, "changed_at": 100.0}}
    clock.now = 105.0
    stats.chunk_done(1, 16)  # done, its report not yet through: the worker still lists it
    later = stats.payload({1: ("c1e1", 0), 2: ("c2e1", 0)}, EngineLive(at=5.0, kv_usage=0.4, progress={"c2e1": 4}))
    assert set(later["running"]) == {"2"} and later["running"]["2"]["changed_at"] == 100.0  # no progress
    # In flight 14 -> 16 done + 4 in flight over 5 s: 6 tokens / 5 s.
    assert later["tokens_per_s_recent"] == pytest.approx(6 / 5)
    assert later["tokens_out"] == 16 and later["kv_usage"] == 0.4
    assert stats.payload({2: ("c2e1", 0)}, None)["kv_usage"] is None  # an engine that shows nothing


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_reading_status_in_a_loop_never_blocks_or_fails_the_writer_synthetic_engine(tmp_path):
    """The coordinator's writes (lease, report, heartbeat: real SQLite, WAL) go on while a status
    reader loops: neither side sees "database is locked". How long writes take with and without a
    reader is measured by tools/bench/status_reader.py, not here."""
    book = make_book(tmp_path, policy="seer", chunk_tokens=4, prompt_rows=rows(groups=20, n=4, max_tokens=48))
    w = register(book, "w", 0)
    errors: list[BaseException] = []
    frames = 0
    stop = threading.Event()

    def reader() -> None:
        nonlocal frames
        while not stop.is_set():
            try:
                read_snapshot(tmp_path, now=2000.0)
                frames += 1
            except BaseException as exc:  # noqa: BLE001 - any failure is the finding
                errors.append(exc)
                return

    thread = threading.Thread(target=reader)
    thread.start()
    now = 1000.0
    try:
        while not book.is_complete():
            now += 1.0
            grants = book.lease(w, 16, now=now)
            book.heartbeat(w, [g.chunk_id for g in grants], now=now, stats={"tokens_per_s_recent": 1.0})
            book.persist_soft_state()
            book.report_many(w, [report(g, g.max_tokens) for g in grants], now=now)
    finally:
        stop.set()
        thread.join()
    assert not errors, errors
    assert frames > 0
    assert read_snapshot(tmp_path)["requests_done"] == 80


def test_kv_pool_figures_show_per_worker_and_for_the_pool(monkeypatch):
    from seerd.status.snapshot import _pool_part

    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "140")
    part = _pool_part({"lookup_blocks": 40, "hit_blocks": 30, "blocks_loaded": 30, "blocks_saved": 55,
                       "bytes_loaded": 15_000_000, "bytes_saved": 27_500_000, "load_failures": 1,
                       "reconnects": 1, "generation": 2})
    assert part["hit_rate"] == 0.75 and part["connected"]
    snapshot = hand_made_snapshot()
    snapshot["workers"][0]["kv_pool"] = part
    snapshot["coordinator"]["kv_pool"] = {"bytes_used": 1_200_000_000, "capacity_bytes": 4_000_000_000,
                                          "keys": 2345, "restarts": 1, "trimmed_requests": 3,
                                          "trimmed_bytes": 21_000_000, "evicted_keys": 0}
    buffer = StringIO()
    Console(file=buffer, width=140).print(render(snapshot))
    text = buffer.getvalue()
    assert "pool hit" in text and "75%" in text and "30/55 (1 bad)" in text and "42.5 MB" in text
    assert "KV pool 1.2 GB of 4.0 GB   2345 blocks   trimmed 3 queued (21.0 MB)   restarted 1x" in text
    worker_line = next(line for line in text.splitlines() if "w1-gpu02" in line and "stale" not in line
                       and "ago" in line)
    assert worker_line.split()[-3:] == ["-", "-", "-"]  # no pool figures from that worker yet
    snapshot["coordinator"]["kv_pool"]["evicted_keys"] = 6
    assert "trimmed 3 queued (21.0 MB)   evicted 6 blocks   restarted 1x" in str(pool_line(snapshot))
    snapshot["workers"][0]["kv_pool"] = {**part, "load_failures": 3, "blocks_rejected": 2}
    buffer = StringIO()
    Console(file=buffer, width=160).print(render(snapshot))
    assert "30/55 (3 bad, 2 failed MAC)" in buffer.getvalue()


def test_the_snapshot_reader_imports_neither_the_scheduler_nor_the_coordinator():
    """Status reads the coordinator's persisted forecast; it never runs the scheduler's code."""
    import subprocess
    import sys

    code = ("import sys, seerd.status.snapshot, seerd.db.read; "
            "print(sorted(m for m in sys.modules if m.startswith(('seerd.scheduler', 'seerd.coordinator'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
