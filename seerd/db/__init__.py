"""SQLite state of a run: typed models (one module per noun), the engine factory, and the handles
the rest of seerd passes around (a connection, a session, their factories). Only `seerd.db`
imports SQLAlchemy: statements and queries live here (`seerd.db.queries`), and other packages hold
these handles without building SQL."""

from sqlalchemy import Connection, Engine, Row
from sqlalchemy.exc import SQLAlchemyError as DatabaseError
from sqlalchemy.orm import Session, sessionmaker

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
    "Base", "Chunk", "Connection", "DatabaseError", "Engine", "Row", "Session", "sessionmaker", "ChunkStatus", "Event", "Group", "PromptLengthHistory", "Request", "RequestStatus",
    "RequestTarget", "Rollout", "RolloutStatus", "Worker", "WorkerStatus", "add_event", "check_transition",
    "make_engine", "make_sessionmaker",
]
