"""Read-only access to a run's database, for its readers: `seerd status`, `seerd report`, `seerd
export`, the look at a run before it is resumed (`launch.prepare.read_rollout`) and the draft
server's history (`--spec-history`).

A reader never writes to the run and never takes a lock a writer waits on. SQLite's `mode=ro` on
a database in WAL mode needs the `-wal` and `-shm` files beside it (the WAL index lives in
`-shm`). What SQLite 3.40 does (checked on this machine):
  - a live run, or one killed mid-way: the files exist and `mode=ro` reads the committed rows,
    those still in the WAL included, even when the directory or the files are not writable;
  - a finished run, whose last connection checkpointed and deleted both files: `mode=ro`
    creates them again (an empty `-wal`, a 32 KiB `-shm`, with the database's permissions) and
    leaves them behind; harmless, the next writer uses them;
  - the same in a directory we may not write to (a read-only mount, someone else's copy):
    `mode=ro` fails with SQLITE_READONLY_DIRECTORY. Without a `-wal` file there is nothing
    outside the main file, so we then open it `immutable=1` (no locks, no `-shm`). Never with a
    non-empty `-wal`: `immutable` ignores the WAL and would silently miss committed rows.

On a network filesystem, the opener refuses while the run's coordinator lives on another host
(`DatabaseInUseElsewhere`: SQLite's WAL index is not shared between hosts, `seerd.db.sharing`).

The queries (`seerd.db.queries`) take a connection of `open_read_only`'s engine and never
commit: the caller runs them in one read transaction (`reading`), so a run that is still going
is seen at one instant. A column a reader can do without is looked up first (`column_names`),
so that a run made by an older seerd reads as it is, without `seerd db upgrade` (a write).
"""

from __future__ import annotations

import functools
import os
import sqlite3
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from seerd.db.base import BUSY_TIMEOUT_MS
from seerd.db.sharing import CoordinatorElsewhere, coordinator_elsewhere

if TYPE_CHECKING:
    from seerd.ownership import Ownership


class UnreadableDatabase(RuntimeError):
    """The database cannot be read (missing, not SQLite, a WAL we may not use, locked too long)."""


class DatabaseInUseElsewhere(UnreadableDatabase):
    """On a network filesystem, with the run's coordinator live on another host: not opened."""

    def __init__(self, found: CoordinatorElsewhere, more: str = "") -> None:
        super().__init__(found.explain() + more)
        self.found = found


# ------------------------------------------------------------------ opening
def _uri(db_path: Path, option: str) -> str:
    # Quoted: a path with "?", "#" or spaces must not be read as URI syntax.
    return f"file:{urllib.parse.quote(str(db_path))}?{option}"


@functools.lru_cache(maxsize=16)
def _engine(uri: str, busy_timeout_ms: int) -> Engine:
    # Kept per database for its compiled statements: `seerd status` reads every frame, and
    # compiling its queries again each time made a frame 2.5x as costly. NullPool: a connection lives
    # for one use, so a kept engine holds no file open between frames.
    engine = create_engine("sqlite://", poolclass=NullPool,
                           creator=lambda: sqlite3.connect(uri, uri=True, check_same_thread=False))

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record):  # noqa: ANN001
        dbapi_connection.isolation_level = None  # we say BEGIN ourselves (below)
        dbapi_connection.execute(f"PRAGMA busy_timeout={busy_timeout_ms}")

    @event.listens_for(engine, "begin")
    def _on_begin(connection):  # noqa: ANN001
        # A deferred BEGIN: one snapshot for every query of the reader, no write lock ever.
        connection.exec_driver_sql("BEGIN")

    return engine


def _probe(engine: Engine) -> None:
    with engine.connect() as conn:
        conn.exec_driver_sql("SELECT count(*) FROM sqlite_master").scalar()


def open_read_only(db_path: Path, *, busy_timeout_ms: int = BUSY_TIMEOUT_MS, ownership: Ownership | None = None,
                   mountinfo: Path | None = None) -> Engine:
    """An engine that can only read `db_path` (see the module docstring for the WAL cases). It
    holds no connection between uses, so it needs no disposing. DatabaseInUseElsewhere when its
    run's coordinator is live on another host and the database on a network filesystem; the
    coordinator reading its own database passes its `ownership`. `mountinfo`: see
    `seerd.db.sharing.coordinator_elsewhere`."""
    if not db_path.is_file():
        raise UnreadableDatabase(f"no database at {db_path}")
    if (found := coordinator_elsewhere(db_path, ownership=ownership, mountinfo=mountinfo)) is not None:
        raise DatabaseInUseElsewhere(found)
    engine = _engine(_uri(db_path, "mode=ro"), busy_timeout_ms)
    try:
        _probe(engine)
        return engine
    except DBAPIError as exc:
        wal = db_path.with_name(db_path.name + "-wal")
        if getattr(exc.orig, "sqlite_errorname", "") != "SQLITE_READONLY_DIRECTORY" or (
                wal.exists() and wal.stat().st_size > 0):
            raise UnreadableDatabase(f"cannot read {db_path}: {exc.orig}") from exc
    engine = _engine(_uri(db_path, "immutable=1"), busy_timeout_ms)
    try:
        _probe(engine)
    except DBAPIError as exc:
        raise UnreadableDatabase(f"cannot read {db_path}: {exc.orig}") from exc
    return engine


@contextmanager
def reading(db_path: Path, *, busy_timeout_ms: int = BUSY_TIMEOUT_MS, ownership: Ownership | None = None,
            mountinfo: Path | None = None) -> Iterator[Connection]:
    """One read transaction on `db_path`, opened with `open_read_only` (which takes the keyword
    arguments), its connection closed after; a database error inside it becomes UnreadableDatabase."""
    try:
        with open_read_only(db_path, busy_timeout_ms=busy_timeout_ms, ownership=ownership,
                            mountinfo=mountinfo).begin() as conn:
            yield conn
    except DBAPIError as exc:
        raise UnreadableDatabase(f"cannot read {db_path}: {exc.orig}") from exc


def copy_database(db_path: Path, target: Path, *, mountinfo: Path | None = None) -> None:
    """Copy the database as committed now into the new file `target` (mode 0600; its directory
    made when missing): SQLite's online backup in one step, under one read lock, so the copy is one
    instant of the run, the `-wal`'s committed frames included (a `cp` of a live database misses
    them or tears pages). The copy is in rollback-journal mode, one self-contained file. Opened as
    any reader opens the database (`open_read_only`: refused from another host's network mount
    while the run goes)."""
    engine = open_read_only(db_path, mountinfo=mountinfo)
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.close(os.open(target, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    try:
        copy = sqlite3.connect(target)
        try:
            with engine.connect() as conn:
                conn.connection.driver_connection.backup(copy)
            copy.execute("PRAGMA journal_mode=DELETE")
        finally:
            copy.close()
    except BaseException as exc:
        target.unlink(missing_ok=True)
        if isinstance(exc, (sqlite3.Error, DBAPIError)):
            raise UnreadableDatabase(f"cannot copy {db_path}: {getattr(exc, 'orig', None) or exc}") from exc
        raise


# ------------------------------------------------------------------ schema
def table_names(conn: Connection) -> set[str]:
    return set(conn.exec_driver_sql("SELECT name FROM sqlite_master WHERE type = 'table'").scalars())


def column_names(conn: Connection, table: str) -> set[str]:
    return {row[1] for row in conn.exec_driver_sql(f"PRAGMA table_info({table})")}


def schema_revision(conn: Connection) -> str | None:
    """The Alembic revision the database is at; None when it has none."""
    if "alembic_version" not in table_names(conn):
        return None
    return conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar()
