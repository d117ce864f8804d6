"""Builders shared by unit tests: a real SQLite run database with hand-made prompt rows, and real
processes that own a run directory."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from seerd.book.book import LeaseBook
from seerd.config import RunConfig
from seerd.coordinator.create import create_rollout
from seerd.coordinator.prior import PriorLengths
from seerd.db import make_engine, make_sessionmaker
from seerd.db.migrate import upgrade
from seerd.db.read import reading
from seerd.io.prompts import PromptRow
from seerd.protocol import parse_engine_id
from seerd.rundir import RunDir
from seerd.scheduler import make_policy
from seerd.scheduler.state import FIRST_CHUNK_SPREAD
from seerd.signing import Signer, call_key, httpx_auth
from sqlalchemy import select
from seerd.coordinator.model_identity import weight_version
from seerd.db import Rollout
from seerd.settings import Sampling
from seerd.worker.engine import ChunkResult, StepClock, Stream, run_whole
from seerd.worker.worker import LoadedWeights

REPO = Path(__file__).resolve().parents[2]


def loopback_socket() -> tuple[socket.socket, str]:
    """A socket bound to a free loopback port, and its "host:port": the API signs for the address
    its clients reach it at (`create_app(..., address=...)`), so tests bind before they build it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    host, port = sock.getsockname()[:2]
    return sock, f"{host}:{port}"


def signed_auth(secret: str, address: str = "", signer: Signer | None = None):  # noqa: ANN201
    """An httpx auth that signs calls to an API created with `secret` and `address` ("" in process),
    or with `signer`, for httpx clients and Starlette's TestClient (on httpx2 when installed)."""
    signer = signer or Signer(call_key(secret, address))
    try:
        import httpx2
    except ImportError:
        return httpx_auth(signer)
    return httpx_auth(signer, httpx2.Auth)


@contextlib.asynccontextmanager
async def served(app, sock: socket.socket | None = None, guard=None) -> AsyncIterator[str]:  # noqa: ANN001
    """`app` served on `sock` (else a free loopback port) by the coordinator's own server
    (`guard.api_server`: httptools behind the connection guard): its base URL, for a real client
    over a real socket."""
    from seerd.server.guard import ConnectionGuard, api_server

    if sock is None:
        sock, _ = loopback_socket()
    server = api_server(app, guard or ConnectionGuard())
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if serving.done():
            serving.result()  # it failed to start: raise why
            raise RuntimeError("uvicorn stopped before it started")
        await asyncio.sleep(0.01)
    host, port = sock.getsockname()[:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        await serving
        sock.close()


# A process that owns RUN_DIR (pretending to live on HOST when given) until it is killed.
HOLD = """
import socket, sys, time
from pathlib import Path
if len(sys.argv) > 3:
    socket.gethostname = lambda: sys.argv[3]
from seerd.ownership import take_ownership
ownership = take_ownership(Path(sys.argv[1]), heartbeat_s=float(sys.argv[2]))
print("owned", flush=True)
time.sleep(600)
"""


def python(script: str, *args: str, stdin: int | None = None) -> subprocess.Popen:
    """`script` in a new Python process that imports this checkout's seerd; stdout is a pipe."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stdin=stdin, text=True,
                            env=env, cwd=REPO)


@pytest.fixture
def holders():
    """`hold(run_dir)` starts a process that owns the run directory until the test ends."""
    started: list[subprocess.Popen] = []

    def hold(run: Path, *, heartbeat_s: float = 0.1, host: str | None = None) -> subprocess.Popen:
        proc = python(HOLD, str(run), str(heartbeat_s), *([host] if host else []))
        started.append(proc)
        assert proc.stdout.readline().strip() == "owned"
        return proc

    yield hold
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


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


VOCAB_SIZE = 1024  # the tiny model's (tests/fixtures/make_tiny_model.py)


def make_book(tmp_path: Path, *, policy: str = "divided", chunk_tokens: int = 16, lease_ttl_s: float = 10.0,
              prompt_rows: list[PromptRow] | None = None, now: float = 1000.0,
              db_name: str = "state.db", prior: PriorLengths | None = None, in_place: bool = False,
              first_chunk_spread: float = FIRST_CHUNK_SPREAD, rekey_in_place: bool = False) -> LeaseBook:
    engine = make_engine(tmp_path / db_name, synchronous="NORMAL")
    upgrade(engine)
    sessions = make_sessionmaker(engine)
    config = RunConfig(input_path="in.jsonl", model_path="model", policy=policy, chunk_tokens=chunk_tokens,
                       lease_ttl_s=lease_ttl_s)
    with sessions.begin() as session:
        rollout_id = create_rollout(session, config, prompt_rows or rows(), input_sha256="0" * 64, now=now,
                                    prior=prior)
    book = LeaseBook(sessions, rollout_id, make_policy(policy), chunk_tokens=chunk_tokens,
                     lease_ttl_s=lease_ttl_s, seed=0, vocab_size=VOCAB_SIZE, in_place=in_place,
                     first_chunk_spread=first_chunk_spread, rekey_in_place=rekey_in_place)
    book.load(now)
    return book


def scripted_tokens(request_id: int, start: int, count: int) -> list[int]:
    """The tokens `ScriptedEngine` generates for a request from position `start` on."""
    return [(request_id * 7 + position) % VOCAB_SIZE for position in range(start, start + count)]


class ScriptedEngine:
    """A worker's engine without vLLM (what `seerd.worker.worker.Worker` drives): each response is
    `length_of(request id)` tokens long, `scripted_tokens`, each chunk's worth after a short pause.
    A request opened to run on past its chunk (`stream`) keeps producing a chunk's worth
    (`chunk_tokens`) per pause until its limit or its end, as a real engine keeps decoding."""

    live = None  # no live figures for the heartbeat
    counters = None  # nor vLLM's step figures
    dtype = "scripted"  # no tensors
    kv_block_tokens = 1

    def __init__(self, length_of: Callable[[int], int], *, max_chunks: int = 4, pause_s: float = 0.01,
                 chunk_tokens: int = 16) -> None:
        self.length_of = length_of
        self.max_chunks = max_chunks
        self.kv_capacity_tokens = 1_000_000
        self.pause_s = pause_s
        self.chunk_tokens = chunk_tokens
        self.clock = StepClock()  # a step per pause
        self.opened: list[str] = []  # engine request ids, in the order they were opened
        self.aborted: list[str] = []
        self.feeding: dict[str, asyncio.Task] = {}

    def progress(self):  # noqa: ANN201
        return self.clock.progress(generating=len(self.feeding))

    def open(self, engine_id: str, prompt_token_ids: list[int], max_tokens: int, _sampling: Sampling,
             *, stream: bool = False) -> Stream:
        output = Stream(asyncio.get_running_loop())
        self.opened.append(engine_id)
        self.feeding[engine_id] = asyncio.create_task(self._feed(engine_id, prompt_token_ids, max_tokens, stream,
                                                                 output))
        return output

    async def _feed(self, engine_id: str, prompt_token_ids: list[int], max_tokens: int, stream: bool,
                    output: Stream) -> None:
        chunk = parse_engine_id(engine_id)
        position = len(prompt_token_ids) - chunk.prompt_len
        end = min(self.length_of(chunk.request_id), position + max_tokens)
        step = self.chunk_tokens if stream else max_tokens
        try:
            while True:
                await asyncio.sleep(self.pause_s)
                self.clock.record(self.pause_s)
                count = min(step, end - position)
                finished = position + count >= end
                reason = None if not finished else ("stop" if end == self.length_of(chunk.request_id) else "length")
                output.push(scripted_tokens(chunk.request_id, position, count), [-0.5] * count, reason, None)
                position += count
                if finished:
                    return
        finally:
            self.feeding.pop(engine_id, None)

    async def run(self, engine_id: str, prompt_token_ids: list[int], max_tokens: int,
                  sampling: Sampling) -> ChunkResult:
        return await run_whole(self, engine_id, prompt_token_ids, max_tokens, sampling)

    async def abort(self, engine_id: str) -> None:
        self.aborted.append(engine_id)
        task = self.feeding.pop(engine_id, None)
        if task is not None:
            task.cancel()

    async def reload_weights(self, path: str) -> float:
        return 0.0  # scripted tokens depend on no weights

    def shutdown(self) -> None:
        return None


def reopen(book: LeaseBook, now: float) -> LeaseBook:
    """A new coordinator on the same database (what a restart does)."""
    again = LeaseBook(book.sessions, book.rollout_id, book.policy, chunk_tokens=book.chunk_tokens,
                      lease_ttl_s=book.lease_ttl_s, seed=book.seed, vocab_size=book.vocab_size,
                      in_place=book.in_place)
    again.load(now)
    return again


# A run whose chunks are written by hand, with their workers and cached tokens, so that the report's
# prefix-cache and KV-pool figures can be checked exactly. Group 0 has a 200-token prompt, group 1 a
# 60-token one, 2 responses each. Per chunk: (group, response, seq, worker, num_tokens, cached_tokens,
# leased_at, finished_at); finished_at None: still leased. Times are seconds after HAND_T0, the first lease.
HAND_T0 = 2000.0
HAND_PROMPTS = (200, 60)
HAND_CHUNKS = (
    (0, 0, 0, "w0", 100, 128, 0.0, 1.0),
    (0, 0, 1, "w0", 100, 256, 1.0, 3.0),
    (0, 0, 2, "w1", 100, 384, 3.0, 6.0),
    (0, 0, 3, "w0", 100, 128, 6.0, 10.0),
    (0, 1, 0, "w1", 100, 0, 0.0, 2.0),
    (0, 1, 1, "w0", 100, 128, 2.0, 4.0),
    (0, 1, 2, "w0", 100, 256, 4.0, 7.0),
    (1, 0, 0, "w0", 50, 0, 0.5, 1.5),
    (1, 0, 1, "w1", 50, 0, 1.5, 5.0),
    (1, 0, 2, "w1", 50, None, 5.0, 8.0),  # the worker did not report cached tokens
    (1, 0, 3, "w1", 0, None, 8.0, None),
    (1, 1, 0, "w0", 0, None, 9.0, None),
)


def hand_built_cache_run(run_dir: Path, chunks: tuple = HAND_CHUNKS) -> Path:
    """A run database (unfinished) holding `chunks` as done or leased rows, with their events."""
    import json
    import sqlite3

    prompts = [PromptRow(f"p{g}", tuple(range(length)), 2, 1000, {}, g + 1)
               for g, length in enumerate(HAND_PROMPTS)]
    book = make_book(run_dir, policy="divided", prompt_rows=prompts, now=HAND_T0 - 10)
    for rank in (0, 1):
        book.register(rank=rank, address="hand", max_chunks=8, kv_capacity_tokens=10_000,
                      worker_id=f"w{rank}", now=HAND_T0 - 1)
    rollout_id = book.rollout_id
    book.close()
    book.engine.dispose()
    with sqlite3.connect(run_dir / "state.db") as db:
        request_of = {(g, r): rid for rid, g, r in db.execute(
            "SELECT r.id, g.group_index, r.response_index FROM requests r "
            "JOIN prompt_groups g ON g.id = r.group_id")}
        events = []
        for g, r, seq, worker, tokens, cached, leased, finished in chunks:
            rid = request_of[(g, r)]
            done = finished is not None
            cursor = db.execute(
                "INSERT INTO chunks (request_id, seq, max_tokens, status, lease_holder, lease_epoch, attempt, "
                "created_at, leased_at, finished_at, num_tokens, cached_tokens) "
                "VALUES (?, ?, 100, ?, ?, 1, 1, ?, ?, ?, ?, ?)",
                (rid, seq, "done" if done else "leased", worker, HAND_T0 + leased, HAND_T0 + leased,
                 HAND_T0 + finished if done else None, tokens, cached))
            events.append((HAND_T0 + leased, "chunk_leased", worker, rid, cursor.lastrowid,
                           {"seq": seq, "epoch": 1, "max_tokens": 100}))
            if done:
                events.append((HAND_T0 + finished, "chunk_done", worker, rid, cursor.lastrowid,
                               {"tokens": tokens, "cached_tokens": cached}))
            db.execute("UPDATE requests SET generated_tokens = generated_tokens + ?, num_chunks = num_chunks + ?, "
                       "status = ? WHERE id = ?", (tokens, int(done), "queued" if done else "running", rid))
        db.executemany(
            "INSERT INTO events (rollout_id, ts, kind, worker_id, request_id, chunk_id, data_json) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            [(rollout_id, ts, kind, worker, rid, cid, json.dumps(data))
             for ts, kind, worker, rid, cid, data in sorted(events, key=lambda e: e[0])])
        db.execute("UPDATE rollouts SET status = 'running', started_at = ? WHERE id = ?",
                   (HAND_T0 - 10, rollout_id))
    return run_dir


def rollout_weights(run_dir: RunDir) -> LoadedWeights:
    """The weights the run's (latest) rollout samples from, as a worker that loaded them holds them
    (the coordinator registers no worker of other weights)."""
    with reading(run_dir.db_path) as conn:
        model_path, fingerprint = conn.execute(select(Rollout.model_path, Rollout.model_fingerprint)
                                               .order_by(Rollout.id.desc()).limit(1)).one()
    return LoadedWeights(weight_version(model_path, fingerprint), 0.0)
