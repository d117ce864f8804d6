"""`db.base.Writer`: write transactions on a kept connection, checkpoints off the writer's path."""

from __future__ import annotations

import sqlite3

from sqlalchemy import text

from seerd.db.base import Writer, make_engine


def fill(tmp_path, checkpoint_bytes: int, inline_bytes: int, transactions: int = 400) -> tuple[Writer, int]:
    """A writer with these thresholds, after `transactions` small relaxed inserts; its WAL's size."""
    engine = make_engine(tmp_path / "state.db")
    with engine.begin() as conn:
        conn.execute(text("create table t (payload blob)"))
    writer = Writer(engine)
    writer.CHECKPOINT_WAL_BYTES, writer.INLINE_CHECKPOINT_WAL_BYTES, writer.CHECK_EVERY = checkpoint_bytes, inline_bytes, 1
    for _ in range(transactions):
        with writer.begin(durable=False) as conn:
            conn.connection.driver_connection.execute("insert into t values (?)", (b"x" * 2000,))
    if writer._checkpointer is not None:
        writer._checkpointer.join()
    wal = (tmp_path / "state.db-wal").stat().st_size
    writer.close()
    engine.dispose()
    with sqlite3.connect(tmp_path / "state.db") as db:
        assert db.execute("select count(*) from t").fetchone()[0] == transactions
    return writer, wal


def test_past_its_threshold_the_writer_checkpoints_on_a_thread_of_its_own(tmp_path):
    writer, _ = fill(tmp_path, checkpoint_bytes=64 << 10, inline_bytes=1 << 40)
    assert writer.checkpoints >= 1


def test_past_the_inline_bound_the_writer_checkpoints_itself_and_its_wal_is_reused(tmp_path):
    # No background thread here (the inline bound is reached first): each checkpoint completes
    # between two transactions, and the next one starts the WAL over. 400 transactions wrote
    # at least 1.6 MB of WAL frames; the file stays near the bound.
    writer, wal = fill(tmp_path, checkpoint_bytes=64 << 10, inline_bytes=64 << 10)
    assert writer._checkpointer is None and writer.checkpoints >= 10
    assert wal <= (64 << 10) + 4 * 4096


def test_the_writers_connection_takes_no_automatic_checkpoint(tmp_path):
    engine = make_engine(tmp_path / "state.db")
    writer = Writer(engine)
    with writer.begin(durable=False) as conn:
        assert conn.connection.driver_connection.execute("pragma wal_autocheckpoint").fetchone()[0] == 0
    writer.close()
    engine.dispose()


def test_a_wal_grown_past_the_inline_bound_shrinks_back_once_checkpoints_catch_up(tmp_path):
    engine = make_engine(tmp_path / "state.db")
    with engine.begin() as conn:
        conn.execute(text("create table t (payload blob)"))
    writer = Writer(engine)
    writer.CHECKPOINT_WAL_BYTES, writer.INLINE_CHECKPOINT_WAL_BYTES, writer.CHECK_EVERY = 64 << 10, 1 << 20, 1
    wal = tmp_path / "state.db-wal"

    def write(transactions: int) -> None:
        for _ in range(transactions):
            with writer.begin(durable=False) as conn:
                conn.connection.driver_connection.execute("insert into t values (?)", (b"x" * 2000,))
        if writer._checkpointer is not None:
            writer._checkpointer.join()

    reader = sqlite3.connect(tmp_path / "state.db", isolation_level=None)
    reader.execute("begin")
    reader.execute("select count(*) from t").fetchone()  # an old snapshot: no checkpoint can finish
    write(800)
    grown = wal.stat().st_size
    assert grown > 1 << 20  # a burst the checkpoints could not follow
    reader.execute("rollback")
    write(50)  # a checkpoint completes; the next transaction restarts the WAL, and it is cut back
    assert wal.stat().st_size < min(grown // 2, writer.INLINE_CHECKPOINT_WAL_BYTES)
    writer.close()
    engine.dispose()
    reader.close()
