"""A worker: one vLLM engine that leases chunks."""

from __future__ import annotations

from sqlalchemy import Float, ForeignKey, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from seerd.db.base import Base
from seerd.db.status import WorkerStatus
from seerd.db.types import status_column_type


class Worker(Base):
    __tablename__ = "workers"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    rollout_id: Mapped[int] = mapped_column(ForeignKey("rollouts.id", ondelete="CASCADE"), index=True)
    rank: Mapped[int] = mapped_column(Integer)
    address: Mapped[str] = mapped_column(Text)  # host:pid of the worker process
    max_chunks: Mapped[int] = mapped_column(Integer)  # concurrent sequences the engine admits
    kv_capacity_tokens: Mapped[int] = mapped_column(Integer)
    status: Mapped[WorkerStatus] = mapped_column(status_column_type(WorkerStatus))
    registered_at: Mapped[float] = mapped_column(Float)
    last_heartbeat: Mapped[float] = mapped_column(Float)
    # The worker's own figures at its last heartbeat (tokens/s, KV held, progress of running
    # chunks, drafts): ephemeral, kept here so `seerd status` reads them without the coordinator.
    stats_json: Mapped[str | None] = mapped_column(Text, nullable=True)
