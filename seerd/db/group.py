"""A group: one prompt and its n requests, with the group's length estimate."""

from __future__ import annotations

from sqlalchemy import Float, ForeignKey, Integer, LargeBinary, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from seerd.db.base import Base


class Group(Base):
    # "groups" is an SQLite keyword (window frames); a plain name avoids quoting everywhere.
    __tablename__ = "prompt_groups"
    __table_args__ = (UniqueConstraint("rollout_id", "group_index"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    rollout_id: Mapped[int] = mapped_column(ForeignKey("rollouts.id", ondelete="CASCADE"), index=True)
    group_index: Mapped[int] = mapped_column(Integer)  # position in the input file
    prompt_id: Mapped[str] = mapped_column(Text)
    prompt_token_ids: Mapped[bytes] = mapped_column(LargeBinary)  # int32 little-endian
    prompt_len: Mapped[int] = mapped_column(Integer)
    # sha256 of the prompt tokens: matches the same prompt across rollouts (length history).
    prompt_hash: Mapped[str] = mapped_column(String(64), index=True)
    n: Mapped[int] = mapped_column(Integer)
    max_tokens: Mapped[int] = mapped_column(Integer)
    sampling_json: Mapped[str] = mapped_column(Text)  # per-row overrides merged over the run's defaults
    # Expected response length; until a request of the group finishes it is max_tokens.
    length_estimate: Mapped[int] = mapped_column(Integer)
    # The coordinator's forecast of the group's longest response, in tokens (what seer schedules
    # by); NULL until it first writes one. Read by `seerd status` for the time left.
    forecast_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # The group's probe (speculative request). No FK: requests reference groups already.
    probe_request_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # `group` policy only: the worker this whole group is bound to (veRL's static split).
    bound_worker: Mapped[str | None] = mapped_column(String(128), nullable=True)
    finished_requests: Mapped[int] = mapped_column(Integer, default=0)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)
