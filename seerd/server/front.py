"""An API front: a process that serves the coordinator's HTTP for it, on the coordinator's own socket.

With a thousand workers, two thirds of the coordinator's interpreter went to HTTP (uvicorn's
parsing and sending, Starlette's layers, the signatures: py-spy, tools/bench/load.py), and the state
thread that owns the book waited for the GIL behind it. Fronts take that work to other
processes: each accepts connections from the listening socket the coordinator opened (inherited),
runs the connection guard (guard.py) and the signature check (auth.py), reads and checks each
body, and forwards the call, already parsed, to the coordinator over a Unix socket (`Link`);
the coordinator runs the handler (forwarding.py) and sends the answer back, which the front
signs and sends. What stays in one place: the book and every decision about it, and the set
of nonces seen (a replay may reach another front).

A front holds no state worth keeping: it exits when the coordinator's end of its link closes
(and on its parent's death), and the coordinator starts another if one dies. Run as
`python -m seerd.server.front LISTEN_FD LINK_FD`; the secret arrives over the link, never on
the command line (`ps` shows that to every user).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import asdict

import msgspec
from starlette.requests import ClientDisconnect

from seerd.protocol import ErrorReply
from seerd.server.auth import NONCE_SCOPE_KEY, BodyDigestMismatch, SignedCalls
from seerd.server.guard import CONNECTION_SCOPE_KEY, BodyLimitMiddleware, ConnectionGuard, ConnectionLimits, api_server

log = logging.getLogger("seerd.front")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
TALLY_EVERY_S = 1.0  # how often a front tells the coordinator its refusal and guard counters
_FRAME_HEADER = 4  # bytes of a frame's length, big-endian, before its msgpack


# What the coordinator sends a front.
class FrontSetup(msgspec.Struct, tag="setup", array_like=True):
    index: int
    secret: str
    address: str  # "host:port" the workers sign for
    metrics_token: str | None
    max_body_bytes: int
    limits: dict[str, float]  # `ConnectionLimits`' fields


class Answer(msgspec.Struct, tag="answer", array_like=True):
    call_id: int
    status: int
    body: bytes
    media_type: str
    close: bool  # send `connection: close`
    fresh: bool  # the nonce was new: the front may prove the connection (guard.py)


class Stop(msgspec.Struct, tag="stop", array_like=True):
    """Stop accepting; finish the calls in flight, then exit (the coordinator is stopping)."""


# What a front sends the coordinator.
class ForwardedCall(msgspec.Struct, tag="call", array_like=True):
    call_id: int
    method: str
    path: str
    query: bytes
    body: bytes
    nonce: str  # "" for a metrics scrape with the metrics token (no nonce)
    nonce_expires: float


class FrontReady(msgspec.Struct, tag="ready", array_like=True):
    index: int


class FrontTally(msgspec.Struct, tag="tally", array_like=True):
    index: int
    refused: dict[str, int]  # by auth.py's reasons
    closed: dict[str, int]  # `GuardCounters`
    unproven: int


TO_FRONT = FrontSetup | Answer | Stop
FROM_FRONT = ForwardedCall | FrontReady | FrontTally


class Link(asyncio.Protocol):
    """One end of a front's Unix socket: length-prefixed msgpack frames. Frames sent in one turn of
    the loop leave in one write (`send`)."""

    def __init__(self, incoming: object, on_frame: Callable[[object], None], on_lost: Callable[[], None]) -> None:
        self._decoder = msgspec.msgpack.Decoder(incoming)
        self._encoder = msgspec.msgpack.Encoder()
        self._on_frame, self._on_lost = on_frame, on_lost
        self._buffer = bytearray()
        self._outgoing: list[bytes] = []
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:  # noqa: ANN001
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._on_lost()

    @property
    def open(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        at = 0
        while len(buffer) - at >= _FRAME_HEADER:
            size = int.from_bytes(buffer[at:at + _FRAME_HEADER], "big")
            end = at + _FRAME_HEADER + size
            if end > len(buffer):
                break
            frame = self._decoder.decode(memoryview(buffer)[at + _FRAME_HEADER:end])
            at = end
            self._on_frame(frame)
        del buffer[:at]

    def send(self, frame: msgspec.Struct) -> None:
        if not self.open:
            return
        payload = self._encoder.encode(frame)
        if not self._outgoing:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outgoing.append(len(payload).to_bytes(_FRAME_HEADER, "big"))
        self._outgoing.append(payload)

    def _flush(self) -> None:
        outgoing, self._outgoing = self._outgoing, []
        if self.open:
            self.transport.write(b"".join(outgoing))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class _NoLatencies:
    """The front does not time calls: the coordinator times its handlers (forwarding.py)."""

    def add(self, endpoint: str, seconds: float) -> None:
        """Nothing to keep."""


class FrontCounts:
    """What `SignedCalls` counts into (the daemon's `CoordinatorControl` in-process)."""

    def __init__(self) -> None:
        self.busy_s = 0.0
        self.calls = 0
        self.latencies = _NoLatencies()
        self.refused: dict[str, int] = {}


class Front:
    """The front process: its link to the coordinator, its server, the calls it forwarded."""

    def __init__(self) -> None:
        self.link: Link | None = None
        self.setup: asyncio.Future[FrontSetup] = asyncio.get_running_loop().create_future()
        self.stopping = asyncio.Event()
        self.waiting: dict[int, asyncio.Future[Answer | None]] = {}
        self._ids = itertools.count()
        self.counts = FrontCounts()

    def on_frame(self, frame: object) -> None:
        if isinstance(frame, Answer):
            waiting = self.waiting.pop(frame.call_id, None)
            if waiting is not None and not waiting.done():
                waiting.set_result(frame)
        elif isinstance(frame, FrontSetup):
            if not self.setup.done():
                self.setup.set_result(frame)
        elif isinstance(frame, Stop):
            self.stopping.set()

    def on_lost(self) -> None:
        """The coordinator is gone: nobody will answer the calls waiting, and nobody sends work."""
        for waiting in self.waiting.values():
            if not waiting.done():
                waiting.set_result(None)
        self.waiting.clear()
        if not self.setup.done():
            self.setup.cancel()
        self.stopping.set()

    async def forward(self, call: ForwardedCall) -> Answer | None:
        """The coordinator's answer, or None if the link went down first."""
        if self.link is None or not self.link.open:
            return None
        answer = asyncio.get_running_loop().create_future()
        self.waiting[call.call_id] = answer
        self.link.send(call)
        return await answer

    def next_id(self) -> int:
        return next(self._ids)


class Forwarder:
    """The front's ASGI app, below the body limit and the signature check: the body read (and its
    digest checked, auth.py), the call forwarded, the answer sent."""

    def __init__(self, front: Front) -> None:
        self.front = front

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        if scope["type"] != "http":
            return
        try:
            body = await _read_body(receive)
        except BodyDigestMismatch:
            return await _send(send, 401, msgspec.json.encode(ErrorReply("the body is not the one the signature covers")),
                               "application/json", close=True)
        nonce, expires = scope.get(NONCE_SCOPE_KEY, ("", 0.0))
        answer = await self.front.forward(ForwardedCall(
            self.front.next_id(), scope["method"], scope["path"], scope["query_string"], body, nonce, expires))
        if answer is None:
            return await _send(send, 503, msgspec.json.encode(ErrorReply("the coordinator is stopping")),
                               "application/json", close=True)
        if answer.fresh and (connection := scope.get(CONNECTION_SCOPE_KEY)) is not None:
            connection.prove()
        await _send(send, answer.status, answer.body, answer.media_type, close=answer.close)


async def _read_body(receive) -> bytes:  # noqa: ANN001
    parts = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts)


async def _send(send, status: int, body: bytes, media_type: str, *, close: bool) -> None:  # noqa: ANN001
    headers = [(b"content-type", media_type.encode()), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def serve_front(listen_fd: int, link_fd: int) -> None:
    loop = asyncio.get_running_loop()
    front = Front()
    _, front.link = await loop.create_unix_connection(
        lambda: Link(TO_FRONT, front.on_frame, front.on_lost), sock=socket.socket(fileno=link_fd))
    try:
        setup = await front.setup
    except asyncio.CancelledError:
        return  # the coordinator went away before it said how to serve
    guard = ConnectionGuard(ConnectionLimits(**setup.limits))
    app = SignedCalls(BodyLimitMiddleware(Forwarder(front), setup.max_body_bytes), setup.secret, front.counts,
                      address=setup.address, metrics_token=setup.metrics_token, check_nonces=False)
    server = api_server(app, guard)
    server.capture_signals = contextlib.nullcontext  # uvicorn's own makes SIGINT and SIGTERM stop it
    serving = asyncio.create_task(server.serve(sockets=[socket.socket(fileno=listen_fd)]))
    while not server.started and not serving.done():
        await asyncio.sleep(0.01)
    front.link.send(FrontReady(setup.index))
    def tally() -> FrontTally:
        return FrontTally(setup.index, dict(front.counts.refused), asdict(guard.counters), guard.unproven_open)

    while not front.stopping.is_set() and not serving.done():
        front.link.send(tally())
        with contextlib.suppress(TimeoutError):  # the next tally is due
            await asyncio.wait_for(front.stopping.wait(), TALLY_EVERY_S)
    server.should_exit = True  # calls in flight finish (their answers still come over the link)
    await serving
    front.link.send(tally())
    await asyncio.sleep(0)  # the last tally's write
    front.link.close()


def main(argv: list[str]) -> None:
    from seerd.event_loop import run_event_loop
    from seerd.parent_death import die_with_parent

    # The coordinator decides when its API stops: a terminal's Ctrl-C, Slurm's SIGTERM and its
    # warning signals (USR1/USR2) reach every process of the job, and a front that died of one
    # would leave the workers unable to report during the drain the coordinator starts on it.
    # Its Stop, its link's end or its death (SIGKILL, which cannot be ignored) end a front.
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    die_with_parent(signal.SIGKILL)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run_event_loop(serve_front(int(argv[1]), int(argv[2])))


if __name__ == "__main__":
    main(sys.argv)
