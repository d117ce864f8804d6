"""Per-response target lengths (benchmark rows): read only to build a worker's grant."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sqlalchemy import Connection, insert, select
from sqlalchemy.orm import Session

from seerd.db.request import Request
from seerd.db.target import RequestTarget


def insert_all(session: Session, rows: Sequence[Mapping]) -> None:
    """(request_id, target_length) rows."""
    if rows:
        session.execute(insert(RequestTarget), list(rows))


def of_rollout(conn: Connection, rollout_id: int) -> dict[int, int]:
    """Request id -> its target length."""
    return dict(conn.execute(select(RequestTarget.request_id, RequestTarget.target_length)
                             .join(Request, Request.id == RequestTarget.request_id)
                             .where(Request.rollout_id == rollout_id)).all())
