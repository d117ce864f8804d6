"""`db.base.begin`: what the run redoes after a crash commits without waiting for the disk; what
is acknowledged waits for it. SQLite's `synchronous` levels: 1 NORMAL, 2 FULL."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from seerd.db import make_engine
from seerd.db.base import begin

NORMAL, FULL = 1, 2


def synchronous(conn) -> int:  # noqa: ANN001
    return conn.execute(text("PRAGMA synchronous")).scalar_one()


def test_a_relaxed_transaction_waits_for_no_disk_and_leaves_the_connection_durable(tmp_path):
    engine = make_engine(tmp_path / "state.db", synchronous="FULL")
    with begin(engine, durable=False) as conn:
        conn.execute(text("CREATE TABLE t (x INTEGER)"))
        assert synchronous(conn) == NORMAL
    with begin(engine) as conn:
        assert synchronous(conn) == FULL
    with pytest.raises(ZeroDivisionError), begin(engine, durable=False) as conn:
        conn.execute(text("INSERT INTO t VALUES (1)"))
        raise ZeroDivisionError  # rolled back, and the setting restored all the same
    with engine.begin() as conn:  # a plain transaction elsewhere stays durable
        assert synchronous(conn) == FULL and conn.execute(text("SELECT count(*) FROM t")).scalar_one() == 0


def test_a_run_configured_below_full_keeps_its_own_setting(tmp_path):
    engine = make_engine(tmp_path / "state.db", synchronous="NORMAL")
    for durable in (True, False):
        with begin(engine, durable=durable) as conn:
            assert synchronous(conn) == NORMAL
