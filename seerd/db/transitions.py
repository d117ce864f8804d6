"""Every status write of a rollout, request, chunk or worker row goes through this module.

`change_status` is the one place a status changes: it checks the enum's transition table,
UPDATEs with a `WHERE status = <old>` guard (and the lease epoch where one is given), and checks
the row count, so a row that is not where the caller's in-memory state says it is fails loudly
instead of being counted twice. It returns the change; the caller applies its in-memory side
only after the transaction commits. `insert_with_status` is the same for a row's first status.
Functions take a connection and never commit: the caller owns the transaction.

Statements are built once per shape and kept (`_update_statement`): SQLAlchemy compiles a
statement once per cache key, but building the statement and its key again on every call was
a quarter of the coordinator's CPU per chunk. Constant values therefore travel as bind values,
and a shape whose values hold other SQL expressions is built afresh each time (rare: re-leases).
A kept statement then runs straight on the driver (`seerd.db.driver`), without SQLAlchemy's
per-execute work.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import BindParameter, Connection, Table, Update, bindparam, insert, update
from sqlalchemy.sql.elements import ClauseElement

from seerd.db import driver
from seerd.db.status import ALLOWED_INITIAL, check_transition

ROW_ID = "row_id"  # the bind names of the guard (a bind name may not be a column's name)
ROW_EPOCH = "row_epoch"


class StaleStatus(RuntimeError):
    """Rows were not in the status (or lease epoch) the caller expected: refuse, never double count."""


@dataclass(frozen=True)
class StatusChange:
    """Rows of `table` that went from `old` to `new` (in the caller's transaction)."""

    table: str
    ids: tuple
    old: enum.Enum
    new: enum.Enum

    def __len__(self) -> int:
        return len(self.ids)


def change_status(conn: Connection, table: Table, old: enum.Enum, new: enum.Enum, rows: Sequence[Mapping[str, Any]],
                  *, values: Mapping[str, Any] | None = None, guard_epoch: bool = False) -> StatusChange:
    """Move `rows` of `table` from `old` to `new`.

    Each row is a dict with `row_id` (and `row_epoch` with `guard_epoch`) plus the bind values
    `values` refers to: `values` maps columns to constants, SQL expressions or `bindparam(name)`s
    set with the status (executemany: one statement for all rows). Raises `IllegalTransition` for
    a change the table does not allow and `StaleStatus` when fewer rows matched than given.
    """
    check_transition(old, new)
    if not rows:
        return StatusChange(table.name, (), old, new)
    values = dict(values or {})
    constants = {f"set_{key}": value for key, value in values.items() if not isinstance(value, ClauseElement)}
    expressions = {key: value for key, value in values.items() if isinstance(value, ClauseElement)}
    binds = tuple(sorted((key, value.key) for key, value in expressions.items() if isinstance(value, BindParameter)))
    shape = (tuple(sorted(key[4:] for key in constants)), binds)
    if constants:
        rows = [{**row, **constants} for row in rows]
    if len(binds) == len(expressions):  # a kept statement: straight to the driver (seerd/db/driver.py)
        changed = driver.executemany(conn, _update_statement(table, old.value, new.value, guard_epoch, shape), rows)
    else:  # an SQL expression among the values (lease_epoch + 1): built for this call
        statement = _build_update(table, old.value, new.value, guard_epoch, shape[0], expressions)
        changed = conn.execute(statement, list(rows)).rowcount
    if changed != len(rows):
        raise StaleStatus(f"{table.name}: {len(rows) - changed} of {len(rows)} rows were not "
                          f"{old.value}{' at the given lease epoch' if guard_epoch else ''}")
    return StatusChange(table.name, tuple(row[ROW_ID] for row in rows), old, new)


@functools.lru_cache(maxsize=256)
def _update_statement(table: Table, old: str, new: str, guard_epoch: bool,
                      shape: tuple[tuple[str, ...], tuple[tuple[str, str], ...]]) -> Update:
    constant_keys, binds = shape
    return _build_update(table, old, new, guard_epoch, constant_keys, {key: bindparam(name) for key, name in binds})


def _build_update(table: Table, old: str, new: str, guard_epoch: bool, constant_keys: Sequence[str],
                  expressions: Mapping[str, Any]) -> Update:
    guard = [table.c.id == bindparam(ROW_ID), table.c.status == old]
    if guard_epoch:
        guard.append(table.c.lease_epoch == bindparam(ROW_EPOCH))
    return update(table).where(*guard).values(
        status=new, **{key: bindparam(f"set_{key}") for key in constant_keys}, **expressions)


def change_one(conn: Connection, table: Table, row_id: Any, old: enum.Enum, new: enum.Enum,
               **values: Any) -> StatusChange:
    """One row's change with constant values (`change_status` for a single row)."""
    return change_status(conn, table, old, new, [{ROW_ID: row_id}], values=values)


def insert_with_status(conn: Connection, table: Table, status: enum.Enum, values: Mapping[str, Any]) -> int:
    """Insert one row in one of its enum's allowed first statuses; returns its primary key."""
    if status not in ALLOWED_INITIAL[type(status)]:
        raise ValueError(f"a new {table.name} row cannot start as {status.value}")
    return conn.execute(insert(table).values(status=status.value, **values)).inserted_primary_key[0]


def insert_many_with_status(conn: Connection, table: Table, status: enum.Enum,
                            rows: Sequence[Mapping[str, Any]]) -> None:
    """`insert_with_status` for many rows of one first status (executemany)."""
    if status not in ALLOWED_INITIAL[type(status)]:
        raise ValueError(f"a new {table.name} row cannot start as {status.value}")
    if rows:
        conn.execute(insert(table), [{**row, "status": status.value} for row in rows])


def insert_many_returning_ids(conn: Connection, table: Table, status: enum.Enum,
                              rows: Sequence[Mapping[str, Any]]) -> list[int]:
    """`insert_many_with_status` that returns the new primary keys in the order of `rows`
    (straight on the driver: `seerd.db.driver.insert_returning_ids`). Every row has the same keys."""
    if status not in ALLOWED_INITIAL[type(status)]:
        raise ValueError(f"a new {table.name} row cannot start as {status.value}")
    return driver.insert_returning_ids(conn, _insert(table), [{**row, "status": status.value} for row in rows])


@functools.lru_cache(maxsize=32)
def _insert(table: Table):  # noqa: ANN202
    return insert(table)
