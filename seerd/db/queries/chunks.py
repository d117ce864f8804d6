"""Chunks: bounded slices of a request's generation. The lease book's writes (`lease`, `done`,
`requeue`, `fail`) run on its hot path: their statements are built once (`seerd.db.transitions`,
`seerd.db.driver`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from sqlalchemy import Connection, Row, bindparam, func, select

from seerd.db.chunk import Chunk
from seerd.db.request import Request
from seerd.db.status import ChunkStatus
from seerd.db.transitions import ROW_EPOCH, ROW_ID, change_one, change_status, insert_many_returning_ids

CHUNKS = Chunk.__table__
# The values `done` sets (bind names of its rows), built once, as a statement built per call would be.
DONE_VALUES = {
    "finished_at": bindparam("fin"), "num_tokens": bindparam("n"), "token_ids": bindparam("tok"),
    "logprobs": bindparam("lp"), "finish_reason": bindparam("fr"), "cached_tokens": bindparam("cached"),
    "lease_deadline": None}
DONE_TOKENS = select(CHUNKS.c.token_ids).where(
    CHUNKS.c.request_id == bindparam("rid"), CHUNKS.c.status == ChunkStatus.DONE.value).order_by(CHUNKS.c.seq)


def insert_leased(conn: Connection, rows: Sequence[Mapping]) -> list[int]:
    """New chunk rows, `leased` (all columns given); their ids, in order."""
    return insert_many_returning_ids(conn, CHUNKS, ChunkStatus.LEASED, rows)


def lease_again(conn: Connection, rows: Sequence[Mapping], *, worker_id: str, deadline: float, now: float) -> None:
    """Chunk rows an ended lease left `queued` (`row_id`, `row_epoch` guard, `budget`), leased to
    `worker_id` at the next epoch and attempt. Its values hold SQL expressions, so the statement
    is built for the call (rare: a request whose lease ended)."""
    change_status(conn, CHUNKS, ChunkStatus.QUEUED, ChunkStatus.LEASED, rows, guard_epoch=True, values={
        "max_tokens": bindparam("budget"), "lease_holder": worker_id, "lease_deadline": deadline,
        "lease_epoch": CHUNKS.c.lease_epoch + 1, "attempt": CHUNKS.c.attempt + 1, "leased_at": now})


def done(conn: Connection, rows: Sequence[Mapping]) -> None:
    """Leased chunks `done` with their tokens, guarded by their lease epoch: rows of `row_id`,
    `row_epoch`, `fin` (finished at), `n` (tokens), `tok`, `lp` (packed ids and logprobs), `fr`
    (finish reason), `cached` (cached tokens)."""
    change_status(conn, CHUNKS, ChunkStatus.LEASED, ChunkStatus.DONE, rows, guard_epoch=True, values=DONE_VALUES)


def requeue(conn: Connection, leases: Sequence[tuple[int, int]]) -> None:
    """Leased chunks (chunk id, lease epoch) back to `queued`, their lease cleared."""
    change_status(conn, CHUNKS, ChunkStatus.LEASED, ChunkStatus.QUEUED,
                  [{ROW_ID: chunk_id, ROW_EPOCH: epoch} for chunk_id, epoch in leases],
                  values={"lease_holder": None, "lease_deadline": None}, guard_epoch=True)


def fail(conn: Connection, chunk_id: int, now: float) -> None:
    """A leased chunk `failed` (its request ends with it)."""
    change_one(conn, CHUNKS, chunk_id, ChunkStatus.LEASED, ChunkStatus.FAILED, finished_at=now,
               finish_reason="error", lease_deadline=None)


def done_tokens(conn: Connection, request_id: int) -> Iterator[bytes]:
    """A request's done chunks' packed token ids, in order."""
    return iter(conn.execute(DONE_TOKENS, {"rid": request_id}).scalars())


def lease_of(conn: Connection, chunk_id: int) -> Row | None:
    """(status, lease_epoch, lease_holder) of a chunk, None if there is none."""
    return conn.execute(select(CHUNKS.c.status, CHUNKS.c.lease_epoch, CHUNKS.c.lease_holder)
                        .where(CHUNKS.c.id == chunk_id)).first()


def of_rollout(conn: Connection, rollout_id: int) -> list[Row]:
    """Every chunk of the rollout's requests (without its tokens)."""
    return conn.execute(select(Chunk.request_id, Chunk.seq, Chunk.status, Chunk.num_tokens,
                               Chunk.lease_holder, Chunk.cached_tokens, Chunk.finished_at)
                        .join(Request, Request.id == Chunk.request_id)
                        .where(Request.rollout_id == rollout_id)).all()


def unfinished(conn: Connection, rollout_id: int) -> list[Row]:
    """(id, request_id, status, lease_epoch, lease_holder) of every chunk not done."""
    return conn.execute(select(Chunk.id, Chunk.request_id, Chunk.status, Chunk.lease_epoch, Chunk.lease_holder)
                        .join(Request, Request.id == Chunk.request_id)
                        .where(Request.rollout_id == rollout_id, Chunk.status != ChunkStatus.DONE)).all()


def tokens_done_since(conn: Connection, rollout_id: int, since: float) -> int:
    """Tokens of the chunks that finished at `since` or later."""
    return conn.execute(select(func.coalesce(func.sum(Chunk.num_tokens), 0))
                        .join(Request, Request.id == Chunk.request_id)
                        .where(Request.rollout_id == rollout_id, Chunk.status == ChunkStatus.DONE,
                               Chunk.finished_at >= since)).scalar_one()
