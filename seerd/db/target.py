"""A response's target length (benchmarks): where the worker ends it, as if the model emitted EOS.

Its own table, not a column of `requests`, so that nothing that loads requests for the scheduler
can pick it up: the lease book reads it only to tell a worker where to stop (see `ChunkGrant`).
"""

from __future__ import annotations

from sqlalchemy import ForeignKey, Integer
from sqlalchemy.orm import Mapped, mapped_column

from seerd.db.base import Base


class RequestTarget(Base):
    __tablename__ = "request_targets"

    request_id: Mapped[int] = mapped_column(ForeignKey("requests.id", ondelete="CASCADE"), primary_key=True)
    target_length: Mapped[int] = mapped_column(Integer)
