"""A request: one response of a group, generated chunk by chunk."""

from __future__ import annotations

from sqlalchemy import Boolean, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from seerd.db.base import Base
from seerd.db.status import RequestStatus
from seerd.db.types import status_column_type


class Request(Base):
    __tablename__ = "requests"
    __table_args__ = (
        UniqueConstraint("group_id", "response_index"),
        Index("ix_requests_rollout_status", "rollout_id", "status"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    rollout_id: Mapped[int] = mapped_column(ForeignKey("rollouts.id", ondelete="CASCADE"))
    group_id: Mapped[int] = mapped_column(ForeignKey("prompt_groups.id", ondelete="CASCADE"), index=True)
    response_index: Mapped[int] = mapped_column(Integer)
    status: Mapped[RequestStatus] = mapped_column(status_column_type(RequestStatus))
    is_probe: Mapped[bool] = mapped_column(Boolean, default=False)
    generated_tokens: Mapped[int] = mapped_column(Integer, default=0)  # committed (done chunks) only
    num_chunks: Mapped[int] = mapped_column(Integer, default=0)  # done chunks
    finish_reason: Mapped[str | None] = mapped_column(String(16), nullable=True)
    last_worker: Mapped[str | None] = mapped_column(String(128), nullable=True)  # affinity
    queued_at: Mapped[float] = mapped_column(Float)  # since when it waits in the buffer
    started_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)  # or when it failed
    # Chunks of it the engine failed (a poison request ends `failed` at LeaseBook.MAX_FAILED_ATTEMPTS).
    failed_attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    error: Mapped[str | None] = mapped_column(Text, nullable=True)  # the engine's message, once failed
