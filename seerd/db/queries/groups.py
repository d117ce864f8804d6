"""Prompt groups: one prompt and its n requests."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sqlalchemy import Connection, Row, bindparam, case, func, insert, select, update
from sqlalchemy.orm import Session

from seerd.db import driver
from seerd.db.group import Group
from seerd.db.read import column_names
from seerd.db.request import Request
from seerd.db.status import RequestStatus

GROUPS = Group.__table__
BIND = update(GROUPS).where(GROUPS.c.id == bindparam("gid")).values(bound_worker=bindparam("worker"))
COUNTS = update(GROUPS).where(GROUPS.c.id == bindparam("gid")).values(
    finished_requests=bindparam("fr"), length_estimate=bindparam("est"), finished_at=bindparam("fa"))
FORECAST = update(GROUPS).where(GROUPS.c.id == bindparam("gid")).values(forecast_tokens=bindparam("forecast"))


def bind(conn: Connection, bindings: Mapping[int, str]) -> None:
    """Group id -> the worker the group policy bound it to."""
    driver.executemany(conn, BIND, [{"gid": gid, "worker": worker} for gid, worker in bindings.items()])


def set_counts(conn: Connection, rows: Sequence[Mapping]) -> None:
    """Groups' finished requests, length estimates and end: rows of `gid`, `fr`, `est`, `fa`."""
    driver.executemany(conn, COUNTS, rows)


def set_forecasts(conn: Connection, forecasts: Mapping[int, int]) -> None:
    """Group id -> the coordinator's forecast of its longest response (what status reads)."""
    driver.executemany(conn, FORECAST, [{"gid": gid, "forecast": f} for gid, f in forecasts.items()])


def insert_all(session: Session, rollout_id: int, rows: Sequence[Mapping]) -> dict[int, int]:
    """The rollout's groups (`rows`: column values, each with its `group_index`); group index -> id."""
    session.execute(insert(Group), [{"rollout_id": rollout_id, **row} for row in rows])
    return dict(session.execute(select(Group.group_index, Group.id).where(Group.rollout_id == rollout_id)).all())


def set_probes(session: Session, rollout_id: int) -> None:
    """Each group's probe: its request with `is_probe`."""
    probes = session.execute(select(Request.group_id, Request.id)
                             .where(Request.rollout_id == rollout_id, Request.is_probe)).all()
    session.execute(update(Group), [{"id": gid, "probe_request_id": rid} for gid, rid in probes])


def estimate_inputs(session: Session, rollout_id: int) -> list[Row]:
    """(id, prompt_hash, max_tokens) of every group: what a prior length is matched and clamped by."""
    return session.execute(select(Group.id, Group.prompt_hash, Group.max_tokens)
                           .where(Group.rollout_id == rollout_id)).all()


def set_estimates(session: Session, estimates: Mapping[int, int]) -> None:
    """Group id -> its length estimate."""
    if estimates:
        session.execute(update(Group), [{"id": gid, "length_estimate": est} for gid, est in estimates.items()])


def of_rollout_whole(conn: Connection, rollout_id: int) -> list[Row]:
    """Every column of every group of the rollout (the lease book's load)."""
    return conn.execute(select(Group.__table__).where(Group.rollout_id == rollout_id)).all()


def of_rollout(conn: Connection, rollout_id: int) -> list[Row]:
    """Every group, in group_index order."""
    return conn.execute(select(Group.id, Group.group_index, Group.n, Group.prompt_len, Group.max_tokens,
                               Group.length_estimate, Group.finished_requests)
                        .where(Group.rollout_id == rollout_id).order_by(Group.group_index)).all()


def prompt_tokens(conn: Connection, rollout_id: int) -> int:
    """The prompt tokens of every group of the rollout, summed."""
    return int(conn.execute(select(func.coalesce(func.sum(Group.prompt_len), 0))
                            .where(Group.rollout_id == rollout_id)).scalar_one())


def counts(conn: Connection, rollout_id: int) -> Row:
    """total, done (every response ended: finished, or failed); done is None without groups."""
    unended = (select(Request.id).where(Request.group_id == Group.id,
                                        Request.status.in_((RequestStatus.QUEUED, RequestStatus.RUNNING)))
               .exists())
    return conn.execute(select(func.count().label("total"), func.sum(case((unended, 0), else_=1)).label("done"))
                        .where(Group.rollout_id == rollout_id)).one()


def count(conn: Connection, rollout_id: int) -> int:
    return conn.execute(select(func.count()).where(Group.rollout_id == rollout_id)).scalar_one()


def page(conn: Connection, rollout_id: int, after: int, limit: int) -> list[Row]:
    """(id, prompt_id, group_index, prompt_len) of up to `limit` groups past group index `after`,
    in group index order (each read by its unique index)."""
    return conn.execute(select(Group.id, Group.prompt_id, Group.group_index, Group.prompt_len)
                        .where(Group.rollout_id == rollout_id, Group.group_index > after)
                        .order_by(Group.group_index).limit(limit)).all()


def with_prompts(conn: Connection, group_ids: Sequence[int]) -> list[Row]:
    """(id, prompt_id, group_index, prompt_len, prompt_token_ids) of these groups."""
    return conn.execute(select(Group.id, Group.prompt_id, Group.group_index, Group.prompt_len,
                               Group.prompt_token_ids).where(Group.id.in_(list(group_ids)))).all()


def group_forecast(conn: Connection):  # noqa: ANN201 - a column expression
    """The coordinator's forecast of a group's longest response: `forecast_tokens`, or while it
    has written none (and in databases from before migration 0005) the group's length estimate,
    which is what the forecast is until a response of the group finishes."""
    if "forecast_tokens" in column_names(conn, Group.__tablename__):
        return func.coalesce(Group.forecast_tokens, Group.length_estimate)
    return Group.length_estimate


# Made once: building an alias's columns costs more than running the query on a small run.


def prompt_hashes(conn: Connection) -> list[Row]:
    """(id, prompt_hash) of every group in the database."""
    return conn.execute(select(Group.id, Group.prompt_hash)).all()
