"""A chunk: one bounded slice of a request's generation, and the lease that runs it."""

from __future__ import annotations

from sqlalchemy import Float, ForeignKey, Index, Integer, LargeBinary, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from seerd.db.base import Base
from seerd.db.status import ChunkStatus
from seerd.db.types import status_column_type


class Chunk(Base):
    __tablename__ = "chunks"
    __table_args__ = (
        UniqueConstraint("request_id", "seq"),
        Index("ix_chunks_status_deadline", "status", "lease_deadline"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    # Looked up through the unique (request_id, seq) index: one of its own cost every lease a page of WAL.
    request_id: Mapped[int] = mapped_column(ForeignKey("requests.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(Integer)  # 0, 1, ... within the request
    max_tokens: Mapped[int] = mapped_column(Integer)  # decided when leased
    status: Mapped[ChunkStatus] = mapped_column(status_column_type(ChunkStatus))
    lease_holder: Mapped[str | None] = mapped_column(String(128), nullable=True)
    lease_deadline: Mapped[float | None] = mapped_column(Float, nullable=True)
    # Bumped at every lease; a report must carry the current epoch (fencing of stale workers).
    lease_epoch: Mapped[int] = mapped_column(Integer, default=0)
    attempt: Mapped[int] = mapped_column(Integer, default=0)  # leases handed out so far
    created_at: Mapped[float] = mapped_column(Float)
    leased_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    num_tokens: Mapped[int] = mapped_column(Integer, default=0)
    token_ids: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)  # int32 LE
    logprobs: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)  # float32 LE
    finish_reason: Mapped[str | None] = mapped_column(String(16), nullable=True)
    # Prompt tokens the engine found in its prefix cache (how cheap the continuation was).
    cached_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
