"""Signed calls to the coordinator: no bearer secret on the wire, in either direction.

A client never sends the run's secret. It signs each call with a key derived from the secret and
the coordinator's address (`call_key`): HMAC-SHA256 over the method, the path, a timestamp, a
random nonce and the body's SHA-256, all in the `Authorization` header:

    Authorization: Seerd-HMAC-SHA256 <unix time> <nonce> <body sha256> <mac>

The coordinator checks the MAC before it reads the body (an unauthenticated body is never read),
refuses a timestamp more than `MAX_SKEW_S` from its clock and a nonce it has seen, then checks
the body against its digest as it is read. Its answer carries a signature of its own, bound to the
request's nonce (`x-seerd-signature: <unix time> <mac>`), which clients check before they believe a
reply: a process that took over a dead coordinator's port cannot answer for it.

So what a listener on a stale address receives is one signed call: no secret, and a signature
worth nothing anywhere else. The key binds the address the client meant (`host:port` from
`coordinator.json`), and every coordinator start writes a fresh secret, so the call cannot be
replayed to the run's live coordinator at its own address, nor to a later one.

Each coordinator start also writes a read-only credential for Prometheus (`metrics-token`), which can
only send a static bearer token: it opens `GET /metrics` and nothing else.

Cost (docs/security.md): ~35-50 us of the coordinator's event loop a call (the header's check, the
body's digest, the answer's signature, and Python's layers around them; the HMACs themselves are
~1 us each, `Mac`), ~30-45 us of a client's; SHA-256 of large bodies adds ~0.6 ms per MB.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections.abc import Callable
from typing import NamedTuple

SCHEME = "Seerd-HMAC-SHA256"
REPLY_HEADER = "x-seerd-signature"
# How far a call's timestamp may be from the coordinator's clock. Clients correct their clock by the
# time in each signed reply, so only the network's delay and the first call's skew must fit.
MAX_SKEW_S = 30.0
# The error code of a 401 for a correctly signed call whose timestamp was too far off; its reply is
# signed and carries the coordinator's time, so the client corrects its clock and signs again.
STALE_TIMESTAMP = "stale_timestamp"
EMPTY_BODY_SHA256 = hashlib.sha256(b"").hexdigest()
NONCE_BYTES = 16


def _derive(secret: str, purpose: str) -> bytes:
    return hmac.digest(secret.encode(), f"seerd {purpose}".encode(), "sha256")


def call_key(secret: str, address: str) -> bytes:
    """The key that signs calls to the coordinator at `address` ("host:port"), and its answers."""
    return _derive(secret, f"call key v1 {address}")


def block_key(secret: str) -> bytes:
    """The key that authenticates the KV pool's blocks (seerd/kvpool/connector.py)."""
    return _derive(secret, "kv-pool block key v1")


class Mac:
    """HMAC-SHA256 under one key, its padded key blocks hashed once: a short message then costs two
    hash copies, ~1 us against hmac.digest's ~2.3 us (which sets up an OpenSSL context per call)."""

    def __init__(self, key: bytes) -> None:
        if len(key) > 64:  # RFC 2104: a key longer than the block is hashed first
            key = hashlib.sha256(key).digest()
        block = key.ljust(64, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in block))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in block))

    def hex(self, message: bytes) -> str:
        inner = self._inner.copy()
        inner.update(message)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.hexdigest()


def request_mac(mac: Mac, method: str, target: str, timestamp: str, nonce: str, body_sha256: str) -> str:
    return mac.hex(f"{SCHEME}\n{method}\n{target}\n{timestamp}\n{nonce}\n{body_sha256}".encode())


def reply_mac(mac: Mac, nonce: str, status: int, timestamp: str, body_sha256: str) -> str:
    return mac.hex(f"{SCHEME} reply\n{nonce}\n{status}\n{timestamp}\n{body_sha256}".encode())


def body_digest(body: bytes | None) -> str:
    return hashlib.sha256(body).hexdigest() if body else EMPTY_BODY_SHA256


class SignedRequest(NamedTuple):
    """What the coordinator reads from an `Authorization` header (`parse_authorization`)."""

    timestamp: str
    nonce: str
    body_sha256: str
    mac: str


def parse_authorization(value: str) -> SignedRequest | None:
    """The header's parts, or None when it is not a seerd signature."""
    parts = value.split(" ")
    if len(parts) != 5 or parts[0] != SCHEME:
        return None
    signed = SignedRequest(*parts[1:])
    if not (8 <= len(signed.nonce) <= 64 and len(signed.body_sha256) == 64 and len(signed.mac) == 64):
        return None
    return signed


class Signer:
    """Signs one client's calls and checks the coordinator's replies to them.

    `offset_s` follows the coordinator's clock, learnt from each signed reply, so a node whose clock
    is off by minutes still signs calls the coordinator accepts."""

    def __init__(self, key: bytes, clock: Callable[[], float] = time.time) -> None:
        self.mac = Mac(key)
        self.clock = clock
        self.offset_s = 0.0

    def sign(self, method: str, target: str, body: bytes | None) -> tuple[str, str]:
        """The `Authorization` value for one call, and its nonce (to check the reply with)."""
        timestamp = f"{self.clock() + self.offset_s:.3f}"
        nonce = os.urandom(NONCE_BYTES).hex()
        body_sha256 = body_digest(body)
        mac = request_mac(self.mac, method, target, timestamp, nonce, body_sha256)
        return f"{SCHEME} {timestamp} {nonce} {body_sha256} {mac}", nonce

    def verify_reply(self, nonce: str, status: int, signature: str | None, body: bytes) -> bool:
        """Whether the reply to the call signed with `nonce` is the coordinator's (and then learn
        its clock)."""
        if not signature:
            return False
        timestamp, _, mac = signature.partition(" ")
        expected = reply_mac(self.mac, nonce, status, timestamp, body_digest(body))
        if not hmac.compare_digest(mac, expected):
            return False
        try:
            self.offset_s = float(timestamp) - self.clock()
        except ValueError:
            return False
        return True


def httpx_auth(signer: Signer, *bases: type):  # noqa: ANN201 - an httpx.Auth; only its users import httpx
    """An `httpx.Auth` that signs each request, checks the reply's signature and puts the outcome in
    `response.extensions["seerd_verified"]`; a stale timestamp is corrected and signed again once.
    `bases`: other Auth classes to be (Starlette's TestClient runs on the httpx2 fork when it is there)."""
    import httpx

    class SignedAuth(httpx.Auth, *bases):  # type: ignore[misc]
        requires_request_body = True
        requires_response_body = True

        def auth_flow(self, request: httpx.Request):  # noqa: ANN202
            for _ in range(2):  # a second time only when the signed answer corrected our clock
                header, nonce = signer.sign(request.method, request.url.raw_path.decode(), request.content)
                request.headers["Authorization"] = header
                response = yield request
                status, content = response.status_code, response.content
                verified = signer.verify_reply(nonce, status, response.headers.get(REPLY_HEADER), content)
                response.extensions["seerd_verified"] = verified
                if not (verified and status == 401 and STALE_TIMESTAMP.encode() in content):
                    return

    return SignedAuth()
