"""The records the scheduler's state keeps (groups, requests, workers, leases) and the updates it
takes and works out (finished chunks and what they decide of their requests and groups)."""

from __future__ import annotations

from dataclasses import dataclass, field


class PlanError(RuntimeError):
    """A policy returned a plan that cannot be carried out (a bug in the policy)."""


@dataclass
class GroupRecord:
    id: int
    index: int
    prompt_len: int
    n: int
    max_tokens: int
    estimate: int  # the paper's L_g (its start value, max_tokens or a prior, until a response finishes)
    finished: int = 0
    failed: int = 0  # responses that ended failed (they never finish)
    request_ids: list[int] = field(default_factory=list)
    finished_lengths: list[int] = field(default_factory=list)  # in the order the responses finished


@dataclass
class RequestRecord:
    id: int
    group_id: int
    response_index: int
    is_probe: bool
    max_tokens: int
    generated: int = 0  # committed tokens
    last_worker: str | None = None  # the worker of its latest lease
    queued_at: float = 0.0  # when it began to wait for its next chunk
    finished: bool = False
    failed: bool = False  # ended without finishing (the engine failed its chunks too often)
    failed_on: set[str] = field(default_factory=set)  # workers whose engine failed one of its chunks

    @property
    def ended(self) -> bool:
        return self.finished or self.failed


@dataclass
class WorkerRecord:
    id: str
    rank: int
    max_chunks: int
    kv_capacity_tokens: int
    kv_block_tokens: int = 1  # its engine's KV block size: a chunk reserves whole blocks
    live: bool = True  # only live workers are offered to policies
    chunks: set[int] = field(default_factory=set)  # its leases' chunk ids
    kv_reserved: int = 0  # sum over its leases of context + budget, in whole blocks
    has_leased: bool = False  # its first lease (`first_chunk_tokens`) is behind it


@dataclass(eq=False, slots=True)
class LeaseRecord:
    """A chunk leased to a worker: what the scheduler reserved for it, and the daemon's fencing
    and liveness of it (the lease book sets them as it grants; the simulator has no use for them)."""

    chunk_id: int
    request_id: int
    worker_id: str
    max_tokens: int
    kv_reserved: int
    previous_worker: str | None  # where the request's previous chunk ran (None: its first chunk)
    epoch: int = 1  # the chunk row's lease epoch: a report of another epoch is stale
    seq: int = 0  # the chunk's index in its request
    deadline: float = 0.0  # when the lease expires unless a heartbeat shows its engine stepping


@dataclass(frozen=True)
class ChunkResult:
    chunk_id: int
    tokens: int  # tokens the chunk generated
    finished: bool  # the request is complete with them (the driver's judgement: EOS, budget, target)


@dataclass(frozen=True)
class RequestOutcome:
    request_id: int
    generated: int  # committed tokens once the chunk is applied
    finished: bool
    group_estimate: int | None = None  # the group's estimate right after this finish (None: not finished)


@dataclass(frozen=True)
class GroupOutcome:
    group_id: int
    finished: int  # finished responses once applied
    estimate: int
    complete: bool  # every response of the group has finished


@dataclass(frozen=True)
class ResultsUpdate:
    """Finished chunks worked out against the state but not applied yet (the book writes it first)."""

    now: float
    results: tuple[ChunkResult, ...]
    requests: tuple[RequestOutcome, ...]  # one per result, in the same order
    groups: tuple[GroupOutcome, ...]  # the groups with a finished response, in order of their first
