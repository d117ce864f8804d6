"""The tables the lease book writes and the statements of its hot path, built once and shared by
`book.py` and `reports.py`: SQLAlchemy compiles a statement once per cache key, and
`seerd.db.driver` compiles a kept statement once for the driver (see seerd/db/transitions.py
for why building them on every call cost CPU)."""

from __future__ import annotations

from sqlalchemy import bindparam, insert, select, update

from seerd.db import Chunk, ChunkStatus, Event, Group, Request, Rollout, Worker
from seerd.db.event import encode_json
from seerd.db.transitions import ROW_ID

CHUNKS, REQUESTS, GROUPS, EVENTS = Chunk.__table__, Request.__table__, Group.__table__, Event.__table__
ROLLOUTS, WORKERS = Rollout.__table__, Worker.__table__

FIRST_START = update(REQUESTS).where(REQUESTS.c.id == bindparam(ROW_ID), REQUESTS.c.started_at.is_(None)).values(
    started_at=bindparam("now"))
INSERT_EVENT = insert(EVENTS)
BIND_GROUP = update(GROUPS).where(GROUPS.c.id == bindparam("gid")).values(bound_worker=bindparam("worker"))
GROUP_COUNTS = update(GROUPS).where(GROUPS.c.id == bindparam("gid")).values(
    finished_requests=bindparam("fr"), length_estimate=bindparam("est"), finished_at=bindparam("fa"))
GROUP_FORECAST = update(GROUPS).where(GROUPS.c.id == bindparam("gid")).values(forecast_tokens=bindparam("forecast"))
WORKER_FIGURES = update(WORKERS).where(WORKERS.c.id == bindparam("wid")).values(
    last_heartbeat=bindparam("beat"), stats_json=bindparam("stats"))
# The values `change_status` sets with a chunk's or a request's report (bind names of the rows
# `reports.write_results` builds): built once, as a statement built per call would be.
CHUNK_DONE_VALUES = {
    "finished_at": bindparam("fin"), "num_tokens": bindparam("n"), "token_ids": bindparam("tok"),
    "logprobs": bindparam("lp"), "finish_reason": bindparam("fr"), "cached_tokens": bindparam("cached"),
    "lease_deadline": None}
REQUEST_COUNT_VALUES = {"generated_tokens": bindparam("gen"), "num_chunks": bindparam("nc")}
REQUEST_FINISH_REASON = bindparam("fr")
DONE_TOKENS = select(CHUNKS.c.token_ids).where(
    CHUNKS.c.request_id == bindparam("rid"), CHUNKS.c.status == ChunkStatus.DONE.value).order_by(CHUNKS.c.seq)


def stats_json(stats: dict | None) -> str | None:
    """A worker's heartbeat figures as `workers.stats_json` holds them (WORKER_FIGURES): with
    msgspec's encoder, as the event rows (`db.event`); json.dumps was 4% of the state thread at
    1,000 workers (py-spy)."""
    return encode_json(stats).decode() if stats else None
