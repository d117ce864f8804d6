"""Declarative base, engine and session factory for the run's SQLite database.

The coordinator is the only writer. Functions in this package take a session and never commit:
the caller owns the transaction (Prefect's habit).
"""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy import Engine, MetaData, create_engine, event
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker

# Stable constraint names so that Alembic batch migrations on SQLite can find them.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

BUSY_TIMEOUT_MS = 10_000


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def _apply_pragmas(dbapi_connection, _record, *, synchronous: str, read_only: bool) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    cursor.execute("PRAGMA foreign_keys=ON")
    if not read_only:
        cursor.execute("PRAGMA journal_mode=WAL")
        # FULL: every acknowledged commit survives power loss, not only a killed process.
        cursor.execute(f"PRAGMA synchronous={synchronous}")
    cursor.close()


def make_engine(db_path: Path, *, read_only: bool = False, synchronous: str = "FULL") -> Engine:
    """An engine on `db_path` with WAL, a busy timeout and foreign keys on.

    Read-only engines (status readers) open the file with `mode=ro` so they can never take the
    write lock away from the coordinator.
    """
    if synchronous not in {"OFF", "NORMAL", "FULL", "EXTRA"}:
        raise ValueError(f"unknown SQLite synchronous mode {synchronous!r}")
    if read_only:
        url = f"sqlite:///file:{db_path}?mode=ro&uri=true"
    else:
        _create_private(db_path)
        url = f"sqlite:///{db_path}"
    engine = create_engine(url, connect_args={"check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, record):  # noqa: ANN001
        # pysqlite's own transaction handling would defer BEGIN; we issue it ourselves below.
        dbapi_connection.isolation_level = None
        _apply_pragmas(dbapi_connection, record, synchronous=synchronous, read_only=read_only)

    @event.listens_for(engine, "begin")
    def _on_begin(connection):  # noqa: ANN001
        # BEGIN IMMEDIATE takes the write lock up front (huey's habit): a writer never fails
        # half-way through a transaction because a reader upgraded first.
        connection.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")

    return engine


def _create_private(db_path: Path) -> None:
    """Create the database file (and its WAL/SHM siblings' directory) readable by the owner only."""
    db_path.parent.mkdir(parents=True, exist_ok=True)
    if not db_path.exists():
        fd = os.open(db_path, os.O_CREAT | os.O_WRONLY, 0o600)
        os.close(fd)
    os.chmod(db_path, 0o600)


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)
