"""Read a run's database, read-only, into plain arrays: everything the report's figures need.

The report never writes to the run and never takes a lock a writer waits on. SQLite's
`mode=ro` is what status readers use; on a database in WAL mode it needs the `-wal` and `-shm`
files beside it (the WAL index lives in `-shm`). What SQLite 3.40 does (checked on this machine):
  - a live run, or one killed mid-way: the files exist and `mode=ro` reads the committed rows,
    those still in the WAL included, even when the directory or the files are not writable;
  - a finished run, whose last connection checkpointed and deleted both files: `mode=ro`
    creates them again (an empty `-wal`, a 32 KiB `-shm`, with the database's permissions) and
    leaves them behind; harmless, the next writer uses them;
  - the same in a directory we may not write to (a read-only mount, someone else's copy):
    `mode=ro` fails with SQLITE_READONLY_DIRECTORY. Without a `-wal` file there is nothing
    outside the main file, so we then open it `immutable=1` (no locks, no `-shm`). Never with a
    non-empty `-wal`: `immutable` ignores the WAL and would silently miss committed rows.
All queries run in one read transaction, so a run that is still going is seen at one instant.
"""

from __future__ import annotations

import json
import sqlite3
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from sqlalchemy import Connection, Engine, create_engine, event, select
from sqlalchemy.exc import DBAPIError

from seerd.db import Chunk, ChunkStatus, Event, Group, Request, RequestStatus, Rollout, Worker
from seerd.db.base import BUSY_TIMEOUT_MS


class ReportError(RuntimeError):
    """The run's database cannot be read for a report (not a seerd run, an older schema, ...)."""


@dataclass(frozen=True)
class RolloutInfo:
    id: int
    status: str
    policy: str
    status_reason: str | None
    created_at: float
    started_at: float | None
    finished_at: float | None
    config: dict  # RunConfig as JSON (chunk_tokens, n, max_tokens, ...)


@dataclass(frozen=True)
class GroupRows:
    """One entry per group, in group_index order."""

    id: np.ndarray
    index: np.ndarray
    n: np.ndarray
    prompt_len: np.ndarray
    max_tokens: np.ndarray
    estimate: np.ndarray  # length_estimate now
    finished_requests: np.ndarray


@dataclass(frozen=True)
class RequestRows:
    id: np.ndarray
    group_id: np.ndarray
    response_index: np.ndarray
    finished: np.ndarray  # bool
    is_probe: np.ndarray  # bool
    generated: np.ndarray  # committed tokens (done chunks)
    finished_at: np.ndarray  # NaN while unfinished


@dataclass(frozen=True)
class ChunkRows:
    request_id: np.ndarray
    seq: np.ndarray
    done: np.ndarray  # bool
    num_tokens: np.ndarray
    # The worker of the chunk's last lease (for a done chunk: the one that reported it); None if never leased.
    lease_holder: np.ndarray  # object: str | None
    # vLLM's num_cached_tokens of the chunk's prefill (local prefix cache + loaded from a KV pool);
    # NaN where the worker did not report it (or the chunk is not done).
    cached_tokens: np.ndarray  # float
    finished_at: np.ndarray  # float, absolute; NaN while not done


@dataclass(frozen=True)
class WorkerInfo:
    id: str
    rank: int
    max_chunks: int
    kv_capacity_tokens: int
    registered_at: float


@dataclass(frozen=True)
class EventRow:
    id: int
    ts: float
    kind: str
    worker_id: str | None
    request_id: int | None
    chunk_id: int | None
    data: dict


@dataclass(frozen=True)
class RunData:
    """A run as its database holds it at one instant."""

    db_path: Path
    rollout: RolloutInfo
    groups: GroupRows
    requests: RequestRows
    chunks: ChunkRows
    workers: tuple[WorkerInfo, ...]
    events: tuple[EventRow, ...]  # every event of the rollout, in the order they were written


def _uri(db_path: Path, option: str) -> str:
    return f"file:{urllib.parse.quote(str(db_path))}?{option}"


def _engine(uri: str) -> Engine:
    engine = create_engine("sqlite://",
                           creator=lambda: sqlite3.connect(uri, uri=True, check_same_thread=False))

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record):  # noqa: ANN001
        dbapi_connection.isolation_level = None  # we say BEGIN ourselves (below)
        dbapi_connection.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")

    @event.listens_for(engine, "begin")
    def _on_begin(connection):  # noqa: ANN001
        # A deferred BEGIN: one snapshot for every query of the report, no write lock ever.
        connection.exec_driver_sql("BEGIN")

    return engine


def _probe(engine: Engine) -> None:
    with engine.connect() as conn:
        conn.exec_driver_sql("SELECT count(*) FROM sqlite_master").scalar()


def open_read_only(db_path: Path) -> Engine:
    """An engine that can only read `db_path` (see the module docstring for the WAL cases)."""
    if not db_path.is_file():
        raise ReportError(f"no database at {db_path}")
    engine = _engine(_uri(db_path, "mode=ro"))
    try:
        _probe(engine)
        return engine
    except DBAPIError as exc:
        engine.dispose()
        wal = db_path.with_name(db_path.name + "-wal")
        if getattr(exc.orig, "sqlite_errorname", "") != "SQLITE_READONLY_DIRECTORY" or (
                wal.exists() and wal.stat().st_size > 0):
            raise ReportError(f"cannot read {db_path}: {exc.orig}") from exc
    engine = _engine(_uri(db_path, "immutable=1"))
    try:
        _probe(engine)
    except DBAPIError as exc:
        engine.dispose()
        raise ReportError(f"cannot read {db_path}: {exc.orig}") from exc
    return engine


# The columns the report reads. It checks for these rather than for the newest schema revision,
# so that a run made by an older seerd reports as it is, without `seerd db upgrade` (a write).
READ_COLUMNS = {
    "rollouts": {"id", "status", "policy", "status_reason", "created_at", "started_at", "finished_at",
                 "config_json"},
    "prompt_groups": {"id", "rollout_id", "group_index", "n", "prompt_len", "max_tokens", "length_estimate",
                      "finished_requests"},
    "requests": {"id", "rollout_id", "group_id", "response_index", "status", "is_probe", "generated_tokens",
                 "finished_at"},
    "chunks": {"request_id", "seq", "status", "num_tokens", "lease_holder", "cached_tokens", "finished_at"},
    "workers": {"id", "rollout_id", "rank", "max_chunks", "kv_capacity_tokens", "registered_at"},
    "events": {"id", "rollout_id", "ts", "kind", "worker_id", "request_id", "chunk_id", "data_json"},
}


def _check_schema(conn: Connection, db_path: Path) -> None:
    tables = set(conn.exec_driver_sql("SELECT name FROM sqlite_master WHERE type = 'table'").scalars())
    if "rollouts" not in tables:
        raise ReportError(f"{db_path} holds no seerd run (no rollouts table)")
    missing = []
    for table, columns in READ_COLUMNS.items():
        present = {row[1] for row in conn.exec_driver_sql(f"PRAGMA table_info({table})")}
        missing += sorted(f"{table}.{column}" for column in columns - present)
    if missing:
        revision = conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar() \
            if "alembic_version" in tables else None
        raise ReportError(f"{db_path} (schema {revision or 'unversioned'}) lacks {', '.join(missing)}: "
                          f"run `seerd db upgrade {db_path.parent}` first")


def load_run(db_path: Path) -> RunData:
    """Everything the report needs from the run at `db_path`, read in one transaction."""
    engine = open_read_only(db_path)
    try:
        with engine.begin() as conn:
            _check_schema(conn, db_path)
            return _read(conn, db_path)
    finally:
        engine.dispose()


def _read(conn: Connection, db_path: Path) -> RunData:
    rollout = conn.execute(select(Rollout.id, Rollout.status, Rollout.policy, Rollout.status_reason,
                                  Rollout.created_at, Rollout.started_at, Rollout.finished_at,
                                  Rollout.config_json)
                           .order_by(Rollout.id.desc()).limit(1)).first()
    if rollout is None:
        raise ReportError(f"{db_path} holds no rollout yet")
    info = RolloutInfo(rollout.id, rollout.status.value, rollout.policy, rollout.status_reason,
                       rollout.created_at, rollout.started_at, rollout.finished_at,
                       json.loads(rollout.config_json))

    g = conn.execute(select(Group.id, Group.group_index, Group.n, Group.prompt_len, Group.max_tokens,
                            Group.length_estimate, Group.finished_requests)
                     .where(Group.rollout_id == rollout.id).order_by(Group.group_index)).all()
    groups = GroupRows(*(np.array([r[i] for r in g], dtype=np.int64) for i in range(7)))

    r = conn.execute(select(Request.id, Request.group_id, Request.response_index, Request.status,
                            Request.is_probe, Request.generated_tokens, Request.finished_at)
                     .where(Request.rollout_id == rollout.id).order_by(Request.id)).all()
    requests = RequestRows(
        id=np.array([x.id for x in r], dtype=np.int64),
        group_id=np.array([x.group_id for x in r], dtype=np.int64),
        response_index=np.array([x.response_index for x in r], dtype=np.int64),
        finished=np.array([x.status == RequestStatus.FINISHED for x in r], dtype=bool),
        is_probe=np.array([bool(x.is_probe) for x in r], dtype=bool),
        generated=np.array([x.generated_tokens for x in r], dtype=np.int64),
        finished_at=np.array([np.nan if x.finished_at is None else x.finished_at for x in r], dtype=float))

    c = conn.execute(select(Chunk.request_id, Chunk.seq, Chunk.status, Chunk.num_tokens, Chunk.lease_holder,
                            Chunk.cached_tokens, Chunk.finished_at)
                     .join(Request, Request.id == Chunk.request_id)
                     .where(Request.rollout_id == rollout.id)).all()
    chunks = ChunkRows(
        request_id=np.array([x.request_id for x in c], dtype=np.int64),
        seq=np.array([x.seq for x in c], dtype=np.int64),
        done=np.array([x.status == ChunkStatus.DONE for x in c], dtype=bool),
        num_tokens=np.array([x.num_tokens for x in c], dtype=np.int64),
        lease_holder=np.array([x.lease_holder for x in c], dtype=object),
        cached_tokens=np.array([np.nan if x.cached_tokens is None else x.cached_tokens for x in c],
                               dtype=float),
        finished_at=np.array([np.nan if x.finished_at is None else x.finished_at for x in c], dtype=float))

    w = conn.execute(select(Worker.id, Worker.rank, Worker.max_chunks, Worker.kv_capacity_tokens,
                            Worker.registered_at)
                     .where(Worker.rollout_id == rollout.id)
                     .order_by(Worker.registered_at, Worker.rank)).all()
    workers = tuple(WorkerInfo(x.id, x.rank, x.max_chunks, x.kv_capacity_tokens, x.registered_at) for x in w)

    events = tuple(
        EventRow(e.id, e.ts, e.kind, e.worker_id, e.request_id, e.chunk_id,
                 json.loads(e.data_json) if e.data_json else {})
        for e in conn.execute(select(Event.id, Event.ts, Event.kind, Event.worker_id, Event.request_id,
                                     Event.chunk_id, Event.data_json)
                              .where(Event.rollout_id == rollout.id).order_by(Event.id)))
    return RunData(db_path, info, groups, requests, chunks, workers, events)
