"""Readers never block the writer: `seerd export` of a live run reads one snapshot read-only while
the real coordinator keeps committing; two exporters never leave a partial export over a complete
one; looking at a run (export, resume) never migrates its database."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from pathlib import Path

import pyarrow.parquet as pq
from click.testing import CliRunner

from seerd.cli.main import EXIT_BAD_INPUT, cli
from seerd.config import RunConfig
from seerd.coordinator.create import create_rollout
from seerd.coordinator.daemon import Coordinator
from seerd.db import RolloutStatus, make_engine, make_sessionmaker
from seerd.db.migrate import current_revision, head_revisions, upgrade
from seerd.io import export
from seerd.launch.prepare import read_rollout
from seerd.ownership import take_ownership
from seerd.rundir import RunDir
from seerd.worker.client import CoordinatorClient
from seerd.worker.worker import Worker
from tests.unit.helpers import VOCAB_SIZE, ScriptedEngine, rows, rollout_weights

GROUPS, N, MAX_TOKENS = 8, 2, 64


def build_run(run_dir: Path, revision: str = "head", **config: object) -> RunDir:
    """A created run, as `seerd run` leaves it before its coordinator starts, of a model directory
    that holds only the config.json the coordinator reads its vocabulary from; `config` overrides
    the run's settings."""
    model = run_dir.parent / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"vocab_size": VOCAB_SIZE, "max_position_embeddings": 4096}))
    rundir = RunDir(run_dir)
    rundir.create()
    engine = make_engine(rundir.db_path)
    upgrade(engine, revision)
    config = RunConfig(**{"input_path": "in.jsonl", "model_path": str(model), "policy": "divided", "chunk_tokens": 8,
                          "lease_ttl_s": 5.0, "workers": 2, **config})
    if revision == "head":
        with make_sessionmaker(engine).begin() as session:
            create_rollout(session, config, rows(groups=GROUPS, n=N, max_tokens=MAX_TOKENS), input_sha256="0" * 64,
                           now=time.time())
    else:  # the columns every schema has
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "insert into rollouts (id, status, policy, seed, model_path, input_path, input_sha256, config_json, "
                "created_at) values (1, 'interrupted', 'divided', 0, ?, 'in.jsonl', '00', ?, 1.0)",
                (str(model), json.dumps({"input_path": "in.jsonl", "model_path": str(model)})))
    engine.dispose()
    return rundir


def test_seerd_export_of_a_live_run_holds_a_snapshot_while_the_coordinator_commits(tmp_path, monkeypatch):
    rundir = build_run(tmp_path / "run")
    before = CliRunner().invoke(cli, ["export", str(rundir.path)])  # a run not started yet
    assert before.exit_code == 0 and f"PARTIAL export: 0 of {GROUPS * N}" in before.output
    coordinator = Coordinator(rundir, take_ownership(rundir.path), expected_workers=2)  # released when it stops
    state = coordinator.book.state
    held: dict = {}
    collect_rows = export.collect_rows

    def collect_then_hold(session, rollout_id):  # noqa: ANN001, ANN202
        rows, total = collect_rows(session, rollout_id)
        if held:  # the coordinator's own export at the end
            return rows, total
        # The export's read transaction stays open until the coordinator has committed more:
        # with the write lock held (as `seerd export` once did) it could commit nothing.
        committed = state.output_tokens
        deadline = time.monotonic() + 30
        while state.output_tokens < committed + 40 and not state.is_complete():
            assert time.monotonic() < deadline, "the coordinator committed nothing while the export read"
            time.sleep(0.01)
        held.update(rows=len(rows), total=total, committed_meanwhile=state.output_tokens - committed)
        return rows, total

    monkeypatch.setattr(export, "collect_rows", collect_then_hold)

    def length_of(request_id: int) -> int:
        return 40 + request_id % 24

    async def scenario():  # noqa: ANN202
        ready = asyncio.Event()
        serving = asyncio.create_task(coordinator.serve(on_ready=lambda _host, _port: ready.set()))
        await ready.wait()
        host, port = rundir.read_address()
        workers = [Worker(CoordinatorClient(f"http://{host}:{port}", rundir.read_secret()),
                          ScriptedEngine(length_of, max_chunks=2, pause_s=0.1), rank, rollout_weights(rundir))
                   for rank in (0, 1)]
        running = [asyncio.create_task(w.run()) for w in workers]
        while state.finished_requests < 1:
            await asyncio.sleep(0.01)
        exported = await asyncio.to_thread(CliRunner().invoke, cli, ["export", str(rundir.path)])
        await asyncio.gather(*running)
        for worker in workers:
            await worker.client.close()
        return exported, await serving

    exported, result = asyncio.run(scenario())
    assert exported.exit_code == 0, exported.output
    assert held["rows"] < held["total"] == GROUPS * N and held["committed_meanwhile"] > 0
    assert "PARTIAL export" in exported.output or "complete outputs are kept" in exported.output
    assert result.status == RolloutStatus.FINISHED and result.export.complete  # the run completed
    assert json.loads(rundir.meta_path.read_text())["complete"] is True  # the partial export did not win
    assert pq.read_table(rundir.parquet_path).num_rows == GROUPS * N


def test_a_partial_export_never_replaces_a_complete_one(tmp_path):
    rundir = RunDir(tmp_path)
    assert export.write_outputs(rundir, [], 2).written  # nothing finished yet: a partial export is written
    assert not json.loads(rundir.meta_path.read_text())["complete"]
    row = {"prompt_id": "p", "group_index": 0, "response_index": 0, "token_ids": [1], "logprobs": [-0.5],
           "finish_reason": "stop", "length": 1, "num_chunks": 1, "prompt_len": 3, "started_at": 1.0,
           "finished_at": 2.0, "generation_s": 1.0}
    complete = export.write_outputs(rundir, [row, {**row, "response_index": 1}], 2)
    assert complete.complete and complete.written
    late = export.write_outputs(rundir, [row], 2)  # a snapshot read before the run finished
    assert not late.written
    assert json.loads(rundir.meta_path.read_text())["complete"] is True
    assert pq.read_table(rundir.parquet_path).num_rows == 2


def test_looking_at_a_run_of_an_older_schema_never_migrates_it(tmp_path):
    rundir = build_run(tmp_path / "run", revision="0004")
    engine = make_engine(rundir.db_path)
    assert current_revision(engine) == "0004"

    assert read_rollout(rundir).status == RolloutStatus.INTERRUPTED  # what `seerd resume` looks at first
    result = CliRunner().invoke(cli, ["export", str(rundir.path)])
    assert result.exit_code == EXIT_BAD_INPUT
    assert "schema 0004" in result.output and "seerd db upgrade" in result.output
    assert current_revision(engine) == "0004"
    assert not list(rundir.path.glob("state.db.before-*"))
    engine.dispose()


def test_seerd_db_upgrade_copies_the_database_aside_and_removes_the_copy_once_migrated(tmp_path):
    rundir = build_run(tmp_path / "run", revision="0004")
    writer = sqlite3.connect(rundir.db_path)  # open: what it commits stays in the -wal, unmerged
    writer.execute("update rollouts set status_reason = 'in the wal' where id = 1")
    writer.commit()
    assert Path(f"{rundir.db_path}-wal").stat().st_size > 0
    result = CliRunner().invoke(cli, ["db", "upgrade", str(rundir.path)])
    writer.close()
    assert result.exit_code == 0, result.output
    assert f"0004 -> {head_revisions()[0]}" in result.output
    assert not list(rundir.path.glob("state.db.before-*"))  # removed once the migration committed
    with sqlite3.connect(rundir.db_path) as db:
        assert db.execute("select status_reason from rollouts").fetchone() == ("in the wal",)


def test_a_failed_migration_keeps_the_copy_taken_before_it(tmp_path, monkeypatch):
    from seerd.db import migrate

    rundir = build_run(tmp_path / "run", revision="0004")
    writer = sqlite3.connect(rundir.db_path)
    writer.execute("update rollouts set status_reason = 'in the wal' where id = 1")
    writer.commit()
    real_upgrade = migrate.command.upgrade

    def upgrade_then_fail(config, revision):  # noqa: ANN001, ANN202
        real_upgrade(config, revision)  # the schema changed inside the transaction...
        raise RuntimeError("disk full")  # ...and then the migration failed

    monkeypatch.setattr(migrate.command, "upgrade", upgrade_then_fail)
    result = CliRunner().invoke(cli, ["db", "upgrade", str(rundir.path)])
    writer.close()
    assert result.exit_code == 1
    (copy,) = rundir.path.glob("state.db.before-0004-*")
    assert "disk full" in result.output and copy.name in result.output.replace("\n", "")
    assert copy.stat().st_mode & 0o777 == 0o600
    assert not Path(f"{copy}-wal").exists()  # one self-contained file, the -wal's pages in it
    for path in (copy, rundir.db_path):  # the copy, and the database rolled back, both as they were
        with sqlite3.connect(path) as db:
            assert db.execute("select version_num from alembic_version").fetchone() == ("0004",)
            assert db.execute("select status_reason from rollouts").fetchone() == ("in the wal",)


def test_the_coordinator_migrates_at_start_through_the_same_copy(tmp_path):
    rundir = build_run(tmp_path / "run", revision="0004")
    with take_ownership(rundir.path) as ownership:
        coordinator = Coordinator(rundir, ownership)
        assert current_revision(coordinator.engine) == head_revisions()[0]
        coordinator.engine.dispose()
    assert not list(rundir.path.glob("state.db.before-*"))
