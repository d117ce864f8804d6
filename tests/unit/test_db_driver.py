"""The hot writes straight on the sqlite3 driver (`seerd.db.driver`): the same rows as
SQLAlchemy's execution would write, in the caller's transaction, on a real run database."""

from __future__ import annotations

import enum

import pytest
from sqlalchemy import bindparam, delete, insert, select, update

from seerd.db import Event, make_engine
from seerd.db import driver
from seerd.db.base import begin
from seerd.db.migrate import upgrade
from tests.unit.helpers import make_book

EVENTS = Event.__table__


class Colour(enum.Enum):
    RED = "red"


def test_rows_written_by_the_driver_are_sqlalchemys_rows_and_roll_back_with_the_transaction(tmp_path):
    book = make_book(tmp_path)  # a run database with its rollout
    engine = book.engine
    rows = [{"rollout_id": book.rollout_id, "ts": float(i), "kind": "k", "worker_id": None, "request_id": i, "chunk_id": None,
             "data_json": None} for i in range(5)]
    statement = insert(EVENTS)
    with begin(engine) as conn:
        ids = driver.insert_returning_ids(conn, statement, rows[:3])
        assert driver.executemany(conn, statement, rows[3:]) == 2
    assert ids == sorted(ids) and len(set(ids)) == 3
    rename = update(EVENTS).where(EVENTS.c.request_id == bindparam("rid")).values(kind=bindparam("new"))
    with pytest.raises(RuntimeError), begin(engine) as conn:
        assert driver.executemany(conn, rename, [{"rid": 0, "new": "x"}, {"rid": 9, "new": "x"}]) == 1
        raise RuntimeError("the caller fails: nothing it wrote stays")
    with engine.connect() as conn:
        kinds = conn.execute(select(EVENTS.c.id, EVENTS.c.request_id, EVENTS.c.kind).order_by(EVENTS.c.id)).all()
    ours = [r for r in kinds if r.kind == "k"]  # beside the events the run's creation wrote
    assert [r.request_id for r in ours] == list(range(5)) and [r.id for r in ours[:3]] == ids


def test_a_value_that_needs_sqlalchemys_processing_is_refused_not_stored_wrong(tmp_path):
    engine = make_engine(tmp_path / "state.db")
    upgrade(engine)
    statement = update(EVENTS).where(EVENTS.c.id == bindparam("eid")).values(kind=Colour.RED)
    with pytest.raises(TypeError, match="needs SQLAlchemy's processing"), begin(engine) as conn:
        driver.executemany(conn, statement, [{"eid": 1}])


def test_values_bound_in_the_statement_fill_the_rows_and_a_missing_bind_is_refused(tmp_path):
    # The rows' parameters in bind order: from the row, from the statement (a literal), one bind
    # alone; a row without a bind the statement needs is a KeyError, nothing written.
    book = make_book(tmp_path)
    engine = book.engine
    rows = [{"rollout_id": book.rollout_id, "ts": float(i), "kind": "k", "worker_id": None, "request_id": i,
             "chunk_id": None, "data_json": None} for i in range(4)]
    with begin(engine) as conn:
        ids = driver.insert_returning_ids(conn, insert(EVENTS), rows)
        literal = update(EVENTS).where(EVENTS.c.id == bindparam("eid")).values(kind="renamed", worker_id=bindparam("w"))
        assert driver.executemany(conn, literal, [{"eid": ids[0], "w": "a"}, {"eid": ids[1], "w": "b"}]) == 2
        assert driver.executemany(conn, delete(EVENTS).where(EVENTS.c.id == bindparam("eid")), [{"eid": ids[3]}]) == 1
    with pytest.raises(KeyError, match="eid"), begin(engine) as conn:
        driver.executemany(conn, literal, [{"w": "c"}])
    with engine.connect() as conn:
        kept = conn.execute(select(EVENTS.c.id, EVENTS.c.kind, EVENTS.c.worker_id).where(EVENTS.c.id.in_(ids))
                            .order_by(EVENTS.c.id)).all()
    assert [tuple(r) for r in kept] == [(ids[0], "renamed", "a"), (ids[1], "renamed", "b"), (ids[2], "k", None)]
