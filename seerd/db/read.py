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

The queries take a connection of `open_read_only`'s engine and never commit: the caller runs
them in one read transaction (`reading`), so a run that is still going is seen at one instant.
Statuses are the enums of `seerd.db.status`, never spelled here as strings. A column a reader
can do without is looked up first, so that a run made by an older seerd reads as it is, without
`seerd db upgrade` (a write).
"""

from __future__ import annotations

import functools
import json
import os
import sqlite3
import urllib.parse
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from sqlalchemy import Connection, Engine, Row, case, create_engine, event, func, null, select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import aliased
from sqlalchemy.pool import NullPool

from seerd.db.base import BUSY_TIMEOUT_MS
from seerd.db.chunk import Chunk
from seerd.db.event import Event
from seerd.db.group import Group
from seerd.db.request import Request
from seerd.db.rollout import Rollout
from seerd.db.sharing import CoordinatorElsewhere, coordinator_elsewhere
from seerd.db.status import ChunkStatus, RequestStatus
from seerd.db.worker import Worker

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


# ------------------------------------------------------------------ the whole run (report)
def latest_rollout(conn: Connection) -> Row | None:
    """The run's rollout (the newest, should a database hold several)."""
    return conn.execute(select(Rollout.id, Rollout.status, Rollout.policy, Rollout.status_reason,
                               Rollout.created_at, Rollout.started_at, Rollout.finished_at,
                               Rollout.config_json, Rollout.input_path, Rollout.input_sha256)
                        .order_by(Rollout.id.desc()).limit(1)).first()


def groups(conn: Connection, rollout_id: int) -> list[Row]:
    """Every group, in group_index order."""
    return conn.execute(select(Group.id, Group.group_index, Group.n, Group.prompt_len, Group.max_tokens,
                               Group.length_estimate, Group.finished_requests)
                        .where(Group.rollout_id == rollout_id).order_by(Group.group_index)).all()


def requests(conn: Connection, rollout_id: int) -> list[Row]:
    """Every request, by id."""
    return conn.execute(select(Request.id, Request.group_id, Request.response_index, Request.status,
                               Request.is_probe, Request.generated_tokens, Request.finished_at)
                        .where(Request.rollout_id == rollout_id).order_by(Request.id)).all()


def chunks(conn: Connection, rollout_id: int) -> list[Row]:
    """Every chunk of the rollout's requests (without its tokens)."""
    return conn.execute(select(Chunk.request_id, Chunk.seq, Chunk.status, Chunk.num_tokens,
                               Chunk.lease_holder, Chunk.cached_tokens, Chunk.finished_at)
                        .join(Request, Request.id == Chunk.request_id)
                        .where(Request.rollout_id == rollout_id)).all()


def workers(conn: Connection, rollout_id: int) -> list[Row]:
    """Every worker that registered, in registration order."""
    return conn.execute(select(Worker.id, Worker.rank, Worker.max_chunks, Worker.kv_capacity_tokens,
                               Worker.registered_at)
                        .where(Worker.rollout_id == rollout_id)
                        .order_by(Worker.registered_at, Worker.rank)).all()


def taken_out_workers(conn: Connection, rollout_id: int) -> dict[str, str]:
    """worker id -> why the coordinator took it out (`coordinator.liveness`), for those it did."""
    rows = conn.execute(select(Event.worker_id, Event.data_json)
                        .where(Event.rollout_id == rollout_id, Event.kind == "worker_retired"))
    return {worker_id: json.loads(data or "{}").get("reason", "") for worker_id, data in rows}


def worker_exits(conn: Connection, rollout_id: int, limit: int) -> list[dict]:
    """The last `limit` worker processes' exits (`launch.local.EndedWorker`), oldest first, with their time."""
    rows = conn.execute(select(Event.ts, Event.data_json)
                        .where(Event.rollout_id == rollout_id, Event.kind == "worker_exited")
                        .order_by(Event.id.desc()).limit(limit)).all()
    return [{"ts": ts, **json.loads(data or "{}")} for ts, data in reversed(rows)]


def events(conn: Connection, rollout_id: int) -> Iterable[Row]:
    """The event log, in the order it was written."""
    return conn.execute(select(Event.id, Event.ts, Event.kind, Event.worker_id, Event.request_id,
                               Event.chunk_id, Event.data_json)
                        .where(Event.rollout_id == rollout_id).order_by(Event.id))


# ------------------------------------------------------------------ progress now (status)
def request_counts(conn: Connection, rollout_id: int) -> Row:
    """total, done, failed, running, tokens (committed), first_start; sums are None without requests."""
    return conn.execute(select(func.count().label("total"),
                               func.sum(case((Request.status == RequestStatus.FINISHED, 1), else_=0))
                               .label("done"),
                               func.sum(case((Request.status == RequestStatus.FAILED, 1), else_=0))
                               .label("failed"),
                               func.sum(case((Request.status == RequestStatus.RUNNING, 1), else_=0))
                               .label("running"),
                               func.sum(Request.generated_tokens).label("tokens"),
                               func.min(Request.started_at).label("first_start"))
                        .where(Request.rollout_id == rollout_id)).one()


def group_counts(conn: Connection, rollout_id: int) -> Row:
    """total, done (every response ended: finished, or failed); done is None without groups."""
    unended = (select(Request.id).where(Request.group_id == Group.id,
                                        Request.status.in_((RequestStatus.QUEUED, RequestStatus.RUNNING)))
               .exists())
    return conn.execute(select(func.count().label("total"), func.sum(case((unended, 0), else_=1)).label("done"))
                        .where(Group.rollout_id == rollout_id)).one()


def worker_loads(conn: Connection, rollout_id: int) -> list[Row]:
    """Every worker with its leased chunks (`running`), the KV reserved for them (`kv_reserved`:
    context plus budget, as admission counts it) and its last heartbeat's figures (`stats_json`)."""
    leased = (Chunk.status == ChunkStatus.LEASED) & (Chunk.lease_holder == Worker.id)
    running = select(func.count()).select_from(Chunk).where(leased).scalar_subquery()
    context_and_budget = Group.prompt_len + Request.generated_tokens + Chunk.max_tokens
    kv_reserved = (select(func.coalesce(func.sum(context_and_budget), 0)).select_from(Chunk)
                   .join(Request, Request.id == Chunk.request_id).join(Group, Group.id == Request.group_id)
                   .where(leased).scalar_subquery())
    # Databases from before migration 0004 have no stats.
    stats = Worker.stats_json if "stats_json" in column_names(conn, Worker.__tablename__) else null()
    return conn.execute(select(Worker.id, Worker.rank, Worker.status, Worker.max_chunks,
                               Worker.kv_capacity_tokens, Worker.last_heartbeat, stats.label("stats_json"),
                               running.label("running"), kv_reserved.label("kv_reserved"))
                        .where(Worker.rollout_id == rollout_id)
                        .order_by(Worker.rank, Worker.registered_at)).all()


def group_forecast(conn: Connection):  # noqa: ANN201 - a column expression
    """The coordinator's forecast of a group's longest response: `forecast_tokens`, or while it
    has written none (and in databases from before migration 0005) the group's length estimate,
    which is what the forecast is until a response of the group finishes."""
    if "forecast_tokens" in column_names(conn, Group.__tablename__):
        return func.coalesce(Group.forecast_tokens, Group.length_estimate)
    return Group.length_estimate


# Made once: building an alias's columns costs more than running the query on a small run.
_LEASED_CHUNK = aliased(Chunk, name="leased_chunk")
_DONE_CHUNK = aliased(Chunk, name="done_chunk")


class UnfinishedRequest(NamedTuple):
    """An unfinished request as status sees it (a plain tuple: attribute access on a row cost more
    than the query on a run of a few thousand requests)."""

    id: int
    running: bool  # a chunk of it is leased (RequestStatus.RUNNING)
    response_index: int
    is_probe: bool
    generated_tokens: int  # committed (done chunks)
    num_chunks: int  # done chunks
    group_index: int
    group_size: int
    group_finished: int
    group_estimate: int  # the group's length_estimate
    group_forecast: int  # as `group_forecast`
    chunk_id: int | None  # the leased chunk, its holder and when it was leased; None if queued
    lease_holder: str | None
    leased_at: float | None
    last_done: float | None  # when its last done chunk finished; None before the first


def unfinished_requests(conn: Connection, rollout_id: int) -> list[UnfinishedRequest]:
    """Every request still to end (queued or running), with its group's figures and its leased chunk."""
    leased, done = _LEASED_CHUNK, _DONE_CHUNK
    last_done = (select(func.max(done.finished_at))
                 .where(done.request_id == Request.id, done.status == ChunkStatus.DONE).scalar_subquery())
    rows = conn.execute(
        select(Request.id, Request.status == RequestStatus.RUNNING, Request.response_index, Request.is_probe,
               Request.generated_tokens, Request.num_chunks,
               Group.group_index, Group.n, Group.finished_requests, Group.length_estimate,
               group_forecast(conn),
               leased.id, leased.lease_holder, leased.leased_at, last_done)
        .join(Group, Group.id == Request.group_id)
        .outerjoin(leased, (leased.request_id == Request.id) & (leased.status == ChunkStatus.LEASED))
        .where(Request.rollout_id == rollout_id,
               Request.status.in_((RequestStatus.QUEUED, RequestStatus.RUNNING)))).all()
    return [UnfinishedRequest._make(row) for row in rows]


def tokens_done_since(conn: Connection, rollout_id: int, since: float) -> int:
    """Tokens of the chunks that finished at `since` or later."""
    return conn.execute(select(func.coalesce(func.sum(Chunk.num_tokens), 0))
                        .join(Request, Request.id == Chunk.request_id)
                        .where(Request.rollout_id == rollout_id, Chunk.status == ChunkStatus.DONE,
                               Chunk.finished_at >= since)).scalar_one()


def nth_finish_at(conn: Connection, rollout_id: int, nth: int) -> float | None:
    """When the `nth` request (from 1) to finish finished; None before it has."""
    return conn.execute(select(Request.finished_at)
                        .where(Request.rollout_id == rollout_id, Request.status == RequestStatus.FINISHED)
                        .order_by(Request.finished_at).limit(1).offset(nth - 1)).scalar()


def last_finish_at(conn: Connection, rollout_id: int) -> float | None:
    return conn.execute(select(func.max(Request.finished_at))
                        .where(Request.rollout_id == rollout_id)).scalar()


# ------------------------------------------------------------------ responses (draft history)
def prompt_hashes(conn: Connection) -> list[Row]:
    """(id, prompt_hash) of every group in the database."""
    return conn.execute(select(Group.id, Group.prompt_hash)).all()


def finished_response_chunks(conn: Connection, rollouts: Sequence[int] | None = None) -> Iterable[Row]:
    """Every finished response (of `rollouts` only, when given) as its done chunks' tokens,
    request by request, in order: (group_id, prompt_hash, request_id, token_ids), token_ids an
    int32 blob."""
    query = (select(Group.id.label("group_id"), Group.prompt_hash, Request.id.label("request_id"), Chunk.token_ids)
             .select_from(Request)
             .join(Group, Group.id == Request.group_id)
             .join(Chunk, (Chunk.request_id == Request.id) & (Chunk.status == ChunkStatus.DONE))
             .where(Request.status == RequestStatus.FINISHED)
             .order_by(Request.id, Chunk.seq))
    if rollouts is not None:
        query = query.where(Request.rollout_id.in_(list(rollouts)))
    return conn.execute(query)
