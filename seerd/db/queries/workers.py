"""Workers: one engine each, registered with a coordinator."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from sqlalchemy import Connection, Row, bindparam, func, null, select, update

from seerd.db import driver
from seerd.db.chunk import Chunk
from seerd.db.event import encode_json
from seerd.db.group import Group
from seerd.db.read import column_names
from seerd.db.request import Request
from seerd.db.status import ChunkStatus, WorkerStatus
from seerd.db.transitions import ROW_ID, change_one, change_status, insert_with_status
from seerd.db.worker import Worker

WORKERS = Worker.__table__
FIGURES = update(WORKERS).where(WORKERS.c.id == bindparam("wid")).values(
    last_heartbeat=bindparam("beat"), stats_json=bindparam("stats"))


def stats_json(stats: dict | None) -> str | None:
    """A worker's heartbeat figures as `workers.stats_json` holds them: with msgspec's encoder, as
    the event rows (`db.event`); json.dumps was 4% of the state thread at 1,000 workers (py-spy)."""
    return encode_json(stats).decode() if stats else None


def exists(conn: Connection, worker_id: str) -> bool:
    return conn.execute(select(WORKERS.c.id).where(WORKERS.c.id == worker_id)).first() is not None


def insert_alive(conn: Connection, values: Mapping) -> None:
    insert_with_status(conn, WORKERS, WorkerStatus.ALIVE, values)


def revive(conn: Connection, worker_id: str, *, now: float, stats: dict | None) -> None:
    """A stale worker `alive` again, with its heartbeat's time and figures."""
    change_one(conn, WORKERS, worker_id, WorkerStatus.STALE, WorkerStatus.ALIVE, last_heartbeat=now,
               stats_json=stats_json(stats))


def mark_stale(conn: Connection, worker_ids: Sequence[str]) -> None:
    change_status(conn, WORKERS, WorkerStatus.ALIVE, WorkerStatus.STALE, [{ROW_ID: w} for w in worker_ids])


def retire(conn: Connection, by_status: Mapping[WorkerStatus, Collection[str]]) -> None:
    """Workers `gone`: ids by the status they are in now (alive or stale)."""
    for status, ids in by_status.items():
        change_status(conn, WORKERS, status, WorkerStatus.GONE, [{ROW_ID: w} for w in ids])


def not_gone(conn: Connection, rollout_id: int) -> dict[WorkerStatus, list[str]]:
    """The rollout's workers that are not gone, by status."""
    found: dict[WorkerStatus, list[str]] = {}
    for worker_id, status in conn.execute(select(WORKERS.c.id, WORKERS.c.status).where(
            WORKERS.c.rollout_id == rollout_id, WORKERS.c.status != WorkerStatus.GONE.value)):
        found.setdefault(status, []).append(worker_id)
    return found


def set_figures(conn: Connection, figures: Mapping[str, Mapping]) -> None:
    """Worker id -> {last_heartbeat, stats}: what status shows of it (soft state, written in batches)."""
    driver.executemany(conn, FIGURES, [{"wid": wid, "beat": f["last_heartbeat"], "stats": stats_json(f["stats"])}
                                       for wid, f in figures.items()])


def of_rollout(conn: Connection, rollout_id: int) -> list[Row]:
    """Every worker that registered, in registration order."""
    return conn.execute(select(Worker.id, Worker.rank, Worker.max_chunks, Worker.kv_capacity_tokens,
                               Worker.registered_at)
                        .where(Worker.rollout_id == rollout_id)
                        .order_by(Worker.registered_at, Worker.rank)).all()


def loads(conn: Connection, rollout_id: int) -> list[Row]:
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
