"""The rollout row: one per `seerd run`, one per batch of `seerd serve`."""

from __future__ import annotations

import json

from sqlalchemy import Connection, Row, select, update
from sqlalchemy.orm import Session

from seerd.db.event import event_row
from seerd.db.queries import events
from seerd.db.rollout import Rollout
from seerd.db.status import RolloutStatus
from seerd.db.transitions import change_one, insert_with_status


def insert(conn: Connection, values: dict) -> int:
    """A new rollout, `created`; its id."""
    return insert_with_status(conn, Rollout.__table__, RolloutStatus.CREATED, values)


def load(session: Session, rollout_id: int | None = None) -> Rollout | None:
    """The rollout `rollout_id`, or the newest one."""
    query = select(Rollout).order_by(Rollout.id.desc()).limit(1) if rollout_id is None else \
        select(Rollout).where(Rollout.id == rollout_id)
    return session.scalars(query).first()


def latest(conn: Connection) -> Row | None:
    """The run's rollout (the newest, should a database hold several)."""
    return conn.execute(select(Rollout.id, Rollout.status, Rollout.policy, Rollout.status_reason,
                               Rollout.created_at, Rollout.started_at, Rollout.finished_at,
                               Rollout.config_json, Rollout.input_path, Rollout.input_sha256)
                        .order_by(Rollout.id.desc()).limit(1)).first()


def newest(conn: Connection, rollout_id: int | None = None) -> Row | None:
    """(id, status, model_path) of the newest rollout, or of `rollout_id`."""
    query = select(Rollout.id, Rollout.status, Rollout.model_path).order_by(Rollout.id.desc()).limit(1)
    if rollout_id is not None:
        query = query.where(Rollout.id == rollout_id)
    return conn.execute(query).first()


def finished_before(conn: Connection, rollout_id: int | None, limit: int) -> list[int]:
    """The newest finished rollouts (before `rollout_id` when given), newest first."""
    query = select(Rollout.id).where(Rollout.status == RolloutStatus.FINISHED)
    if rollout_id is not None:
        query = query.where(Rollout.id < rollout_id)
    return list(conn.execute(query.order_by(Rollout.id.desc()).limit(limit)).scalars())


def oldest_unended(conn: Connection) -> int | None:
    """The oldest rollout not yet ended (created, running or interrupted)."""
    return conn.execute(select(Rollout.id).where(Rollout.status.in_(
        (RolloutStatus.CREATED, RolloutStatus.RUNNING, RolloutStatus.INTERRUPTED))).order_by(Rollout.id).limit(1)).scalar()


def with_batch_key(conn: Connection, key: str) -> int | None:
    """The rollout created with this client key (`RunConfig.batch_key`), if any."""
    for rollout_id, config_json in conn.execute(select(Rollout.id, Rollout.config_json).order_by(Rollout.id)):
        if json.loads(config_json).get("batch_key") == key:
            return rollout_id
    return None


def identity(conn: Connection, rollout_id: int) -> Row | None:
    """(status, status_reason, model_path, model_fingerprint) of a rollout."""
    return conn.execute(select(Rollout.status, Rollout.status_reason, Rollout.model_path, Rollout.model_fingerprint)
                        .where(Rollout.id == rollout_id)).first()


def status(conn: Connection, rollout_id: int) -> RolloutStatus:
    return conn.execute(select(Rollout.status).where(Rollout.id == rollout_id)).scalar_one()


def status_and_start(conn: Connection, rollout_id: int) -> Row:
    """(status, started_at) of a rollout."""
    return conn.execute(select(Rollout.status, Rollout.started_at).where(Rollout.id == rollout_id)).one()


def change(conn: Connection, rollout_id: int, old: RolloutStatus, new: RolloutStatus, **values: object) -> None:
    """A rollout from `old` to `new` (guarded), with other columns' values."""
    change_one(conn, Rollout.__table__, rollout_id, old, new, **values)


def set_model_fingerprint(session: Session, rollout_id: int, fingerprint: str) -> None:
    session.execute(update(Rollout).where(Rollout.id == rollout_id).values(model_fingerprint=fingerprint))


def fail(conn: Connection, rollout_id: int, reason: str, now: float) -> None:
    """The rollout `failed` from whatever it was, with the reason and a `rollout_failed` event."""
    change_one(conn, Rollout.__table__, rollout_id, status(conn, rollout_id), RolloutStatus.FAILED,
               status_reason=reason)
    events.append(conn, [event_row(rollout_id, now, "rollout_failed", data={"reason": reason})])
