#!/usr/bin/env python
"""What one call to the coordinator costs a worker's event loop, per HTTP client.

    python tools/bench/http_client.py [--calls 2000] [--rounds 3] [--tokens 128] [--sync]

A uvicorn server in another process (the coordinator's server; a bare ASGI app that answers
every POST with a small JSON reply, so the server's own cost is out of the client's figures; the
calls of seerd's own clients go through the coordinator's signature check, as they must)
and, in this process, one client at a time sending report-sized POSTs (two chunks of `--tokens`
token ids and logprobs, JSON) one after another on a kept-alive connection. Per client: the
calling thread's CPU per call (what the worker's event loop spends beside its engine) and wall
time per call. Clients, interleaved round by round: httpx.AsyncClient (what the worker used
before), aiohttp.ClientSession, and seerd's own `CoordinatorClient._send` (aiohttp underneath).
`--sync`: the blocking clients of the draft sync thread instead: httpx.Client (before),
http.client.HTTPConnection, and seerd's `drafts.client.HttpTransport._post` (http.client).
Prints medians over the rounds and each client's CPU as a multiple of httpx's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import msgspec

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the checkout it is run from, not the one installed in the venv
SERVER = """
import sys, uvicorn
from types import SimpleNamespace
REPLY = b'{"results": [], "grants": [], "done": false}'
async def bare(scope, receive, send):
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(REPLY)).encode())]})
    await send({"type": "http.response.body", "body": REPLY})
try:  # seerd's clients sign their calls and check the answers' signatures: answer them as the coordinator
    from seerd.server.auth import SignedCalls
    signed = SignedCalls(bare, "secret", SimpleNamespace(busy_s=0.0, calls=0, refused={}),
                         address=f"127.0.0.1:{sys.argv[1]}")
except ImportError:  # a checkout before signed calls
    signed = bare
async def app(scope, receive, send):
    if scope["type"] == "http":
        await (bare if scope["path"] == "/raw" else signed)(scope, receive, send)
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def timed(call, calls: int) -> tuple[float, float]:  # noqa: ANN001
    for _ in range(50):  # connection up, code paths warm
        await call()
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(calls):
        await call()
    return (time.thread_time() - cpu) / calls, (time.perf_counter() - wall) / calls


async def with_httpx(base: str, body: bytes, calls: int) -> tuple[float, float]:
    import httpx

    async with httpx.AsyncClient(base_url=base, headers={"Content-Type": "application/json"}) as http:
        async def call() -> None:
            (await http.post("/raw", content=body)).content  # noqa: B018

        return await timed(call, calls)


async def with_aiohttp(base: str, body: bytes, calls: int) -> tuple[float, float]:
    import aiohttp

    async with aiohttp.ClientSession(base_url=base, headers={"Content-Type": "application/json"}) as http:
        async def call() -> None:
            async with http.post("/raw", data=body) as response:
                await response.read()

        return await timed(call, calls)


async def with_seerd(base: str, body: bytes, calls: int) -> tuple[float, float]:
    from seerd.worker.client import CoordinatorClient

    client = CoordinatorClient(base, "secret")
    try:
        return await timed(lambda: client._send("POST", "/v1/report", body), calls)
    finally:
        await client.close()


CLIENTS = {"httpx": with_httpx, "aiohttp": with_aiohttp, "seerd client": with_seerd}


def timed_sync(call, calls: int) -> tuple[float, float]:  # noqa: ANN001
    for _ in range(50):
        call()
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(calls):
        call()
    return (time.thread_time() - cpu) / calls, (time.perf_counter() - wall) / calls


async def with_httpx_sync(base: str, body: bytes, calls: int) -> tuple[float, float]:
    import httpx

    with httpx.Client(base_url=base, headers={"Content-Type": "application/json"}) as http:
        return timed_sync(lambda: http.post("/raw", content=body).content, calls)


async def with_http_client(base: str, body: bytes, calls: int) -> tuple[float, float]:
    from http.client import HTTPConnection
    from urllib.parse import urlsplit

    address = urlsplit(base)
    http = HTTPConnection(address.hostname, address.port, timeout=5)

    def call() -> None:
        http.request("POST", "/raw", body=body, headers={"Content-Type": "application/json"})
        http.getresponse().read()

    try:
        return timed_sync(call, calls)
    finally:
        http.close()


async def with_seerd_drafts(base: str, body: bytes, calls: int) -> tuple[float, float]:
    from seerd.drafts.client import HttpTransport
    from seerd.protocol import REPORT

    transport = HttpTransport(base, "secret")
    raw = msgspec.json.decode(body)  # sent as the transport sends a draft call: encoded by msgspec

    class Body(msgspec.Struct):
        worker_id: str
        reports: list

    payload = Body(**raw)
    try:
        return timed_sync(lambda: transport._post(REPORT, payload), calls)
    finally:
        transport.close()


SYNC_CLIENTS = {"httpx": with_httpx_sync, "http.client": with_http_client, "seerd drafts": with_seerd_drafts}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per reported chunk (two chunks per call)")
    parser.add_argument("--sync", action="store_true", help="the draft sync thread's blocking clients")
    args = parser.parse_args()
    clients = SYNC_CLIENTS if args.sync else CLIENTS
    body = json.dumps({"worker_id": "w", "reports": [
        {"chunk_id": i, "epoch": 1, "token_ids": list(range(1000, 1000 + args.tokens)),
         "logprobs": [-0.123456] * args.tokens, "finish_reason": "length"} for i in range(2)]}).encode()
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("the server did not start") from None
                time.sleep(0.1)
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in clients}
        for round_ in range(args.rounds):
            for name, client in clients.items():
                cpu, wall = asyncio.run(client(f"http://127.0.0.1:{port}", body, args.calls))
                results[name].append((cpu, wall))
                print(f"# round {round_ + 1} {name}: {1e6 * cpu:.0f} us CPU, {1e6 * wall:.0f} us wall per call",
                      file=sys.stderr)
    finally:
        server.terminate()
        server.wait()
    base_cpu = statistics.median(c for c, _ in results["httpx"])
    print(f"report-sized POST ({len(body)} bytes), {args.calls} calls x {args.rounds} rounds, medians")
    print(f"{'client':<14} {'CPU us/call':>11} {'wall us/call':>12} {'CPU x httpx':>11}")
    for name, rows in results.items():
        cpu, wall = statistics.median(c for c, _ in rows), statistics.median(w for _, w in rows)
        print(f"{name:<14} {1e6 * cpu:>11.0f} {1e6 * wall:>12.0f} {cpu / base_cpu:>11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
