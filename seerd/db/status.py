"""Status enums and the one table of allowed transitions for each (vLLM's habit).

Every status write in the code base goes through `seerd/db/transitions.py`, which checks this
table (and the row's current status in the database), so an impossible change (a finished chunk
leased again, a finished request re-queued) fails loudly instead of corrupting the run.
"""

from __future__ import annotations

import enum


class RolloutStatus(str, enum.Enum):
    CREATED = "created"
    RUNNING = "running"
    INTERRUPTED = "interrupted"  # the coordinator stopped (signal, crash found at resume)
    FINISHED = "finished"
    FAILED = "failed"


class RequestStatus(str, enum.Enum):
    QUEUED = "queued"  # waiting in the request buffer for its next chunk
    RUNNING = "running"  # one chunk of it is leased
    FINISHED = "finished"
    FAILED = "failed"  # the engine failed its chunks too often: it ends with the engine's message


class ChunkStatus(str, enum.Enum):
    QUEUED = "queued"
    LEASED = "leased"
    DONE = "done"
    FAILED = "failed"  # the engine failed it, and its request with it


class WorkerStatus(str, enum.Enum):
    ALIVE = "alive"
    STALE = "stale"  # missed heartbeats; its leases expire
    GONE = "gone"  # deregistered, or the coordinator restarted without it


ALLOWED_TRANSITIONS: dict[type[enum.Enum], dict[enum.Enum, frozenset[enum.Enum]]] = {
    RolloutStatus: {
        RolloutStatus.CREATED: frozenset({RolloutStatus.RUNNING, RolloutStatus.FAILED}),
        RolloutStatus.RUNNING: frozenset(
            {RolloutStatus.FINISHED, RolloutStatus.INTERRUPTED, RolloutStatus.FAILED}
        ),
        RolloutStatus.INTERRUPTED: frozenset({RolloutStatus.RUNNING, RolloutStatus.FAILED}),
        RolloutStatus.FAILED: frozenset({RolloutStatus.RUNNING}),  # resume after fixing the cause
        RolloutStatus.FINISHED: frozenset(),
    },
    RequestStatus: {
        RequestStatus.QUEUED: frozenset({RequestStatus.RUNNING}),
        RequestStatus.RUNNING: frozenset({RequestStatus.QUEUED, RequestStatus.FINISHED, RequestStatus.FAILED}),
        RequestStatus.FINISHED: frozenset(),
        RequestStatus.FAILED: frozenset(),
    },
    ChunkStatus: {
        ChunkStatus.QUEUED: frozenset({ChunkStatus.LEASED}),
        # LEASED -> QUEUED: the lease expired or its worker died; the chunk runs again elsewhere.
        ChunkStatus.LEASED: frozenset({ChunkStatus.DONE, ChunkStatus.QUEUED, ChunkStatus.FAILED}),
        ChunkStatus.DONE: frozenset(),
        ChunkStatus.FAILED: frozenset(),
    },
    WorkerStatus: {
        WorkerStatus.ALIVE: frozenset({WorkerStatus.STALE, WorkerStatus.GONE}),
        WorkerStatus.STALE: frozenset({WorkerStatus.ALIVE, WorkerStatus.GONE}),
        WorkerStatus.GONE: frozenset(),
    },
}


# The statuses a new row may start in: a chunk row is created when its first lease is granted.
ALLOWED_INITIAL: dict[type[enum.Enum], frozenset[enum.Enum]] = {
    RolloutStatus: frozenset({RolloutStatus.CREATED}),
    RequestStatus: frozenset({RequestStatus.QUEUED}),
    ChunkStatus: frozenset({ChunkStatus.LEASED}),
    WorkerStatus: frozenset({WorkerStatus.ALIVE}),
}


class IllegalTransition(RuntimeError):
    """A status change that its enum's transition table does not allow."""


def check_transition(current: enum.Enum, new: enum.Enum) -> None:
    allowed = ALLOWED_TRANSITIONS[type(current)][current]
    if new not in allowed:
        raise IllegalTransition(f"{type(current).__name__}: {current.value} -> {new.value} is not allowed")
