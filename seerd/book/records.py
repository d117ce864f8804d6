"""The lease book's own records of a run, besides the scheduler's state: what a grant needs of a
group, a request's progress, a lease's fencing and deadline, and the small values its methods
pass between a transaction and the in-memory change that follows its commit."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from seerd.protocol import ChunkReport, HeartbeatBody, UnreadableReport
from seerd.settings import Sampling


class UnknownWorker(LookupError):
    """The worker is not registered with this coordinator (it must register again)."""


class RetiredWorker(UnknownWorker):
    """The coordinator took the worker out (`coordinator.liveness`): it must exit, not register again."""

    def __init__(self, worker_id: str, reason: str) -> None:
        super().__init__(worker_id)
        self.reason = reason


class BookBroken(RuntimeError):
    """A write failed after the book's state had moved past the database (the leases of one
    transaction are applied as they are planned, `LeaseBook.leasing`): the book refuses every
    change from then on and the daemon stops the run, which resumes from the database."""


class ReportCall(NamedTuple):
    """One worker's report call, as `LeaseBook.report_calls` takes a batch of them."""

    worker_id: str
    reports: Sequence[ChunkReport | UnreadableReport]
    may_lease: bool = True
    wanted: int = 0
    heartbeat: HeartbeatBody | None = None  # carried by the call: applied in its turn, before the reports


@dataclass(frozen=True)
class GroupInputs:
    """What a grant needs of a group besides the scheduler's view."""

    prompt: array  # int32 prompt token ids
    sampling: Sampling


@dataclass
class RequestProgress:
    """What the book keeps of a request besides the scheduler's view."""

    num_chunks: int  # done chunks
    failed_attempts: int = 0  # chunks of it that failed: refused by the engine, or a report rejected
    open_chunk: tuple[int, int] | None = None  # (chunk id, epoch) of a QUEUED row left by a lease that ended
    # Generated tokens while unfinished, for the context of its next grant; None: not loaded yet,
    # or running in place (its worker's engine request holds the context, the database the tokens).
    tokens: array | None = None


class WaitingRequest(NamedTuple):
    """A queued request as `kvpool.queued_longest` names it (for the KV pool's trimming)."""

    group_id: int
    request_id: int
    queued_at: float


def chunk_seed(rollout_seed: int, group_index: int, response_index: int, seq: int) -> int:
    """A per-chunk seed from (rollout seed, request, chunk index): reproducible wherever it runs."""
    digest = hashlib.blake2b(f"{rollout_seed}:{group_index}:{response_index}:{seq}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") & 0x7FFF_FFFF


@dataclass
class Requeue:
    chunk_id: int
    request_id: int
    holder: str | None
    epoch: int


@dataclass(frozen=True)
class Failure:
    lease: Requeue
    attempts: int  # failed chunks of its request, this one included
    fatal: bool  # the request ends failed
