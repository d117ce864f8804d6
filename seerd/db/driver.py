"""Hot writes straight to the sqlite3 driver: a statement compiled once, executed with
`executemany` on the connection's own DBAPI cursor, inside the caller's SQLAlchemy transaction.

The state thread writes every report and lease through a handful of fixed statements. Through
SQLAlchemy each `execute` costs ~0.1-0.2 ms of Python (execution context, parameter processing,
result setup) beside the driver's own work, several times per report: on two cores that CPU is
taken from the engines (docs/benchmarks.md). The statements stay SQLAlchemy Core expressions,
compiled here by SQLAlchemy's SQLite dialect; only their execution skips it. What is skipped is
SQLAlchemy's bind processing, so values must be what the driver stores as they are (int, float,
str, bytes, None; a status is passed as its `.value`), as the hot paths' rows are.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.dialects import sqlite
from sqlalchemy.sql.expression import Executable

_DIALECT = sqlite.dialect(paramstyle="qmark")
PLAIN = (int, float, str, bytes, type(None))


@functools.lru_cache(maxsize=512)
def _compiled(statement: Executable, keys: tuple[str, ...]) -> tuple[str, tuple[str, ...], dict[str, Any]]:
    """The statement's SQL, its bind names in order, and the values bound in the statement itself
    (a status literal, say), for rows with `keys`."""
    compiled = statement.compile(dialect=_DIALECT, column_keys=list(keys))
    order = tuple(compiled.positiontup or ())
    fixed = {name: compiled.binds[name].effective_value for name in order if not compiled.binds[name].required}
    if not all(isinstance(value, PLAIN) for value in fixed.values()):
        raise TypeError(f"a value bound in the statement needs SQLAlchemy's processing: {fixed}")
    return str(compiled), order, fixed


def executemany(conn: Connection, statement: Executable, rows: Sequence[Mapping[str, Any]]) -> int:
    """Run `statement` once per row (all rows with the same keys) on `conn`'s transaction; the
    number of rows it changed. `statement` must be built once and kept (it keys the cache)."""
    if not rows:
        return 0
    sql, order, fixed = _compiled(statement, tuple(rows[0]))
    params = [tuple(row[name] if name in row else fixed[name] for name in order) for row in rows]
    cursor = conn.connection.driver_connection.executemany(sql, params)
    return cursor.rowcount


def insert_returning_ids(conn: Connection, statement: Executable, rows: Sequence[Mapping[str, Any]]) -> list[int]:
    """Insert each row with `statement` (an INSERT kept by the caller); the new primary keys, in
    the order of `rows` (one driver call per row: `lastrowid` is exact and in order, where a
    multi-row RETURNING does not promise an order)."""
    if not rows:
        return []
    sql, order, fixed = _compiled(statement, tuple(rows[0]))
    raw = conn.connection.driver_connection
    return [raw.execute(sql, tuple(row[name] if name in row else fixed[name] for name in order)).lastrowid
            for row in rows]
