"""A rollout: one job's whole batch of groups, with its configuration."""

from __future__ import annotations

from sqlalchemy import Float, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from seerd.db.base import Base
from seerd.db.status import RolloutStatus
from seerd.db.types import status_column_type


class Rollout(Base):
    __tablename__ = "rollouts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    status: Mapped[RolloutStatus] = mapped_column(status_column_type(RolloutStatus))
    policy: Mapped[str] = mapped_column(String(32))
    seed: Mapped[int] = mapped_column(Integer)
    model_path: Mapped[str] = mapped_column(Text)
    input_path: Mapped[str] = mapped_column(Text)
    input_sha256: Mapped[str] = mapped_column(String(64))
    # The full RunConfig as JSON: what `seerd resume` needs to start the same run again.
    config_json: Mapped[str] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(Float)
    started_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    # Why the run failed or was interrupted, for people and for the job's exit status.
    status_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    # The model directory's fingerprint (JSON, seerd/coordinator/model_identity.py): taken at creation,
    # compared at every coordinator start; None for runs created before it was recorded.
    model_fingerprint: Mapped[str | None] = mapped_column(Text, nullable=True)
