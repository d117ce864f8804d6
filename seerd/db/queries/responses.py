"""Responses as the export and the draft history read them: a request's done chunks' tokens."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from sqlalchemy import Connection, Row, select

from seerd.db.chunk import Chunk
from seerd.db.group import Group
from seerd.db.request import Request
from seerd.db.status import ChunkStatus, RequestStatus

ENDED = (RequestStatus.FINISHED, RequestStatus.FAILED)


def ended_of_groups(conn: Connection, group_ids: Sequence[int]) -> list[Request]:
    """The ended requests (finished or failed) of these groups, as rows of the model."""
    from sqlalchemy.orm import Session

    with Session(bind=conn) as session:
        return list(session.execute(select(Request).where(Request.group_id.in_(list(group_ids)),
                                                          Request.status.in_(ENDED))).scalars())


def chunks_of_requests(conn: Connection, request_ids: Sequence[int]) -> Iterator[Row]:
    """(request_id, status, token_ids, logprobs, leased_at, finished_at) of every chunk of these
    requests, by request and sequence number. Filter on status in Python: with it in the query
    SQLite chose the status index and read every done chunk of the run for each call."""
    return iter(conn.execute(select(Chunk.request_id, Chunk.status, Chunk.token_ids, Chunk.logprobs, Chunk.leased_at,
                                    Chunk.finished_at)
                             .where(Chunk.request_id.in_(list(request_ids))).order_by(Chunk.request_id, Chunk.seq)))


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
