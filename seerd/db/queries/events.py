"""The event log: append-only, in the order it was written."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

from sqlalchemy import Connection, Row, insert, select

from seerd.db import driver
from seerd.db.event import Event
from seerd.db.request import Request

INSERT = insert(Event.__table__)  # built once: the hot path appends events with every lease and report


def append(conn: Connection, rows: Sequence[dict]) -> None:
    """Events as `seerd.db.event.event_row` builds them."""
    driver.executemany(conn, INSERT, rows)


def of_rollout(conn: Connection, rollout_id: int) -> Iterable[Row]:
    """The event log, in the order it was written."""
    return conn.execute(select(Event.id, Event.ts, Event.kind, Event.worker_id, Event.request_id,
                               Event.chunk_id, Event.data_json)
                        .where(Event.rollout_id == rollout_id).order_by(Event.id))


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


def finish_order(conn: Connection, rollout_id: int) -> list[int]:
    """Finished requests in the order the coordinator learned of them (their events' order)."""
    return list(conn.execute(select(Event.request_id).where(Event.rollout_id == rollout_id,
                                                             Event.kind == "request_finished")
                             .order_by(Event.id)).scalars())


def group_ends_after(conn: Connection, rollout_id: int, after: int, kinds: Sequence[str]) -> list[Row]:
    """(event id, group id) of the rollout's `kinds` events of requests past event `after`, in order."""
    return conn.execute(select(Event.id, Request.group_id).join(Request, Request.id == Event.request_id)
                        .where(Event.rollout_id == rollout_id, Event.kind.in_(list(kinds)), Event.id > after)
                        .order_by(Event.id)).all()
