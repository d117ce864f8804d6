"""The worker's HTTP client for the coordinator: every call signed and every answer's signature
checked (`seerd.signing`: the secret never leaves the node), retries on network errors and 5xx
answers, replies decoded into their `seerd.protocol` types.

On aiohttp, not httpx: a worker's event loop shares two cores with the engines here (and its
engine's core on any node), and per call aiohttp costs about a third of httpx's CPU
(`tools/bench/http_client.py`: a report-sized POST, ~0.3 ms against ~1 ms on this machine).

What ends a worker is the coordinator gone (no answer at all) for longer than its patience
(`CoordinatorGone`); an answer, whatever its status, never does: a 5xx is retried, a 4xx is the
caller's to handle (`NotRegistered`, `CoordinatorRefused`). An answer without the coordinator's
signature is no answer: whatever listens at the address is not the run's coordinator (or not the
one whose secret this client holds). While there is no answer, a client made `from_run_dir` reads
the run directory again: a restarted coordinator has a new address and a new secret, and the
worker follows it (then registers again, on the new coordinator's 404).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp
import msgspec

from seerd.protocol import UNKNOWN_WORKER, WEIGHTS_MISMATCH, WORKER_RETIRED, Endpoint, ErrorReply, ReplyT, decode_reply
from seerd.rundir import RunDir, RunDirError
from seerd.signing import REPLY_HEADER, STALE_TIMESTAMP, Signer, call_key

log = logging.getLogger("seerd.worker")


class CoordinatorGone(RuntimeError):
    """The coordinator did not answer for longer than the worker's patience."""


class NotRegistered(RuntimeError):
    """The coordinator does not know this worker (it restarted): register again."""


class Retired(RuntimeError):
    """The coordinator took this worker out (its engine stuck, or failing what others run): exit."""


class WeightsMismatch(RuntimeError):
    """The rollout samples from other weights than the engine holds (`seerd serve` moved on to
    another batch): read the config again, load its weights, register again."""


class CoordinatorRefused(RuntimeError):
    """A 4xx answer other than `NotRegistered`: the call as sent will not succeed (a malformed or
    too large body, a wrong secret). The caller logs it and carries on without it."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"{status}: {detail}")
        self.status = status


class Backoff:
    """Bounded exponential waits: `first_s`, doubling up to `cap_s`, until `reset`."""

    def __init__(self, first_s: float = 0.1, cap_s: float = 2.0) -> None:
        self.first_s, self.cap_s = first_s, cap_s
        self._next_s = first_s

    def next(self) -> float:
        wait, self._next_s = self._next_s, min(self._next_s * 2, self.cap_s)
        return wait

    def reset(self) -> None:
        self._next_s = self.first_s


async def wait_for_address(run_dir: RunDir, timeout_s: float) -> tuple[str, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return run_dir.read_address()
        except RunDirError as exc:
            if time.monotonic() > deadline:
                raise CoordinatorGone(
                    f"no coordinator address appeared in {run_dir.address_path} within {timeout_s:.0f}s: "
                    f"is the coordinator running? ({exc})") from exc
        await asyncio.sleep(0.2)


CALL_TIMEOUT_S = 30.0  # longer than any long-poll lease waits (`LeaseBody.wait_s`)
CONNECT_TIMEOUT_S = 5.0
TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)  # no answer: retried within patience


class CallTimings:
    """Each answered call, by endpoint path, as a worker sees it: when it was sent (wall clock,
    to line calls up with the coordinator's events), the seconds it took (what `tools/bench/load.py`
    reports as the coordinator's latency; a lease's long-poll wait for work, `LeaseReply.waited_s`,
    taken out), and whether it was its worker's first call of that endpoint (a worker's first lease is its share of
    the start-up fill). Kept only where asked for (simulated workers)."""

    def __init__(self) -> None:
        self.calls: dict[str, list[tuple[float, float, bool]]] = {}  # path -> [(sent at, seconds, first)]

    def record(self, path: str, sent_at: float, seconds: float, first: bool = False) -> None:
        self.calls.setdefault(path, []).append((sent_at, seconds, first))


class CoordinatorClient:
    def __init__(self, base_url: str, secret: str, *, patience_s: float = 60.0,
                 timings: CallTimings | None = None, run_dir: RunDir | None = None) -> None:
        self.patience_s = patience_s
        self.timings = timings
        self._timed: set[str] = set()  # endpoints this client's calls were timed on (`CallTimings`)
        self.run_dir = run_dir  # read again while the coordinator does not answer (`refresh`)
        self._http: aiohttp.ClientSession | None = None  # made in the event loop that uses it
        self._use(base_url, secret)

    def _use(self, base_url: str, secret: str) -> None:
        self.base_url = base_url
        self._secret = secret
        self._signer = Signer(call_key(secret, base_url.partition("://")[2].rstrip("/")))

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession(
                base_url=self.base_url, headers={"Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT_S, connect=CONNECT_TIMEOUT_S))
        return self._http

    @classmethod
    async def from_run_dir(cls, run_dir: RunDir, *, address_timeout_s: float = 120.0,
                           patience_s: float = 60.0, timings: CallTimings | None = None) -> CoordinatorClient:
        host, port = await wait_for_address(run_dir, address_timeout_s)
        return cls(f"http://{host}:{port}", run_dir.read_secret(), patience_s=patience_s, timings=timings,
                   run_dir=run_dir)

    async def refresh(self) -> bool:
        """Read the coordinator's address and secret again (a restarted coordinator writes new
        ones); True when they changed and the next call goes to the new coordinator."""
        if self.run_dir is None:
            return False
        try:
            host, port = self.run_dir.read_address()
            secret = self.run_dir.read_secret()
        except RunDirError:
            return False
        base_url = f"http://{host}:{port}"
        if base_url == self.base_url and secret == self._secret:
            return False
        log.warning("the run's coordinator is now at %s (it restarted): following it", base_url)
        self._use(base_url, secret)
        await self.close()
        return True

    async def close(self) -> None:
        # Let go of the session before awaiting its close: a call another task starts meanwhile
        # makes a new one, where it took the closing one and failed "Session is closed" (the
        # lease loop's, while the report loop followed a restarted coordinator).
        old, self._http = self._http, None
        if old is not None:
            await old.close()

    async def _send(self, method: str, path: str, content: bytes | None) -> tuple[int, bytes, bool]:
        """One signed call: its status, its body and whether the answer bears the coordinator's signature."""
        authorization, nonce = self._signer.sign(method, path, content)
        async with self._session().request(method, path, data=content,
                                           headers={"Authorization": authorization}) as response:
            body = await response.read()
            return response.status, body, self._signer.verify_reply(
                nonce, response.status, response.headers.get(REPLY_HEADER), body)

    async def call(self, endpoint: Endpoint[Any, ReplyT], body: msgspec.Struct | None = None) -> ReplyT:
        """One API call; the reply decoded as the endpoint's type (`BadReply` if it is not one).

        Retried, with a bounded exponential backoff, on network errors until the coordinator has
        been unreachable for its patience (`CoordinatorGone`), and on 5xx answers (the coordinator
        is there but failed the call, a commit say) for as long as they come. Sending a call again
        is safe for every endpoint: reports are idempotent per lease epoch
        (`coordinator.reports.judge_unleased`), a lease granted but never heard of expires, a
        heartbeat or release repeats harmlessly, a registration repeated makes a second identity
        whose row goes stale. A 4xx raises `NotRegistered`, `Retired` or `CoordinatorRefused`."""
        backoff = Backoff()
        unreachable_since: float | None = None
        content = None if body is None else msgspec.json.encode(body)
        clock_corrected = False
        while True:
            sent_at = time.monotonic()
            try:
                status, reply, signed = await self._send(endpoint.method, endpoint.path, content)
            except TRANSPORT_ERRORS as exc:
                problem: object = exc
            else:
                if signed and status == 401 and not clock_corrected and STALE_TIMESTAMP.encode() in reply:
                    clock_corrected = True  # the signed reply set our clock to the coordinator's: again
                    continue
                if signed and status >= 500:  # the coordinator is there but failed the call (a commit, say)
                    unreachable_since = None
                    wait = backoff.next()
                    log.warning("%s %s -> %d (%s); again in %.1fs", endpoint.method, endpoint.path,
                                status, reply[:200].decode(errors="replace"), wait)
                    await asyncio.sleep(wait)
                    continue
                if signed:
                    return self._answered(endpoint, status, reply, sent_at)
                problem = f"an answer ({status}) without the run's coordinator's signature"
            # No answer from the run's coordinator: it may have restarted elsewhere, with a new secret.
            if unreachable_since is None:
                unreachable_since = time.monotonic()
                if not isinstance(problem, BaseException):
                    log.warning("%s %s at %s: %s; reading the run directory again", endpoint.method,
                                endpoint.path, self.base_url, problem)
            if time.monotonic() - unreachable_since > self.patience_s:
                raise CoordinatorGone(f"coordinator at {self.base_url} unreachable for "
                                      f"{self.patience_s:.0f}s: {problem}")
            if await self.refresh():
                backoff.reset()
                continue
            await asyncio.sleep(backoff.next())

    def _answered(self, endpoint: Endpoint[Any, ReplyT], status: int, reply: bytes, sent_at: float) -> ReplyT:
        """The reply of a signed answer below 500; a 4xx raises."""
        if status >= 400:
            error = _error_reply(reply)
            if error.code == UNKNOWN_WORKER:
                raise NotRegistered(error.detail)
            if error.code == WORKER_RETIRED:
                raise Retired(error.detail)
            if error.code == WEIGHTS_MISMATCH:
                raise WeightsMismatch(error.detail)
            raise CoordinatorRefused(status, f"{endpoint.method} {endpoint.path}: {error.detail}")
        decoded = decode_reply(endpoint, reply)
        if self.timings is not None:
            waited = getattr(decoded, "waited_s", 0.0)
            took = time.monotonic() - sent_at
            first = endpoint.path not in self._timed
            self._timed.add(endpoint.path)
            self.timings.record(endpoint.path, time.time() - took, took - waited, first)
        return decoded

    async def call_until_answered(self, endpoint: Endpoint[Any, ReplyT], body: msgspec.Struct | None = None) -> ReplyT:
        """`call`, with a 4xx logged and the call sent again after a backoff: for the calls a
        worker cannot go on without (its engine's settings, its registration)."""
        backoff = Backoff(cap_s=10.0)
        while True:
            try:
                return await self.call(endpoint, body)
            except CoordinatorRefused as exc:
                wait = backoff.next()
                log.error("%s; again in %.1fs", exc, wait)
                await asyncio.sleep(wait)


def _error_reply(reply: bytes) -> ErrorReply:
    """A 4xx answer's `ErrorReply`, or its text when it is not one (a proxy's page, say)."""
    try:
        return msgspec.json.decode(reply, type=ErrorReply)
    except msgspec.DecodeError:
        return ErrorReply(reply[:500].decode(errors="replace"))
