"""Per-prompt length history: lengths of earlier rollouts' responses, by prompt hash.

A rollout's own lengths are in its `requests` (finished ones); this table holds what earlier
rollouts of the same prompts produced, carried forward by `seerd run --prior RUN_DIR`: iteration
k copies iteration k-1's own lengths (age 1) and k-1's history (age + 1), up to
`seerd.coordinator.prior.MAX_HISTORY_AGE`, for the prompts that k contains.
"""

from __future__ import annotations

from sqlalchemy import ForeignKey, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from seerd.db.base import Base


class PromptLengthHistory(Base):
    __tablename__ = "prompt_length_history"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    # The rollout that imported the row (history is per run database, like everything else).
    rollout_id: Mapped[int] = mapped_column(ForeignKey("rollouts.id", ondelete="CASCADE"), index=True)
    prompt_hash: Mapped[str] = mapped_column(String(64), index=True)  # as prompt_groups.prompt_hash
    age: Mapped[int] = mapped_column(Integer)  # 1: the previous rollout's own response, 2: the one before, ...
    length: Mapped[int] = mapped_column(Integer)  # tokens of one finished response
