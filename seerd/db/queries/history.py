"""Per-prompt lengths of earlier runs (`--prior`): a run keeps its prior's and its own."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sqlalchemy import Connection, Row, insert, inspect, select
from sqlalchemy.orm import Session

from seerd.db.history import PromptLengthHistory


def insert_all(session: Session, rows: Sequence[Mapping]) -> None:
    """(rollout_id, prompt_hash, age, length) rows."""
    if rows:
        session.execute(insert(PromptLengthHistory), list(rows))


def younger_than(conn: Connection, rollout_id: int, max_age: int) -> list[Row]:
    """(prompt_hash, age, length) the rollout keeps, younger than `max_age`; [] for a database made
    before the history existed."""
    if not inspect(conn).has_table(PromptLengthHistory.__tablename__):
        return []
    return conn.execute(select(PromptLengthHistory.prompt_hash, PromptLengthHistory.age, PromptLengthHistory.length)
                        .where(PromptLengthHistory.rollout_id == rollout_id,
                               PromptLengthHistory.age < max_age)).all()
