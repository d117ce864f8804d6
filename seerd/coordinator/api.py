"""The coordinator's HTTP API for workers and monitors.

Every request, on every path, must carry the run's secret (`Authorization: Bearer <secret>`);
anything else gets 401 before routing. Handlers call the lease book synchronously on the event
loop: the book is the single owner of the state, so its transactions never interleave.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from seerd.coordinator.book import BadReport, ChunkReport, LeaseBook, UnknownWorker

API_PREFIX = "/v1"


class RegisterBody(BaseModel):
    worker_id: str = Field(min_length=1, max_length=100)
    rank: int = Field(ge=0)
    address: str
    max_chunks: int = Field(ge=1)
    kv_capacity_tokens: int = Field(ge=1)


class LeaseBody(BaseModel):
    worker_id: str
    wanted: int = Field(ge=0)


class ReportItem(BaseModel):
    chunk_id: int
    epoch: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    cached_tokens: int | None = None


class ReportBody(BaseModel):
    worker_id: str
    reports: list[ReportItem]


class ReleaseBody(BaseModel):
    worker_id: str
    chunk_id: int
    epoch: int
    reason: str = ""


class HeartbeatBody(BaseModel):
    worker_id: str
    running: list[int] = []
    stats: dict = {}


class CoordinatorControl:
    """What the API needs from the daemon besides the book: whether to hand out work at all."""

    def __init__(self) -> None:
        self.accepting = True  # false while draining (shutdown, preemption)
        self.scheduling_gate: Callable[[], bool] = lambda: True  # e.g. wait for every worker
        self.worker_stats: dict[str, dict] = {}
        self.told_done: set[str] = set()  # workers that have heard the rollout is complete
        self.busy_s = 0.0  # time spent handling API calls: the coordinator's cost to the rollout
        self.calls = 0


def create_app(book: LeaseBook, secret: str, control: CoordinatorControl,
               clock: Callable[[], float] = time.time) -> FastAPI:
    app = FastAPI(title="seerd coordinator", docs_url=None, redoc_url=None, openapi_url=None)
    expected = f"Bearer {secret}".encode()

    @app.middleware("http")
    async def require_secret(request: Request, call_next):  # noqa: ANN001, ANN202
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            return JSONResponse({"detail": "missing or wrong token"}, status_code=401)
        started = time.perf_counter()
        try:
            return await call_next(request)
        finally:
            control.busy_s += time.perf_counter() - started
            control.calls += 1

    def known(worker_id: str) -> None:
        try:
            book._worker(worker_id)
        except UnknownWorker:
            raise HTTPException(404, f"unknown worker {worker_id}; register again") from None

    @app.get(f"{API_PREFIX}/config")
    async def engine_config(request: Request) -> dict:
        return request.app.state.engine_settings

    @app.post(f"{API_PREFIX}/register")
    async def register(body: RegisterBody) -> dict:
        worker = book.register(rank=body.rank, address=body.address, max_chunks=body.max_chunks,
                               kv_capacity_tokens=body.kv_capacity_tokens, worker_id=body.worker_id,
                               now=clock())
        return {"worker_id": worker.id, "lease_ttl_s": book.lease_ttl_s,
                "heartbeat_interval_s": max(0.2, book.lease_ttl_s / 4)}

    @app.post(f"{API_PREFIX}/lease")
    async def lease(body: LeaseBody) -> dict:
        known(body.worker_id)
        if book.is_complete():
            control.told_done.add(body.worker_id)
            return {"chunks": [], "done": True}
        if not control.accepting or not control.scheduling_gate():
            return {"chunks": [], "done": False, "retry_after_s": 0.5}
        grants = book.lease(body.worker_id, body.wanted, clock())
        return {"chunks": [grant.__dict__ for grant in grants], "done": False,
                "retry_after_s": 0.05 if grants else 0.2}

    @app.post(f"{API_PREFIX}/report")
    async def report(body: ReportBody) -> dict:
        known(body.worker_id)
        results = []
        for item in body.reports:
            try:
                outcome = book.report(body.worker_id, ChunkReport(**item.model_dump()), clock())
            except BadReport as exc:
                raise HTTPException(422, f"chunk {item.chunk_id}: {exc}") from None
            results.append({"chunk_id": item.chunk_id, "accepted": outcome.accepted,
                            "duplicate": outcome.duplicate, "reason": outcome.reason})
        return {"results": results, "done": book.is_complete()}

    @app.post(f"{API_PREFIX}/release")
    async def release(body: ReleaseBody) -> dict:
        known(body.worker_id)
        return {"released": book.release(body.worker_id, body.chunk_id, body.epoch, body.reason, clock())}

    @app.post(f"{API_PREFIX}/heartbeat")
    async def heartbeat(body: HeartbeatBody) -> dict:
        known(body.worker_id)
        abort = book.heartbeat(body.worker_id, body.running, clock())
        control.worker_stats[body.worker_id] = body.stats
        done = book.is_complete()
        if done:
            control.told_done.add(body.worker_id)
        return {"abort": abort, "done": done}

    @app.get(f"{API_PREFIX}/status")
    async def status() -> dict:
        return {"rollout_id": book.rollout_id, "policy": book.policy.name, **book.counts(),
                "complete": book.is_complete(), "accepting": control.accepting,
                "coordinator_busy_s": control.busy_s, "api_calls": control.calls}

    return app
