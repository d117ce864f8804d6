"""The worker's HTTP client for the coordinator: the secret on every call, retries on network errors,
replies decoded into their `seerd.protocol` types."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx
import msgspec

from seerd.protocol import Endpoint, ErrorReply, ReplyT, decode_reply
from seerd.rundir import RunDir, RunDirError

log = logging.getLogger("seerd.worker")


class CoordinatorGone(RuntimeError):
    """The coordinator did not answer for longer than the worker's patience."""


class NotRegistered(RuntimeError):
    """The coordinator does not know this worker (it restarted): register again."""


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


class CoordinatorClient:
    def __init__(self, base_url: str, secret: str, *, patience_s: float = 60.0) -> None:
        self.base_url = base_url
        self.patience_s = patience_s
        self._http = httpx.AsyncClient(
            base_url=base_url, headers={"Authorization": f"Bearer {secret}", "Content-Type": "application/json"},
            timeout=httpx.Timeout(30.0, connect=5.0),
        )

    @classmethod
    async def from_run_dir(cls, run_dir: RunDir, *, address_timeout_s: float = 120.0,
                           patience_s: float = 60.0) -> CoordinatorClient:
        host, port = await wait_for_address(run_dir, address_timeout_s)
        return cls(f"http://{host}:{port}", run_dir.read_secret(), patience_s=patience_s)

    async def close(self) -> None:
        await self._http.aclose()

    async def call(self, endpoint: Endpoint[Any, ReplyT], body: msgspec.Struct | None = None) -> ReplyT:
        """One API call, retried on network errors until the coordinator's patience runs out; the
        reply decoded as the endpoint's type (`BadReply` if it is not one)."""
        started = time.monotonic()
        delay = 0.1
        content = None if body is None else msgspec.json.encode(body)
        while True:
            try:
                response = await self._http.request(endpoint.method, endpoint.path, content=content)
            except httpx.TransportError as exc:
                if time.monotonic() - started > self.patience_s:
                    raise CoordinatorGone(f"coordinator at {self.base_url} unreachable for "
                                          f"{self.patience_s:.0f}s: {exc}") from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            if response.status_code == 404 and "register again" in response.text:
                raise NotRegistered(msgspec.json.decode(response.content, type=ErrorReply).detail)
            if response.status_code >= 400:
                raise RuntimeError(f"{endpoint.method} {endpoint.path} -> {response.status_code}: "
                                   f"{response.text[:500]}")
            return decode_reply(endpoint, response.content)
