"""SQLite state of a run: typed models (one module per noun) and the engine factory."""

from seerd.db.base import Base, make_engine, make_sessionmaker
from seerd.db.chunk import Chunk
from seerd.db.event import Event, add_event
from seerd.db.group import Group
from seerd.db.history import PromptLengthHistory
from seerd.db.request import Request
from seerd.db.rollout import Rollout
from seerd.db.status import ChunkStatus, RequestStatus, RolloutStatus, WorkerStatus, check_transition
from seerd.db.target import RequestTarget
from seerd.db.worker import Worker

__all__ = [
    "Base", "Chunk", "ChunkStatus", "Event", "Group", "PromptLengthHistory", "Request", "RequestStatus",
    "RequestTarget", "Rollout", "RolloutStatus", "Worker", "WorkerStatus", "add_event", "check_transition",
    "make_engine", "make_sessionmaker",
]
