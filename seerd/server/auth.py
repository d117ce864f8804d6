"""Who may call the coordinator: signed requests (seerd/signing.py), and Prometheus's read-only token.

`SignedCalls` is the API's outermost middleware. Before routing and before a byte of the body is
read, a request must carry a valid signature (`Authorization: Seerd-HMAC-SHA256 ...`) of a
timestamp within `MAX_SKEW_S` and a nonce not seen before; the one exception is `GET /metrics` with
the metrics token as a bearer token (Prometheus sends nothing else). Everything else gets 401 and
the connection is closed. The body is checked against its signed digest as the handler reads it
(`BodyDigestMismatch`, 401). Every answer to a signed request is signed in turn, bound to its nonce.

A connection that made one good call is "proven" to the connection guard (guard.py), which then
never evicts it to make room for new ones.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections import deque
from collections.abc import Callable

import msgspec
from starlette.requests import ClientDisconnect

from seerd.protocol import ErrorReply
from seerd.server.guard import CONNECTION_SCOPE_KEY
from seerd.server.latency import WAITED_SCOPE_KEY
from seerd.signing import (
    MAX_SKEW_S, REPLY_HEADER, STALE_TIMESTAMP, Mac, call_key, parse_authorization, reply_mac, request_mac,
)

METRICS_PATH = "/metrics"
# In an API front process (front.py), the nonce of a signed call and when it may be forgotten: the
# coordinator's process checks it, one set of nonces for every front (a replay may reach another).
NONCE_SCOPE_KEY = "seerd.nonce"
_REPLY_HEADER = REPLY_HEADER.encode()


REPLAYED = "this call was made before (a replay)"


class BodyDigestMismatch(Exception):
    """The body read is not the one the request's signature covers."""


class SeenNonces:
    """Nonces of accepted calls, each kept until its timestamp leaves the window (then a replay of it
    fails the timestamp check instead). Only signed calls add to it, so its size is bounded by the
    workers' own call rate: ~100 bytes a call for 2 x `MAX_SKEW_S`."""

    def __init__(self) -> None:
        self._expiry: dict[str, float] = {}
        self._order: deque[tuple[float, str]] = deque()

    def add(self, nonce: str, expires: float, now: float) -> bool:
        """False if `nonce` was seen (a replay); else remember it until `expires`."""
        order = self._order
        while order and order[0][0] < now:  # roughly in time order: an entry kept late is harmless
            self._expiry.pop(order.popleft()[1], None)
        if nonce in self._expiry:
            return False
        self._expiry[nonce] = expires
        order.append((expires, nonce))
        return True

    def __len__(self) -> int:
        return len(self._expiry)


class SignedCalls:
    """401 for any request that is not signed with the call key (or a metrics scrape with the metrics
    token); signs every answer to a signed one; counts calls and their wall time for the daemon."""

    def __init__(self, app, secret: str, control, *, address: str = "",  # noqa: ANN001
                 metrics_token: str | None = None, wall_clock: Callable[[], float] = time.time,
                 check_nonces: bool = True) -> None:
        self.app = app
        self.mac = Mac(call_key(secret, address))
        self.metrics_bearer = f"Bearer {metrics_token}".encode() if metrics_token else None
        self.control = control
        self.wall_clock = wall_clock
        # False in a front process: the nonce goes on in the scope (`NONCE_SCOPE_KEY`) to the
        # coordinator's process, which checks it and tells the front whether to prove the connection.
        self.nonces = SeenNonces() if check_nonces else None

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        if self.metrics_bearer is not None and scope["path"] == METRICS_PATH and scope["method"] == "GET" \
                and hmac.compare_digest(header, self.metrics_bearer):
            return await self._serve(scope, receive, send)
        signed = parse_authorization(header.decode("latin-1"))
        if signed is None:
            return await self._refuse(send, "unsigned", "a signed request is required")
        target = scope["raw_path"].decode("latin-1")
        if scope["query_string"]:
            target += "?" + scope["query_string"].decode("latin-1")
        expected = request_mac(self.mac, scope["method"], target, signed.timestamp, signed.nonce,
                               signed.body_sha256)
        if not hmac.compare_digest(signed.mac, expected):
            return await self._refuse(send, "bad_signature", "the signature does not match")
        now = self.wall_clock()
        try:
            skew = float(signed.timestamp) - now
        except ValueError:
            skew = float("inf")
        if not abs(skew) <= MAX_SKEW_S:  # also NaN
            # Correctly signed: answer signed, with our time, so the client corrects its clock.
            reply = ErrorReply(f"the call's time is {skew:+.1f} s from the coordinator's (at most "
                               f"{MAX_SKEW_S:.0f}); sign again with the reply's time", STALE_TIMESTAMP)
            self._count("stale_timestamp")
            return await _answer(reply, 401, self._signing(send, signed.nonce), close=True)
        if self.nonces is None:
            scope[NONCE_SCOPE_KEY] = (signed.nonce, now + skew + MAX_SKEW_S)
        elif not self.nonces.add(signed.nonce, now + skew + MAX_SKEW_S, now):
            return await self._refuse(send, "replayed", REPLAYED)
        elif (connection := scope.get(CONNECTION_SCOPE_KEY)) is not None:
            connection.prove()
        return await self._serve(scope, self._checked_body(receive, signed.body_sha256),
                                 self._signing(send, signed.nonce))

    async def _serve(self, scope, receive, send) -> None:  # noqa: ANN001
        started = time.perf_counter()
        try:
            await self.app(scope, receive, send)
        except ClientDisconnect:  # it went away mid-body (or the guard closed it): nobody to answer
            pass
        finally:
            took = time.perf_counter() - started
            self.control.busy_s += took
            self.control.calls += 1
            took -= scope.get(WAITED_SCOPE_KEY, 0.0)
            self.control.latencies.add(scope["path"], took)

    def _count(self, reason: str) -> None:
        self.control.refused[reason] = self.control.refused.get(reason, 0) + 1

    async def _refuse(self, send, reason: str, detail: str) -> None:  # noqa: ANN001
        self._count(reason)
        await _answer(ErrorReply(detail), 401, send, close=True)

    def _checked_body(self, receive, body_sha256: str):  # noqa: ANN001, ANN202
        digest = hashlib.sha256()

        async def checked() -> dict:
            message = await receive()
            if message["type"] == "http.request":
                digest.update(message.get("body", b""))
                if not message.get("more_body", False) and digest.hexdigest() != body_sha256:
                    self._count("body_mismatch")
                    raise BodyDigestMismatch()
            return message

        return checked

    def _signing(self, send, nonce: str):  # noqa: ANN001, ANN202
        """`send` with the answer signed: the start message is held until the body is known."""
        held: list[dict] = []
        parts: list[bytes] = []

        async def signed(message: dict) -> None:
            kind = message["type"]
            if kind == "http.response.start":
                held.append(message)
                return None
            if kind != "http.response.body" or not held:
                return await send(message)
            if message.get("more_body", False):
                parts.append(message.get("body", b""))
                return None
            if parts:  # a streamed answer, sent whole
                message = {"type": kind, "body": b"".join([*parts, message.get("body", b"")])}
            start = held.pop()
            timestamp = f"{self.wall_clock():.3f}"
            mac = reply_mac(self.mac, nonce, start["status"], timestamp,
                            hashlib.sha256(message.get("body", b"")).hexdigest())
            start["headers"] = [*start.get("headers", ()), (_REPLY_HEADER, f"{timestamp} {mac}".encode())]
            await send(start)
            return await send(message)

        return signed


async def _answer(reply: ErrorReply, status: int, send, *, close: bool) -> None:  # noqa: ANN001
    content = msgspec.json.encode(reply)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode())]
    if close:  # an unauthenticated client keeps no connection (nor a body half sent) on the coordinator
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": content})


async def body_mismatch(_request, _exc: BodyDigestMismatch):  # noqa: ANN001, ANN201
    """The API's handler for `BodyDigestMismatch` (raised while a handler reads its body)."""
    from starlette.responses import Response

    return Response(msgspec.json.encode(ErrorReply("the body is not the one the signature covers")), 401,
                    media_type="application/json", headers={"connection": "close"})
