"""Hot writes straight to the sqlite3 driver: a statement compiled once, executed with
`executemany` on the connection's own DBAPI cursor, inside the caller's SQLAlchemy transaction.

The state thread writes every report and lease through a handful of fixed statements. Through
SQLAlchemy each `execute` costs ~0.1-0.2 ms of Python (execution context, parameter processing,
result setup) beside the driver's own work, several times per report: on two cores that CPU is
taken from the engines (docs/journal/2026-11-27.md). The statements stay SQLAlchemy Core expressions,
compiled here by SQLAlchemy's SQLite dialect; only their execution skips it. What is skipped is
SQLAlchemy's bind processing, so values must be what the driver stores as they are (int, float,
str, bytes, None; a status is passed as its `.value`), as the hot paths' rows are.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.dialects import sqlite
from sqlalchemy.sql.expression import Executable

_DIALECT = sqlite.dialect(paramstyle="qmark")
PLAIN = (int, float, str, bytes, type(None))


@functools.lru_cache(maxsize=512)
def _compiled(statement: Executable, keys: tuple[str, ...]) -> tuple[str, Callable[[Mapping[str, Any]], tuple]]:
    """The statement's SQL for rows with `keys`, and what turns such a row into the driver's
    parameters in bind order (the values bound in the statement itself, a status literal say,
    filled in). An `itemgetter` where the rows hold every bind, in C: building the tuple name by
    name in Python cost ~4% of a 32-chunk lease on the state thread (`tools/bench/lease_cost.py`)."""
    compiled = statement.compile(dialect=_DIALECT, column_keys=list(keys))
    order = tuple(compiled.positiontup or ())
    missing = [name for name in order if name not in keys and compiled.binds[name].required]
    if missing:
        raise KeyError(f"rows with {keys} lack the binds {missing}")
    fixed = {name: compiled.binds[name].effective_value for name in order if name not in keys}
    if not all(isinstance(value, PLAIN) for value in fixed.values()):
        raise TypeError(f"a value bound in the statement needs SQLAlchemy's processing: {fixed}")
    sql = str(compiled)
    if len(order) < 2:  # (`itemgetter` of one name gives the value, not a tuple)
        return sql, lambda row: tuple({**fixed, **row}[name] for name in order)
    getter = operator.itemgetter(*order)
    if fixed:
        return sql, lambda row: getter({**fixed, **row})
    return sql, getter


def executemany(conn: Connection, statement: Executable, rows: Sequence[Mapping[str, Any]]) -> int:
    """Run `statement` once per row (all rows with the same keys) on `conn`'s transaction; the
    number of rows it changed. `statement` must be built once and kept (it keys the cache)."""
    if not rows:
        return 0
    sql, parameters = _compiled(statement, tuple(rows[0]))
    cursor = conn.connection.driver_connection.executemany(sql, map(parameters, rows))
    return cursor.rowcount


def insert_returning_ids(conn: Connection, statement: Executable, rows: Sequence[Mapping[str, Any]]) -> list[int]:
    """Insert each row with `statement` (an INSERT kept by the caller); the new primary keys, in
    the order of `rows` (one driver call per row: `lastrowid` is exact and in order, where a
    multi-row RETURNING does not promise an order)."""
    if not rows:
        return []
    sql, parameters = _compiled(statement, tuple(rows[0]))
    execute = conn.connection.driver_connection.execute
    return [execute(sql, parameters(row)).lastrowid for row in rows]
