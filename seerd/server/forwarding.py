"""The coordinator's side of its API fronts (front.py): it starts them on its listening socket,
answers the calls they forward with the API's own handlers, and starts a front again if one dies.

`ApiFronts` stands where the in-process `uvicorn.Server` stands in the daemon (`started`,
`should_exit`, `serve(sockets=...)`). Its handlers are the endpoints of the very app that
`create_app` builds, called directly: the signature check, the guard and the body limit ran in
the front, and Starlette's routing and middleware layers would add back a share of the cost the
fronts take away. The nonces are checked here, once for all fronts.

How many fronts: `api_processes_for(workers)`; `seerd run --api-processes N` overrides it.
Measured in docs/benchmarks.md (tools/bench/load.py --api-processes).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, fields

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Route

from seerd import cpu
from seerd.server.auth import REPLAYED, SeenNonces
from seerd.server.front import (
    FROM_FRONT, Answer, ForwardedCall, FrontReady, FrontSetup, FrontTally, Link, Stop,
)
from seerd.protocol import ErrorReply
from seerd.server.guard import SHUTDOWN_GRACE_S, ConnectionLimits, GuardCounters
from seerd.server.latency import WAITED_SCOPE_KEY

log = logging.getLogger("seerd.coordinator")

# From this many workers the coordinator serves its API through front processes: below it one
# process answers within milliseconds (512 workers: lease p99 under 100 ms, docs/benchmarks.md),
# and a front costs a process and a hop per call.
FRONTS_FROM_WORKERS = 600
DEFAULT_FRONTS = 2
LISTEN_BACKLOG = 2048  # uvicorn's own default
MAX_RESTARTS = 20  # fronts started again after dying, before the coordinator gives up on them
_JSON = "application/json"


def api_processes_for(workers: int) -> int:
    """Fronts for a run of `workers` workers: none (HTTP in the coordinator's process) below
    `FRONTS_FROM_WORKERS`."""
    return DEFAULT_FRONTS if workers >= FRONTS_FROM_WORKERS else 0


@dataclass
class FrontsGuard:
    """The fronts' connection-guard counters summed: what `RefusalCollector` reads of a `ConnectionGuard`."""

    counters: GuardCounters = field(default_factory=GuardCounters)
    unproven_open: int = 0


class ForwardedCalls:
    """Answers forwarded calls with the app's endpoints, as the in-process app would: the same
    handlers, the same error answers, the same counts in `control`."""

    def __init__(self, app: Starlette, control) -> None:  # noqa: ANN001
        self.app = app
        self.control = control
        self.nonces = SeenNonces()
        self.replays = 0  # calls refused here as replays (the fronts count the other refusals)
        self.endpoints = {(method, route.path): route.endpoint for route in app.routes if isinstance(route, Route)
                          for method in route.methods or ()}

    async def answer(self, call: ForwardedCall) -> Answer:
        control = self.control
        if call.nonce and not self.nonces.add(call.nonce, call.nonce_expires, time.time()):
            self.replays += 1
            return _error(call.call_id, 401, REPLAYED, close=True, fresh=False)
        endpoint = self.endpoints.get((call.method, call.path))
        if endpoint is None:
            known = any(path == call.path for _, path in self.endpoints)
            return _error(call.call_id, 405 if known else 404, "Method Not Allowed" if known else "Not Found")
        scope = {"type": "http", "method": call.method, "path": call.path, "query_string": call.query,
                 "headers": [], "app": self.app}
        request = Request(scope, _body_once(call.body))
        started = time.perf_counter()
        try:
            response = await endpoint(request)
        except Exception as exc:  # noqa: BLE001 - the app's handler for it answers, else a 500 as uvicorn would
            handler = next((h for kind, h in self.app.exception_handlers.items()
                            if isinstance(kind, type) and isinstance(exc, kind)), None)
            if handler is None:
                log.error("a forwarded %s %s failed", call.method, call.path, exc_info=exc)
                return _error(call.call_id, 500, "Internal Server Error")
            response = await handler(request, exc)
        finally:
            took = time.perf_counter() - started
            control.busy_s += took
            control.calls += 1
            control.latencies.add(call.path, took - scope.get(WAITED_SCOPE_KEY, 0.0))
        return Answer(call.call_id, response.status_code, bytes(response.body), response.media_type or _JSON,
                      response.headers.get("connection") == "close", True)


def _body_once(body: bytes):  # noqa: ANN202
    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}
    return receive


def _error(call_id: int, status: int, detail: str, *, close: bool = False, fresh: bool = True) -> Answer:
    return Answer(call_id, status, msgspec.json.encode(ErrorReply(detail)), _JSON, close, fresh)


class _FrontProcess:
    def __init__(self, index: int, process: subprocess.Popen, link: Link) -> None:
        self.index, self.process, self.link = index, process, link
        self.ready = False


class ApiFronts:
    """The API served by `count` front processes on the coordinator's listening socket."""

    def __init__(self, app: Starlette, control, count: int, *, secret: str, address: str,  # noqa: ANN001
                 metrics_token: str | None, max_body_bytes: int, limits: ConnectionLimits) -> None:
        self.calls = ForwardedCalls(app, control)
        self.control = control
        self.count = count
        self.setup = dict(secret=secret, address=address, metrics_token=metrics_token, max_body_bytes=max_body_bytes,
                          limits={f.name: getattr(limits, f.name) for f in fields(limits)})
        self.guard = FrontsGuard()
        self.started = False
        self.restarts = 0
        self._should_exit = False
        self._fronts: dict[int, _FrontProcess] = {}
        self._tallies: dict[int, FrontTally] = {}
        self._changed = asyncio.Event()

    @property
    def should_exit(self) -> bool:
        return self._should_exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        """Like uvicorn's: the fronts stop accepting and finish the calls in flight."""
        if value and not self._should_exit:
            self._should_exit = True
            for front in self._fronts.values():
                front.link.send(Stop())
            self._changed.set()

    async def serve(self, sockets: list[socket.socket]) -> None:
        (sock,) = sockets
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
        try:
            for index in range(self.count):
                await self._start(index, sock)
            while not self._should_exit:
                await self._changed.wait()
                self._changed.clear()
                if not self._should_exit:
                    await self._start_again(sock)
            await self._stopped(deadline=time.monotonic() + SHUTDOWN_GRACE_S + 5.0)
        finally:
            for front in self._fronts.values():
                if front.process.poll() is None:
                    front.process.kill()
                    front.process.wait()
                front.link.close()
                cpu.forget_helper(front.process.pid)

    async def _start(self, index: int, sock: socket.socket) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        process = subprocess.Popen([sys.executable, "-m", "seerd.server.front", str(sock.fileno()), str(theirs.fileno())],
                                   pass_fds=(sock.fileno(), theirs.fileno()), stdin=subprocess.DEVNULL)
        theirs.close()
        loop = asyncio.get_running_loop()
        _, link = await loop.create_unix_connection(
            lambda: Link(FROM_FRONT, lambda frame: self._on_frame(index, frame), self._changed.set), sock=ours)
        self._fronts[index] = _FrontProcess(index, process, link)
        cpu.count_helper(process.pid, f"api-front-{index}")
        link.send(FrontSetup(index=index, **self.setup))

    async def _start_again(self, sock: socket.socket) -> None:
        """Fronts that died started again (their connections died with them: the workers reconnect)."""
        for index, front in list(self._fronts.items()):
            if front.link.open and front.process.poll() is None:
                continue
            if self.restarts >= MAX_RESTARTS:
                raise RuntimeError(f"API front {index} died {self.restarts} times (exit {front.process.poll()})")
            self.restarts += 1
            if front.process.poll() is None:  # its link is gone: it serves nobody
                front.process.kill()
            log.error("API front %d exited (%s); starting it again", index, front.process.wait())
            front.link.close()
            cpu.forget_helper(front.process.pid)
            await self._start(index, sock)

    async def _stopped(self, deadline: float) -> None:
        for front in self._fronts.values():
            while front.process.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)

    def _on_frame(self, index: int, frame: object) -> None:
        if isinstance(frame, ForwardedCall):
            asyncio.get_running_loop().create_task(self._answer(index, frame))
        elif isinstance(frame, FrontTally):
            self._tallies[index] = frame
            self._sum_tallies()
        elif isinstance(frame, FrontReady):
            self._fronts[index].ready = True
            self.started = all(front.ready for front in self._fronts.values()) and len(self._fronts) == self.count

    async def _answer(self, index: int, call: ForwardedCall) -> None:
        answer = await self.calls.answer(call)
        front = self._fronts.get(index)
        if front is not None:
            front.link.send(answer)

    def _sum_tallies(self) -> None:
        totals: dict[str, int] = {"replayed": self.calls.replays} if self.calls.replays else {}
        closed = asdict(GuardCounters())
        closed_fields = set(closed)
        for tally in self._tallies.values():
            for reason, count in tally.refused.items():
                totals[reason] = totals.get(reason, 0) + count
            for reason, count in tally.closed.items():
                closed[reason] = closed.get(reason, 0) + count
        refused = self.control.refused  # read by /metrics (RefusalCollector): updated in place
        refused.clear()
        refused.update(totals)
        self.guard.counters = GuardCounters(**{k: v for k, v in closed.items() if k in closed_fields})
        self.guard.unproven_open = sum(t.unproven for t in self._tallies.values())

