"""Declarative base, engine and session factory for the run's SQLite database.

The coordinator is the only writer. Functions in this package take a session and never commit:
the caller owns the transaction (Prefect's habit).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import Connection, Engine, MetaData, create_engine, event
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker

log = logging.getLogger("seerd.db")

# Stable constraint names so that Alembic batch migrations on SQLite can find them.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

BUSY_TIMEOUT_MS = 10_000
SLOW_COMMIT_S = 1.0  # a write transaction longer than this is logged: the disk (fsync) or a lock


class CommitTimes:
    """The longest write transaction and how many passed `SLOW_COMMIT_S`, for this process: a
    coordinator that stops answering for seconds is often waiting on its disk, which its own CPU
    time does not show (`coordinator_load` carries these). And how many committed, durable
    (each an fsync) or not: what the disk is asked for."""

    longest_s = 0.0
    slow = 0
    durable = 0
    relaxed = 0
    total_s = 0.0  # every transaction's time: a slow turn of the state thread tells its share by it

    @classmethod
    def record(cls, seconds: float, durable: bool) -> None:
        if durable:
            cls.durable += 1
        else:
            cls.relaxed += 1
        cls.total_s += seconds
        cls.longest_s = max(cls.longest_s, seconds)
        if seconds > SLOW_COMMIT_S:
            cls.slow += 1
            log.warning("a %s write transaction took %.1f s (the disk's fsync, or another writer's lock)",
                        "durable" if durable else "non-durable", seconds)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


DURABLE_SYNCHRONOUS = "durable_synchronous"  # the engine's configured setting, in each connection's info


def _apply_pragmas(dbapi_connection, record, *, synchronous: str) -> None:  # noqa: ANN001
    record.info[DURABLE_SYNCHRONOUS] = synchronous
    cursor = dbapi_connection.cursor()
    cursor.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")
    # FULL: every acknowledged commit survives power loss, not only a killed process.
    cursor.execute(f"PRAGMA synchronous={synchronous}")
    cursor.close()


def make_engine(db_path: Path, *, synchronous: str = "FULL") -> Engine:
    """A writer's engine on `db_path` with WAL, a busy timeout and foreign keys on. Only the run's
    owner opens one (seerd.ownership); readers open the database with `seerd.db.read.open_read_only`,
    which never takes the write lock and refuses a run whose coordinator is on another host."""
    if synchronous not in {"OFF", "NORMAL", "FULL", "EXTRA"}:
        raise ValueError(f"unknown SQLite synchronous mode {synchronous!r}")
    _create_private(db_path)
    engine = create_engine(f"sqlite:///{db_path}", connect_args={"check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, record):  # noqa: ANN001
        # pysqlite's own transaction handling would defer BEGIN; we issue it ourselves below.
        dbapi_connection.isolation_level = None
        _apply_pragmas(dbapi_connection, record, synchronous=synchronous)

    @event.listens_for(engine, "begin")
    def _on_begin(connection):  # noqa: ANN001
        # BEGIN IMMEDIATE takes the write lock up front (huey's habit): a writer never fails
        # half-way through a transaction because a reader upgraded first. On the driver itself:
        # through `exec_driver_sql` it cost ~40 us of CPU more, on every transaction.
        connection.connection.driver_connection.execute("BEGIN IMMEDIATE")

    return engine


@contextmanager
def begin(engine: Engine, *, durable: bool = True) -> Iterator[Connection]:
    """A write transaction (`engine.begin()`), durable or not.

    `durable=False` commits without waiting for the disk (`synchronous=NORMAL` under WAL): the
    commit is atomic and survives a killed process; only a power loss or an OS crash can take it
    back, and the next durable commit (an fsync of the WAL) makes it and everything before it
    survive those too. For what the run redoes anyway after such a crash: leases (a restarted
    coordinator re-queues every lease), registrations, heartbeats, expiries, forecasts. Durable
    is the engine's configured setting (FULL for runs): what is acknowledged as kept, reports.
    """
    with engine.connect() as conn, _transaction(conn, durable):
        yield conn


@contextmanager
def _transaction(conn: Connection, durable: bool) -> Iterator[None]:
    durable_setting = conn.info.get(DURABLE_SYNCHRONOUS, "FULL")
    relaxed = not durable and durable_setting in ("FULL", "EXTRA")
    raw = conn.connection.driver_connection
    if relaxed:  # outside a transaction: SQLite refuses it inside one
        raw.execute("PRAGMA synchronous=NORMAL")
    started = time.monotonic()
    try:
        with conn.begin():
            yield
        CommitTimes.record(time.monotonic() - started, durable)
    finally:
        if relaxed:  # back: a plain `engine.begin()` elsewhere stays durable
            raw.execute(f"PRAGMA synchronous={durable_setting}")


class Writer:
    """`begin` on one connection kept per thread instead of one checked out of the engine's pool
    per transaction: the coordinator's state thread writes every report and lease, and a pool
    checkout, checkin and their events cost 50-70 us of CPU per transaction (an empty relaxed
    transaction: ~35 us on a kept connection, 80-110 us through the pool).
    Per thread, because the state thread is not the only caller (loading, the final status).

    Checkpoints run in the background: SQLite's automatic one runs inside the commit that passes
    its threshold, and there copied the WAL into the database with two fsyncs while every call
    waited behind that commit (0.4-0.7 s stalls in `tools/bench/load.py`). The kept connections turn it
    off, and past `CHECKPOINT_WAL_BYTES` of WAL a thread of its own runs a PASSIVE checkpoint,
    which never blocks a writer. One that cannot keep up with the writes (the WAL restarts only
    after a checkpoint caught up with every frame) is bounded: past `INLINE_CHECKPOINT_WAL_BYTES`
    the writer's own thread checkpoints, between two transactions, as SQLite's own would."""

    CHECKPOINT_WAL_BYTES = 4 << 20  # SQLite's own default: 1000 pages of 4 KiB
    INLINE_CHECKPOINT_WAL_BYTES = 64 << 20
    CHECK_EVERY = 32  # commits between looks at the WAL's size
    SLOW_CHECKPOINT_S = 0.05

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._local = threading.local()
        self._kept: list[Connection] = []
        self._lock = threading.Lock()
        database = engine.url.database
        self._wal = Path(f"{database}-wal") if database and database != ":memory:" else None
        self._commits = 0
        self._checkpointer: threading.Thread | None = None
        self.checkpoints = 0
        # (perf_counter at its start, seconds) of checkpoints over SLOW_CHECKPOINT_S: whether a
        # slow commit ran beside one (the checkpoint's fsync of the database file).
        self.slow_checkpoints: collections.deque[tuple[float, float]] = collections.deque(maxlen=200)

    @contextmanager
    def begin(self, *, durable: bool = True) -> Iterator[Connection]:
        conn = getattr(self._local, "conn", None)
        if conn is None or conn.closed or conn.invalidated:
            conn = self._local.conn = self.engine.connect()
            if self._wal is not None:
                driver = conn.connection.driver_connection
                driver.execute("PRAGMA wal_autocheckpoint=0")
                # The WAL file shrinks back to this when it restarts: its size (what the checks
                # below read) then says how far behind the checkpoints are, not how far behind
                # they once were. Without it, one burst that grew it past the inline bound put
                # an inline checkpoint on every 32nd commit of the state thread from then on.
                driver.execute(f"PRAGMA journal_size_limit={self.CHECKPOINT_WAL_BYTES}")
            with self._lock:
                self._kept.append(conn)
        with _transaction(conn, durable):
            yield conn
        self._commits += 1
        if self._wal is not None and self._commits % self.CHECK_EVERY == 0:
            self._checkpoint_if_due(conn)

    def _checkpoint_if_due(self, conn: Connection) -> None:
        try:
            size = self._wal.stat().st_size
        except OSError:
            return
        running = self._checkpointer is not None and self._checkpointer.is_alive()
        if size >= self.INLINE_CHECKPOINT_WAL_BYTES and not running:
            self._checkpoint(conn)
        elif size >= self.CHECKPOINT_WAL_BYTES and not running:
            self._checkpointer = threading.Thread(target=self._checkpoint, name="seerd-checkpoint", daemon=True)
            self._checkpointer.start()

    def _checkpoint(self, conn: Connection | None = None) -> None:
        """A PASSIVE checkpoint on `conn` (outside a transaction), or on a connection of its own."""
        started = time.perf_counter()
        try:
            with contextlib.nullcontext(conn) if conn is not None else self.engine.connect() as on:
                on.connection.driver_connection.execute("PRAGMA wal_checkpoint(PASSIVE)")
            self.checkpoints += 1
            if time.perf_counter() - started > self.SLOW_CHECKPOINT_S:
                self.slow_checkpoints.append((started, time.perf_counter() - started))
        except Exception:  # noqa: BLE001 - the next one retries; a failed copy never risks the data
            log.exception("WAL checkpoint failed")

    def close(self) -> None:
        """Give every kept connection back (from any thread, once their threads are done)."""
        if self._checkpointer is not None:
            self._checkpointer.join()
        with self._lock:
            kept, self._kept = self._kept, []
        for conn in kept:
            conn.close()


def _create_private(db_path: Path) -> None:
    """Create the database file (and its WAL/SHM siblings' directory) readable by the owner only."""
    db_path.parent.mkdir(parents=True, exist_ok=True)
    if not db_path.exists():
        fd = os.open(db_path, os.O_CREAT | os.O_WRONLY, 0o600)
        os.close(fd)
    os.chmod(db_path, 0o600)


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)
