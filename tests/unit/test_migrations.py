"""Migrations: one head, upgrade from empty, and the ORM models match the migrated schema."""

from __future__ import annotations

import fnmatch
import sqlite3
import tomllib
from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

import seerd.migrations
from seerd.db import Base, make_engine
from seerd.db.migrate import current_revision, head_revisions, upgrade
from tests.unit.helpers import make_book


def test_there_is_exactly_one_head():
    assert len(head_revisions()) == 1


def test_upgrade_from_empty_reaches_head_and_matches_the_models(tmp_path):
    engine = make_engine(tmp_path / "state.db")
    assert current_revision(engine) is None
    upgrade(engine)
    assert current_revision(engine) == head_revisions()[0]
    with engine.connect() as connection:
        diff = compare_metadata(MigrationContext.configure(connection), Base.metadata)
    assert diff == [], f"models and migrations differ: {diff}"
    assert set(inspect(engine).get_table_names()) >= {
        "rollouts", "prompt_groups", "requests", "chunks", "workers", "events", "alembic_version"}


def test_upgrade_is_idempotent_and_keeps_rows(tmp_path):
    book = make_book(tmp_path)
    upgrade(book.sessions.kw["bind"])
    with sqlite3.connect(tmp_path / "state.db") as raw:
        assert raw.execute("select count(*) from requests").fetchone()[0] == 4


def test_database_pragmas_and_file_mode(tmp_path):
    engine = make_engine(tmp_path / "state.db")
    upgrade(engine)
    with engine.connect() as connection:
        assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert connection.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert connection.exec_driver_sql("PRAGMA busy_timeout").scalar() >= 1000
    assert (tmp_path / "state.db").stat().st_mode & 0o777 == 0o600


def test_seerd_db_upgrade_command(tmp_path):
    from click.testing import CliRunner

    from seerd.cli.main import cli
    from seerd.rundir import RunDir

    RunDir(tmp_path / "run").create()
    make_engine(tmp_path / "run" / "state.db").dispose()  # an empty database, as an old seerd left it
    result = CliRunner().invoke(cli, ["db", "upgrade", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    assert f"empty -> {head_revisions()[0]}" in result.output
    again = CliRunner().invoke(cli, ["db", "upgrade", str(tmp_path / "run")])
    assert f"{head_revisions()[0]} -> {head_revisions()[0]}" in again.output


def test_rows_of_a_0001_database_survive_the_upgrade_to_head(tmp_path):
    """A run created by the first schema: its rows come through, and the new tables work."""
    engine = make_engine(tmp_path / "state.db")
    upgrade(engine, "0001")
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "insert into rollouts (id, status, policy, seed, model_path, input_path, input_sha256, config_json, "
            "created_at) values (1, 'running', 'divided', 0, 'm', 'in.jsonl', '00', '{}', 1.0)")
        conn.exec_driver_sql(
            "insert into prompt_groups (id, rollout_id, group_index, prompt_id, prompt_token_ids, prompt_len, "
            "prompt_hash, n, max_tokens, sampling_json, length_estimate, finished_requests) "
            "values (1, 1, 0, 'p0', x'01000000', 1, 'h', 2, 40, '{}', 40, 1)")
        conn.exec_driver_sql(
            "insert into requests (id, rollout_id, group_id, response_index, status, is_probe, generated_tokens, "
            "num_chunks, finish_reason, queued_at) values (1, 1, 1, 0, 'finished', 1, 12, 1, 'stop', 1.0), "
            "(2, 1, 1, 1, 'queued', 0, 0, 0, null, 1.0)")
    upgrade(engine)
    assert current_revision(engine) == head_revisions()[0]
    with engine.begin() as conn:
        assert conn.exec_driver_sql(
            "select id, status, generated_tokens, finish_reason from requests order by id").all() == [
            (1, "finished", 12, "stop"), (2, "queued", 0, None)]
        assert conn.exec_driver_sql("select length_estimate from prompt_groups").scalar() == 40
        # 0007: the rollout row came through the new column (a copy of rollouts would have taken every
        # other table's rows with it); no fingerprint until the next coordinator start records one.
        assert conn.exec_driver_sql("select id, status, model_path, model_fingerprint from rollouts").all() == [
            (1, "running", "m", None)]
        conn.exec_driver_sql("""update rollouts set model_fingerprint = '{"version": 1, "files": {}}'""")
        assert conn.exec_driver_sql("select model_fingerprint from rollouts").scalar() == '{"version": 1, "files": {}}'
        # 0005: no forecast until the coordinator writes one.
        assert conn.exec_driver_sql("select forecast_tokens from prompt_groups").scalar() is None
        conn.exec_driver_sql("update prompt_groups set forecast_tokens = 36 where id = 1")
        assert conn.exec_driver_sql("select forecast_tokens from prompt_groups").scalar() == 36
        conn.exec_driver_sql("insert into request_targets (request_id, target_length) values (2, 30)")
        conn.exec_driver_sql("delete from requests where id = 2")  # targets go with their request
        assert conn.exec_driver_sql("select count(*) from request_targets").scalar() == 0
        conn.exec_driver_sql("insert into prompt_length_history (rollout_id, prompt_hash, age, length) "
                             "values (1, 'h', 1, 12)")
        conn.exec_driver_sql("delete from rollouts where id = 1")  # history goes with its rollout
        assert conn.exec_driver_sql("select count(*) from prompt_length_history").scalar() == 0


def test_migrations_are_the_top_level_directory_installed_under_seerd():
    repo = Path(__file__).resolve().parents[2]
    assert Path(seerd.migrations.__file__).resolve().parent == repo / "migrations"
    packaging = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = packaging["packages"]["find"]["include"]
    assert not any(fnmatch.fnmatch("migrations", pattern) for pattern in patterns), patterns  # no top-level package


def downgrade(engine, revision: str) -> None:  # noqa: ANN001
    from alembic import command

    from seerd.db.migrate import alembic_config

    config = alembic_config(engine)
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.downgrade(config, revision)


def test_downgrading_past_the_forecast_column_keeps_the_runs_rows(tmp_path):
    """0005's downgrade drops the column in place: a batch copy of prompt_groups would drop the old
    table, and with foreign keys on that deletes every request (ON DELETE CASCADE)."""
    book = make_book(tmp_path)
    engine = book.sessions.kw["bind"]
    with engine.begin() as conn:
        conn.exec_driver_sql("update prompt_groups set forecast_tokens = 30")
    downgrade(engine, "0004")
    assert current_revision(engine) == "0004"
    with engine.connect() as conn:
        assert conn.exec_driver_sql("select count(*) from requests").scalar() == 4
        assert conn.exec_driver_sql("select count(*) from prompt_groups").scalar() == 2
        columns = {row[1] for row in conn.exec_driver_sql("pragma table_info(prompt_groups)")}
    assert "forecast_tokens" not in columns


def test_downgrading_past_the_model_fingerprint_keeps_the_runs_rows(tmp_path):
    """0007's downgrade drops the column in place: every table refers to rollouts ON DELETE CASCADE,
    so a batch copy of rollouts would empty the whole run."""
    book = make_book(tmp_path)
    engine = book.sessions.kw["bind"]
    with engine.begin() as conn:
        conn.exec_driver_sql("""update rollouts set model_fingerprint = '{"version": 1, "files": {}}'""")
        events = conn.exec_driver_sql("select count(*) from events").scalar()
    downgrade(engine, "0006")
    assert current_revision(engine) == "0006"
    with engine.connect() as conn:
        assert conn.exec_driver_sql("select count(*) from rollouts").scalar() == 1
        assert conn.exec_driver_sql("select count(*) from requests").scalar() == 4
        assert conn.exec_driver_sql("select count(*) from events").scalar() == events > 0
        columns = {row[1] for row in conn.exec_driver_sql("pragma table_info(rollouts)")}
    assert "model_fingerprint" not in columns


def test_0008_drops_the_two_hot_indexes_and_its_downgrade_brings_them_back_with_the_rows(tmp_path):
    book = make_book(tmp_path)
    engine = book.sessions.kw["bind"]

    def indexes() -> set[str]:
        with engine.connect() as conn:
            return {name for (name,) in conn.exec_driver_sql("select name from sqlite_master where type = 'index'")}

    def rows() -> tuple[int, int]:
        with engine.connect() as conn:
            return tuple(conn.exec_driver_sql(f"select count(*) from {table}").scalar() for table in ("requests", "events"))

    before = rows()
    assert not {"ix_events_ts", "ix_chunks_request_id"} & indexes()
    downgrade(engine, "0007")
    assert {"ix_events_ts", "ix_chunks_request_id"} <= indexes() and rows() == before
    upgrade(engine)
    assert not {"ix_events_ts", "ix_chunks_request_id"} & indexes() and rows() == before
