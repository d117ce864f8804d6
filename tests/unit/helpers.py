"""Builders shared by unit tests: a real SQLite run database with hand-made prompt rows."""

from __future__ import annotations

from pathlib import Path

from seerd.config import RunConfig
from seerd.coordinator.book import LeaseBook
from seerd.coordinator.create import create_rollout
from seerd.coordinator.prior import PriorLengths
from seerd.db import make_engine, make_sessionmaker
from seerd.db.migrate import upgrade
from seerd.io.prompts import PromptRow
from seerd.scheduler import make_policy


class FakeClock:
    """An injected clock: tests move time instead of sleeping."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def rows(groups: int = 2, n: int = 2, max_tokens: int = 40, prompt_len: int = 5) -> list[PromptRow]:
    return [PromptRow(f"p{g}", tuple(range(10 + g, 10 + g + prompt_len)), n, max_tokens, {}, g + 1)
            for g in range(groups)]


def make_book(tmp_path: Path, *, policy: str = "divided", chunk_tokens: int = 16, lease_ttl_s: float = 10.0,
              prompt_rows: list[PromptRow] | None = None, now: float = 1000.0,
              db_name: str = "state.db", prior: PriorLengths | None = None) -> LeaseBook:
    engine = make_engine(tmp_path / db_name, synchronous="NORMAL")
    upgrade(engine)
    sessions = make_sessionmaker(engine)
    config = RunConfig(input_path="in.jsonl", model_path="model", policy=policy, chunk_tokens=chunk_tokens,
                       lease_ttl_s=lease_ttl_s)
    with sessions.begin() as session:
        rollout_id = create_rollout(session, config, prompt_rows or rows(), input_sha256="0" * 64, now=now,
                                    prior=prior)
    book = LeaseBook(sessions, rollout_id, make_policy(policy), chunk_tokens=chunk_tokens,
                     lease_ttl_s=lease_ttl_s, seed=0)
    book.load(now)
    return book


def reopen(book: LeaseBook, now: float) -> LeaseBook:
    """A new coordinator on the same database (what a restart does)."""
    again = LeaseBook(book.sessions, book.rollout_id, book.policy, chunk_tokens=book.chunk_tokens,
                      lease_ttl_s=book.lease_ttl_s, seed=book.seed)
    again.load(now)
    return again
