"""The coordinator's connections: limits that keep strangers from starving the workers.

uvicorn (with httptools) bounds none of these by itself: a connection may stay open without ever
sending a request, a request head may be any size (httptools took a 50 MB header), and a body
may trickle forever. `GuardedProtocol` is uvicorn's httptools protocol with:

- a head timeout: a connection's request head (line and headers) must arrive within
  `head_timeout_s` of its first byte, or of the connection's opening for the first request;
- a head size limit: 431 past `max_head_bytes` (the workers' heads are ~400 bytes);
- a body timeout: a body must arrive within `body_timeout_s` of its head (and a size limit by
  its Content-Length, `BodyLimitMiddleware`, in front of the app);
- a cap on unproven connections: a connection is proven once a call on it passed the signature
  check (auth.py); past `max_unproven` unproven connections, a new one closes the oldest unproven
  one. Proven connections are never evicted, so a crowd of idle strangers costs the workers nothing
  (uvicorn's `limit_concurrency` would answer the workers 503 instead).

The file-descriptor limit is raised at start to what the worker count needs (`raise_open_files_limit`).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
from dataclasses import dataclass, field
from functools import partial

import msgspec
import uvicorn
from starlette.responses import Response
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from seerd.protocol import LONG_POLL_MAX_S, ErrorReply
from seerd.settings import EngineConfig

log = logging.getLogger("seerd.coordinator")

CONNECTION_SCOPE_KEY = "seerd.connection"  # the request's connection, for auth.py to prove
HEAD_END = b"\r\n\r\n"
# Open files besides the API's connections: the database and its WAL, logs, pipes to the workers
# and the KV pool's processes, Python's own.
RESERVED_FILES = 256
# Connections one worker may hold: its client's concurrent calls (lease long-poll, report,
# heartbeat, release) and its engine's draft sync, with room to spare.
FILES_PER_WORKER = 8
MAX_UNPROVEN = 1024


@dataclass
class ConnectionLimits:
    head_timeout_s: float = 10.0
    body_timeout_s: float = 60.0  # a worker's largest report is ~20 MB: seconds on any network
    max_head_bytes: int = 16 << 10
    max_unproven: int = MAX_UNPROVEN


@dataclass
class GuardCounters:
    evicted: int = 0  # unproven connections closed to make room for a new one
    head_timeouts: int = 0
    body_timeouts: int = 0
    heads_too_large: int = 0


@dataclass
class ConnectionGuard:
    """State shared by one server's connections."""

    limits: ConnectionLimits = field(default_factory=ConnectionLimits)
    counters: GuardCounters = field(default_factory=GuardCounters)
    unproven: dict[GuardedProtocol, None] = field(default_factory=dict)  # oldest first

    def admit(self, connection: GuardedProtocol) -> None:
        while len(self.unproven) >= self.limits.max_unproven:
            oldest = next(iter(self.unproven))
            del self.unproven[oldest]
            self.counters.evicted += 1
            oldest.transport.close()
        self.unproven[connection] = None

    @property
    def unproven_open(self) -> int:
        return len(self.unproven)

    def protocol(self):  # noqa: ANN201 - what uvicorn.Config(http=...) takes: a protocol factory
        return partial(GuardedProtocol, guard=self)


class GuardedProtocol(HttpToolsProtocol):
    def __init__(self, *args, guard: ConnectionGuard, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.guard = guard
        self.proven = False
        self._awaiting_head = True
        self._head_bytes = 0
        self._head_tail = b""  # the last bytes of the head so far: its end may be split across reads
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None

    def prove(self) -> None:
        if not self.proven:
            self.proven = True
            self.guard.unproven.pop(self, None)

    def connection_made(self, transport) -> None:  # noqa: ANN001
        super().connection_made(transport)
        self.guard.admit(self)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.unproven.pop(self, None)
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._awaiting_head:
            end = self._head_end(data)
            self._head_bytes += len(data) if end < 0 else end
            self._head_tail = (self._head_tail + data[-3:])[-3:]
            if self._head_bytes > self.guard.limits.max_head_bytes:
                self.guard.counters.heads_too_large += 1
                self._refuse(b"431 Request Header Fields Too Large",
                             f"a request head over {self.guard.limits.max_head_bytes} bytes")
                return
        super().data_received(data)

    def _head_end(self, data: bytes) -> int:
        """Where in `data` the request head ends (just past its blank line), or -1."""
        if self._head_tail:
            joined = self._head_tail + data[:3]
            at = joined.find(HEAD_END)
            if at >= 0:
                return at + 4 - len(self._head_tail)
        at = data.find(HEAD_END)
        return at + 4 if at >= 0 else -1

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope[CONNECTION_SCOPE_KEY] = self  # type: ignore[literal-required]
        self._arm_head_timer()

    def on_headers_complete(self) -> None:
        self._awaiting_head, self._head_bytes, self._head_tail = False, 0, b""
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().on_headers_complete()
        if self.cycle is not None and self.cycle.more_body and not self.transport.is_closing():
            self._body_timer = self.loop.call_later(self.guard.limits.body_timeout_s, self._body_timed_out)

    def on_message_complete(self) -> None:
        self._awaiting_head = True
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.guard.limits.head_timeout_s, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._awaiting_head and not self.transport.is_closing():
            self.guard.counters.head_timeouts += 1
            self.transport.close()

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if not self.transport.is_closing():
            self.guard.counters.body_timeouts += 1
            self.transport.close()

    def _refuse(self, status: bytes, message: str) -> None:
        body = message.encode()
        head = (b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: "
                + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n")
        self.transport.write(head + body)
        self.transport.close()


# How long a stopping server waits for the calls in flight (the longest legitimate one is a long
# poll) before it cancels them: one call that never ends must not keep a finished run from ending.
SHUTDOWN_GRACE_S = 2 * LONG_POLL_MAX_S


def api_server(app, guard: ConnectionGuard) -> uvicorn.Server:  # noqa: ANN001
    """The coordinator's uvicorn server: httptools behind the guard, no logs of each call, our own
    signal handlers (the daemon installs them in one place), no proxy-header rewriting (workers
    call it directly; the middleware cost every call CPU for nothing), calls still in flight
    `SHUTDOWN_GRACE_S` after it was told to stop cancelled."""
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", loop="none",
                            http=guard.protocol(), proxy_headers=False, timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    return server


def open_files_needed(workers: int) -> int:
    """The reserve, the workers' connections, and twice the cap on unproven ones (`limits_for`)."""
    return RESERVED_FILES + FILES_PER_WORKER * workers + 2 * MAX_UNPROVEN


def raise_open_files_limit(workers: int) -> int:
    """Raise this process's soft limit of open files to what `workers` workers need (at most to the
    hard limit); returns the limit now in force, with a warning when it falls short."""
    needed = open_files_needed(workers)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    if soft != resource.RLIM_INFINITY and soft < needed:
        log.warning("the open-files limit is %d (its hard limit); the coordinator of %d workers wants %d: "
                    "fewer idle strangers fit before it evicts them; raise the hard limit (ulimit -Hn) "
                    "where it runs", soft, workers, needed)
    return soft


def limits_for(workers: int, open_files: int) -> ConnectionLimits:
    """Connection limits that fit `open_files`: unproven connections get half of what the reserve
    and the workers leave (the other half is headroom: status views, scrapes, workers' extra
    connections), at most `MAX_UNPROVEN`, at least 64 when the limit could not be raised enough."""
    if open_files == resource.RLIM_INFINITY:
        return ConnectionLimits()
    room = open_files - RESERVED_FILES - FILES_PER_WORKER * workers
    return ConnectionLimits(max_unproven=max(64, min(MAX_UNPROVEN, room // 2)))


class BodyLimitMiddleware:
    """413 for a body over `limit` bytes, by its Content-Length, before a byte of it is read; a body
    without one (chunked) gets 411: the workers' client always says the length. Either closes the
    connection: the body it announced is never read."""

    def __init__(self, app, limit: int) -> None:  # noqa: ANN001
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            await _refusal("a body needs a Content-Length", 411)(scope, receive, send)
            return None
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.limit:
            await _refusal(f"a body of {length.decode(errors='replace')} bytes; the limit is {self.limit}",
                           413)(scope, receive, send)
            return None
        return await self.app(scope, receive, send)


def _refusal(detail: str, status: int) -> Response:
    return Response(msgspec.json.encode(ErrorReply(detail)), status, media_type="application/json",
                    headers={"connection": "close"})


# The JSON of one reported token at most: an int32 id (11 characters with its sign) and a float64
# logprob as msgspec writes it (up to 24, "-1.2345678901234567e-308"), each with its comma.
REPORT_BYTES_PER_TOKEN = 37


def body_limit(engine: EngineConfig, chunk_tokens: int) -> int:
    """The API's body size limit: twice the largest legitimate call, a report of a worker's every
    chunk at once (one per engine sequence, `chunk_tokens` tokens each), plus 1 MiB for the rest.
    A draft append of the same chunks' tokens is smaller; every other body is tiny."""
    max_chunks = int(engine.extra_args.get("max_num_seqs", engine.max_num_seqs))
    return 2 * max_chunks * chunk_tokens * REPORT_BYTES_PER_TOKEN + (1 << 20)


def listening_socket(host: str, port: int) -> socket.socket:
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets that name it, and without
    # it every response waited ~40 ms for the client's delayed ACK (Nagle).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock
