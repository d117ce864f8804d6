"""Read a run's database, read-only, into plain arrays: everything the report's figures need.

The report never writes to the run and never takes a lock a writer waits on: it opens the
database with `seerd.db.read.open_read_only` (what SQLite's `mode=ro` needs of a WAL database,
and when it falls back to `immutable=1`: that module's docstring, docs/report.md) and reads it
with `seerd.db.read`'s queries, all in one read transaction, so a run that is still going is
seen at one instant.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from seerd.db import ChunkStatus, Connection, RequestStatus, queries, read
from seerd.db.read import UnreadableDatabase


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
    if "rollouts" not in read.table_names(conn):
        raise ReportError(f"{db_path} holds no seerd run (no rollouts table)")
    missing = []
    for table, columns in READ_COLUMNS.items():
        missing += sorted(f"{table}.{column}" for column in columns - read.column_names(conn, table))
    if missing:
        revision = read.schema_revision(conn)
        raise ReportError(f"{db_path} (schema {revision or 'unversioned'}) lacks {', '.join(missing)}: "
                          f"run `seerd db upgrade {db_path.parent}` first")


def load_run(db_path: Path) -> RunData:
    """Everything the report needs from the run at `db_path`, read in one transaction."""
    try:
        with read.reading(db_path) as conn:
            _check_schema(conn, db_path)
            return _read(conn, db_path)
    except UnreadableDatabase as exc:
        raise ReportError(str(exc)) from exc


def _read(conn: Connection, db_path: Path) -> RunData:
    rollout = queries.rollouts.latest(conn)
    if rollout is None:
        raise ReportError(f"{db_path} holds no rollout yet")
    info = RolloutInfo(rollout.id, rollout.status.value, rollout.policy, rollout.status_reason,
                       rollout.created_at, rollout.started_at, rollout.finished_at,
                       json.loads(rollout.config_json))

    g = queries.groups.of_rollout(conn, rollout.id)
    groups = GroupRows(*(np.array([r[i] for r in g], dtype=np.int64) for i in range(7)))

    r = queries.requests.of_rollout(conn, rollout.id)
    requests = RequestRows(
        id=np.array([x.id for x in r], dtype=np.int64),
        group_id=np.array([x.group_id for x in r], dtype=np.int64),
        response_index=np.array([x.response_index for x in r], dtype=np.int64),
        finished=np.array([x.status == RequestStatus.FINISHED for x in r], dtype=bool),
        is_probe=np.array([bool(x.is_probe) for x in r], dtype=bool),
        generated=np.array([x.generated_tokens for x in r], dtype=np.int64),
        finished_at=np.array([np.nan if x.finished_at is None else x.finished_at for x in r], dtype=float))

    c = queries.chunks.of_rollout(conn, rollout.id)
    chunks = ChunkRows(
        request_id=np.array([x.request_id for x in c], dtype=np.int64),
        seq=np.array([x.seq for x in c], dtype=np.int64),
        done=np.array([x.status == ChunkStatus.DONE for x in c], dtype=bool),
        num_tokens=np.array([x.num_tokens for x in c], dtype=np.int64),
        lease_holder=np.array([x.lease_holder for x in c], dtype=object),
        cached_tokens=np.array([np.nan if x.cached_tokens is None else x.cached_tokens for x in c],
                               dtype=float),
        finished_at=np.array([np.nan if x.finished_at is None else x.finished_at for x in c], dtype=float))

    workers = tuple(WorkerInfo(x.id, x.rank, x.max_chunks, x.kv_capacity_tokens, x.registered_at)
                    for x in queries.workers.of_rollout(conn, rollout.id))
    events = tuple(EventRow(e.id, e.ts, e.kind, e.worker_id, e.request_id, e.chunk_id,
                            json.loads(e.data_json) if e.data_json else {})
                   for e in queries.events.of_rollout(conn, rollout.id))
    return RunData(db_path, info, groups, requests, chunks, workers, events)
