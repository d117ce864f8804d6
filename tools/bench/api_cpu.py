"""CPU per API call of the coordinator's app on its event-loop thread, without the network: the
ASGI app of `seerd.server.app.create_app` called in-process with a heartbeat (the cheapest
handler: the framework, the signature and body-limit middlewares, msgspec, the hop to the state
thread) and with a report of one 16-token chunk followed by its lease (what a chunk costs).
Each call is signed as a worker signs it and its answer's signature checked; that client-side
CPU is measured apart and left out of the figures (it is the worker's, not the coordinator's).

It measures the checkout it is run from (the repository root goes first on the import path), so a
change is measured by running it in both checkouts, alternated:

    .venv/bin/python tools/bench/api_cpu.py [--calls 1000] [--repeats 5] [--signature-share]

`--signature-share`: in one process, rounds alternate between calls through the whole app and the
same calls past its signature middleware (the stack below it, unsigned): their difference is what
the signature check and the answer's signature cost the coordinator, free of the drift between
processes that this 2-core machine shows.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import msgspec  # noqa: E402

from seerd.book.book import LeaseBook  # noqa: E402
from seerd.config import RunConfig  # noqa: E402
from seerd.coordinator.create import create_rollout  # noqa: E402
from seerd.db import make_engine, make_sessionmaker  # noqa: E402
from seerd.db.migrate import upgrade  # noqa: E402
from seerd.io.prompts import PromptRow  # noqa: E402
from seerd.protocol import HEARTBEAT, LEASE, REPORT, ChunkReport, HeartbeatBody, LeaseBody, ReportBody  # noqa: E402
from seerd.scheduler import make_policy  # noqa: E402
from seerd.server.app import CoordinatorControl, create_app  # noqa: E402

try:  # signed calls (the security branch on); before it, the bearer secret
    from seerd.signing import REPLY_HEADER, Signer, call_key  # noqa: E402
except ImportError:
    Signer = None

SECRET = "s" * 32
CHUNK = 16


def make_app(tmp: Path):  # noqa: ANN201
    engine = make_engine(tmp / "state.db", synchronous="FULL")
    upgrade(engine)
    sessions = make_sessionmaker(engine)
    config = RunConfig(input_path="bench", model_path="model", policy="divided", chunk_tokens=CHUNK, lease_ttl_s=600)
    rows = [PromptRow(f"p{g}", tuple(range(1, 33)), 8, 10**6, {}, g + 1) for g in range(50)]
    with sessions.begin() as session:
        rollout_id = create_rollout(session, config, rows, input_sha256="0" * 64, now=time.time())
    book = LeaseBook(sessions, rollout_id, make_policy("divided"), chunk_tokens=CHUNK, lease_ttl_s=600, seed=0,
                     vocab_size=1000)
    book.load(time.time())
    worker = book.register(rank=0, address="bench", max_chunks=1, kv_capacity_tokens=10**9, worker_id="bench",
                           now=time.time()).id
    return create_app(CoordinatorControl(book), SECRET), worker, engine


SIGNER = Signer(call_key(SECRET, "")) if Signer is not None else None
CLIENT_CPU = [0.0]  # the client's signing and checking: not the coordinator's
UNSIGNED = [False]  # calls past the signature middleware (--signature-share)


async def call(app, path: str, body: msgspec.Struct):  # noqa: ANN001, ANN201
    payload = msgspec.json.encode(body)
    started = time.thread_time()
    signing = SIGNER is not None and not UNSIGNED[0]
    if not signing:
        authorization = f"Bearer {SECRET}"
    else:
        authorization, nonce = SIGNER.sign("POST", path, payload)
    CLIENT_CPU[0] += time.thread_time() - started
    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "root_path": "",
             "query_string": b"", "scheme": "http", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1),
             "http_version": "1.1", "headers": [(b"authorization", authorization.encode()),
                                                (b"content-type", b"application/json"),
                                                (b"content-length", str(len(payload)).encode())]}
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": payload, "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    if sent[0]["status"] != 200:
        raise RuntimeError(f"{path}: {sent}")
    reply = b"".join(m.get("body", b"") for m in sent[1:])
    if signing:
        started = time.thread_time()
        signature = dict(sent[0]["headers"]).get(REPLY_HEADER.encode(), b"").decode()
        if not SIGNER.verify_reply(nonce, 200, signature, reply):
            raise RuntimeError(f"{path}: the answer's signature does not check")
        CLIENT_CPU[0] += time.thread_time() - started
    return reply


async def measure(calls: int, repeats: int, signature_share: bool = False) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        whole, worker, engine = make_app(Path(tmp))
        app = whole
        (grant,) = msgspec.json.decode(await call(app, LEASE.path, LeaseBody(worker, 1)), type=LEASE.reply).chunks
        below_signature = whole.middleware_stack.app.app  # ServerErrorMiddleware -> SignedCalls -> the rest

        async def heartbeat() -> None:
            await call(app, HEARTBEAT.path, HeartbeatBody(worker, [grant.chunk_id]))

        async def report_and_lease() -> None:  # the chunk's tokens, then its request's next chunk
            nonlocal grant
            report = ChunkReport(grant.chunk_id, grant.epoch, [7] * grant.max_tokens, [-1.0] * grant.max_tokens,
                                 "length")
            await call(app, REPORT.path, ReportBody(worker, [report]))
            (grant,) = msgspec.json.decode(await call(app, LEASE.path, LeaseBody(worker, 1)), type=LEASE.reply).chunks

        async def rounds(fn) -> list[float]:  # noqa: ANN001
            started, client_before = time.thread_time(), CLIENT_CPU[0]
            for _ in range(calls):
                await fn()
            return (time.thread_time() - started - (CLIENT_CPU[0] - client_before)) / calls * 1e6

        figures = {}
        for name, fn in (("heartbeat", heartbeat), ("report + lease", report_and_lease)):
            for _ in range(calls // 5):  # warm-up
                await fn()
            signed, unsigned = [], []
            for _ in range(repeats):
                signed.append(await rounds(fn))
                if signature_share:
                    app, UNSIGNED[0] = below_signature, True
                    unsigned.append(await rounds(fn))
                    app, UNSIGNED[0] = whole, False
            figures[name] = statistics.median(signed)
            if signature_share:
                figures[f"{name}, past the signature"] = statistics.median(unsigned)
        engine.dispose()
        return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--signature-share", action="store_true",
                        help="alternate rounds through the signature middleware and past it")
    args = parser.parse_args()
    figures = asyncio.run(measure(args.calls, args.repeats, args.signature_share))
    for name, us in figures.items():
        print(f"{name:<36} {us:7.0f} us CPU per call on the event-loop thread (median of {args.repeats})")


if __name__ == "__main__":
    main()
