"""The worker's HTTP client for the coordinator: the secret on every call, retries on network errors."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

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
            base_url=base_url, headers={"Authorization": f"Bearer {secret}"},
            timeout=httpx.Timeout(30.0, connect=5.0),
        )

    @classmethod
    async def from_run_dir(cls, run_dir: RunDir, *, address_timeout_s: float = 120.0,
                           patience_s: float = 60.0) -> CoordinatorClient:
        host, port = await wait_for_address(run_dir, address_timeout_s)
        return cls(f"http://{host}:{port}", run_dir.read_secret(), patience_s=patience_s)

    async def close(self) -> None:
        await self._http.aclose()

    async def call(self, method: str, path: str, body: dict | None = None) -> dict:
        """One API call, retried on network errors until the coordinator's patience runs out."""
        started = time.monotonic()
        delay = 0.1
        while True:
            try:
                response = await self._http.request(method, f"/v1/{path}", json=body)
            except httpx.TransportError as exc:
                if time.monotonic() - started > self.patience_s:
                    raise CoordinatorGone(f"coordinator at {self.base_url} unreachable for "
                                          f"{self.patience_s:.0f}s: {exc}") from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            if response.status_code == 404 and "register again" in response.text:
                raise NotRegistered(response.json().get("detail", ""))
            if response.status_code >= 400:
                raise RuntimeError(f"{method} /v1/{path} -> {response.status_code}: {response.text[:500]}")
            return response.json()
