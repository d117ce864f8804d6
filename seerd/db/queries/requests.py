"""Requests: one response each."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import NamedTuple

from sqlalchemy import Connection, Row, bindparam, case, func, select, update
from sqlalchemy.orm import Session, aliased

from seerd.db import driver
from seerd.db.chunk import Chunk
from seerd.db.group import Group
from seerd.db.queries.groups import group_forecast
from seerd.db.request import Request
from seerd.db.status import ChunkStatus, RequestStatus
from seerd.db.transitions import ROW_ID, change_one, change_status, insert_many_with_status

ENDED = (RequestStatus.FINISHED, RequestStatus.FAILED)
REQUESTS = Request.__table__
FIRST_START = update(REQUESTS).where(REQUESTS.c.id == bindparam(ROW_ID), REQUESTS.c.started_at.is_(None)).values(
    started_at=bindparam("now"))
# The counts a report sets (bind names of `finish`'s and `requeue_counted`'s rows), built once.
COUNT_VALUES = {"generated_tokens": bindparam("gen"), "num_chunks": bindparam("nc")}
FINISH_REASON = bindparam("fr")


def start(conn: Connection, request_ids: Sequence[int], *, worker_id: str, now: float) -> None:
    """Queued requests `running` on `worker_id`; the first chunk's lease is when a request started."""
    rows = [{ROW_ID: rid} for rid in request_ids]
    change_status(conn, REQUESTS, RequestStatus.QUEUED, RequestStatus.RUNNING, rows, values={"last_worker": worker_id})
    if rows:
        driver.executemany(conn, FIRST_START, [{**row, "now": now} for row in rows])


def requeue(conn: Connection, request_ids: Sequence[int]) -> None:
    """Running requests back to `queued` (their chunk's lease ended unreported)."""
    change_status(conn, REQUESTS, RequestStatus.RUNNING, RequestStatus.QUEUED, [{ROW_ID: rid} for rid in request_ids])


def finish(conn: Connection, rows: Sequence[Mapping], now: float) -> None:
    """Running requests `finished`: rows of `row_id`, `gen` (generated tokens), `nc` (chunks), `fr` (finish reason)."""
    change_status(conn, REQUESTS, RequestStatus.RUNNING, RequestStatus.FINISHED, rows,
                  values={**COUNT_VALUES, "finish_reason": FINISH_REASON, "finished_at": now})


def requeue_counted(conn: Connection, rows: Sequence[Mapping], now: float) -> None:
    """Running requests back to `queued` after a chunk: rows of `row_id`, `gen`, `nc`."""
    change_status(conn, REQUESTS, RequestStatus.RUNNING, RequestStatus.QUEUED, rows,
                  values={**COUNT_VALUES, "queued_at": now})


def fail(conn: Connection, request_id: int, *, attempts: int, error: str, now: float) -> None:
    """A running request `failed`, its last chunk's engine's message its error."""
    change_one(conn, REQUESTS, request_id, RequestStatus.RUNNING, RequestStatus.FAILED,
               failed_attempts=attempts, error=error, finish_reason="error", finished_at=now)


def set_failed_attempts(conn: Connection, request_id: int, attempts: int) -> None:
    conn.execute(update(REQUESTS).where(REQUESTS.c.id == request_id).values(failed_attempts=attempts))


def insert_queued(conn: Connection, rows: Sequence[Mapping]) -> None:
    insert_many_with_status(conn, Request.__table__, RequestStatus.QUEUED, rows)


def ids_by_response(session: Session, rollout_id: int) -> list[Row]:
    """(id, group_id, response_index) of every request of the rollout."""
    return session.execute(select(Request.id, Request.group_id, Request.response_index)
                           .where(Request.rollout_id == rollout_id)).all()


def of_rollout_whole(conn: Connection, rollout_id: int) -> list[Row]:
    """Every column of every request of the rollout (the lease book's load)."""
    return conn.execute(select(Request.__table__).where(Request.rollout_id == rollout_id)).all()


def of_rollout(conn: Connection, rollout_id: int) -> list[Row]:
    """Every request, by id."""
    return conn.execute(select(Request.id, Request.group_id, Request.response_index, Request.status,
                               Request.is_probe, Request.generated_tokens, Request.finished_at)
                        .where(Request.rollout_id == rollout_id).order_by(Request.id)).all()


def count(conn: Connection, rollout_id: int) -> int:
    return conn.execute(select(func.count()).select_from(Request).where(Request.rollout_id == rollout_id)).scalar_one()


def counts(conn: Connection, rollout_id: int) -> Row:
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


def ended_counts(conn: Connection, rollout_id: int) -> Row:
    """(total, ended, failed): ended is finished or failed; failed is an ended one whose finish reason is error."""
    ended = Request.status.in_(ENDED)
    return conn.execute(select(func.count(), func.count().filter(ended),
                               func.count().filter(ended & (Request.finish_reason == "error")))
                        .where(Request.rollout_id == rollout_id)).one()


def groups_with_unended(conn: Connection, group_ids: Collection[int]) -> set[int]:
    """Of these groups, those with a request still to end."""
    return set(conn.execute(select(Request.group_id).where(
        Request.group_id.in_(list(group_ids)), Request.status.not_in(ENDED))).scalars())


def group_counts(conn: Connection, rollout_id: int) -> tuple[int, int]:
    """(groups, groups whose every request ended)."""
    unended = select(Request.group_id).where(Request.rollout_id == rollout_id, Request.status.not_in(ENDED))
    return tuple(conn.execute(select(func.count(), func.count().filter(Group.id.not_in(unended)))
                              .where(Group.rollout_id == rollout_id)).one())


def finished_lengths_by_prompt(conn: Connection, rollout_id: int) -> list[Row]:
    """(prompt_hash, generated_tokens) of every finished request of the rollout."""
    return conn.execute(select(Group.prompt_hash, Request.generated_tokens)
                        .join(Group, Group.id == Request.group_id)
                        .where(Request.rollout_id == rollout_id, Request.status == RequestStatus.FINISHED)).all()


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


def unfinished(conn: Connection, rollout_id: int) -> list[UnfinishedRequest]:
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


def nth_finish_at(conn: Connection, rollout_id: int, nth: int) -> float | None:
    """When the `nth` request (from 1) to finish finished; None before it has."""
    return conn.execute(select(Request.finished_at)
                        .where(Request.rollout_id == rollout_id, Request.status == RequestStatus.FINISHED)
                        .order_by(Request.finished_at).limit(1).offset(nth - 1)).scalar()


def last_finish_at(conn: Connection, rollout_id: int) -> float | None:
    return conn.execute(select(func.max(Request.finished_at))
                        .where(Request.rollout_id == rollout_id)).scalar()
