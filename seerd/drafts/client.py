"""The worker's side of grouped drafting: local per-group indices, kept fresh from the draft server.

Lives in the engine process, beside the drafter. The drafter (on the engine's stepping thread)
only ever touches local indices: it extends its own requests' sequences with the tokens the
engine just sampled, and queues those tokens for the server. A background thread pushes the
queued tokens in batches and pulls what sibling requests on other workers generated since its
cursors, so a step never waits for the network. When the coordinator is unreachable, drafting
goes on from what is local.

Cursors: per group, per request not running here, (gen, count) of what the local index holds.
A request that runs here is indexed from the engine's own token row; its cursor follows the
server's acknowledgements and its echoes are ignored, and when its chunk ends the cursor is set to
what the local index holds, so the next fetch sends only what is new (or a reset, if another
worker rewrote that request meanwhile: `gen` changed).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from seerd.drafts.index import SuffixIndex
from seerd.protocol import (
    DRAFTS_APPEND, DRAFTS_FETCH, DraftAppendBody, DraftAppendItem, DraftAppendResult, DraftChanges, DraftFetchBody,
    Endpoint, decode_reply,
)
from seerd.signing import REPLY_HEADER, STALE_TIMESTAMP, Signer, call_key

log = logging.getLogger("seerd.drafts")

PROMPT_KEY = "prompt"
UNKNOWN_GEN = -1  # a cursor that asks the server for the whole log


@dataclass
class LocalGroup:
    index: SuffixIndex
    cursors: dict[int, tuple[int, int]] = field(default_factory=dict)  # request -> (gen, count)
    own: dict[int, int] = field(default_factory=dict)  # request running here -> tracked chunks
    last_used: float = field(default_factory=time.monotonic)


@dataclass
class PendingPush:
    prev_count: int  # tokens of the response before `tokens`
    tokens: list[int] = field(default_factory=list)
    final: bool = False  # the chunk ended: send whatever is left


class DraftTransportError(RuntimeError):
    """The coordinator answered a draft call with an error status."""


class HttpTransport:
    """The draft server's two calls over the coordinator's API (signed, and only signed answers
    believed: `seerd.signing`), on one kept-alive connection of the standard library's
    `http.client`: the sync thread calls twice per `sync_interval_s` beside a busy engine, and per
    call it costs a fraction of httpx's CPU (`tools/bench/http_client.py --sync`). Any failure
    raises; the sync loop then makes a new transport, which reads the run directory again (a
    restarted coordinator has a new address and secret)."""

    def __init__(self, base_url: str, secret: str, timeout_s: float = 2.0) -> None:
        from http.client import HTTPConnection
        from urllib.parse import urlsplit

        address = urlsplit(base_url)
        self._http = HTTPConnection(address.hostname, address.port, timeout=timeout_s)
        self._signer = Signer(call_key(secret, address.netloc))
        self._headers = {"Content-Type": "application/json"}

    @classmethod
    def from_run_dir(cls, run_dir: str) -> HttpTransport:
        from pathlib import Path

        from seerd.rundir import RunDir

        rundir = RunDir(Path(run_dir))
        host, port = rundir.read_address()
        return cls(f"http://{host}:{port}", rundir.read_secret())

    def append(self, items: list[DraftAppendItem]) -> list[DraftAppendResult]:
        return self._post(DRAFTS_APPEND, DraftAppendBody(items)).results

    def fetch(self, cursors: dict[int, dict[int, tuple[int, int]]]) -> DraftChanges:
        return self._post(DRAFTS_FETCH, DraftFetchBody(cursors))

    def _post(self, endpoint: Endpoint, body: msgspec.Struct):  # noqa: ANN202
        content = msgspec.json.encode(body)
        for _ in range(2):  # a second time only when the coordinator's signed answer corrected our clock
            authorization, nonce = self._signer.sign("POST", endpoint.path, content)
            self._http.request("POST", endpoint.path, body=content,
                               headers={**self._headers, "Authorization": authorization})
            response = self._http.getresponse()
            reply = response.read()
            if not self._signer.verify_reply(nonce, response.status, response.getheader(REPLY_HEADER), reply):
                raise DraftTransportError(f"POST {endpoint.path} -> {response.status} without the run's "
                                          f"coordinator's signature")
            if not (response.status == 401 and STALE_TIMESTAMP.encode() in reply):
                break
        if response.status >= 400:
            raise DraftTransportError(f"POST {endpoint.path} -> {response.status}: {reply[:200]!r}")
        return decode_reply(endpoint, reply)

    def close(self) -> None:
        self._http.close()


class DraftClient:
    def __init__(self, transport_factory: Callable[[], object] | None, *, index_factory=SuffixIndex,  # noqa: ANN001
                 sync_interval_s: float = 0.2, push_batch: int = 16, idle_group_s: float = 30.0) -> None:
        # 0.2 s, not 0.05: on the motif rollouts (tools/bench/spec_rollout.py) the sync threads'
        # CPU fell from 0.53 to 0.18 s a run and the coordinator's from 10% to 6% of a core, with
        # the same acceptance (67-68%, 2.46 tokens per drafted step): siblings' text a few more
        # tokens old drafts as well.
        self.transport_factory = transport_factory
        self.index_factory = index_factory
        self.sync_interval_s = sync_interval_s
        self.push_batch = push_batch
        self.idle_group_s = idle_group_s
        self.lock = threading.Lock()  # guards groups and pending; held briefly by both threads
        self.groups: dict[int, LocalGroup] = {}
        self.pending: dict[tuple[int, int], PendingPush] = {}
        self.acked: dict[tuple[int, int], tuple[int, int]] = {}  # (group, request) -> server (gen, count)
        self.fetched_tokens = 0
        self.pushed_tokens = 0
        self.sync_errors = 0
        self.sync_cpu_s = 0.0  # the sync thread's CPU time: what grouped drafting costs beside the engine
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if transport_factory is not None:
            self._thread = threading.Thread(target=self._sync_loop, name="seerd-drafts", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------ drafter side (stepping thread)
    def track(self, group: int, request: int, prompt: Sequence[int], response: Sequence[int]) -> SuffixIndex:
        """A chunk of `request` starts here: index its prompt (once per group) and response so far."""
        with self.lock:
            local = self.groups.get(group)
            if local is None:
                local = self.groups[group] = LocalGroup(self.index_factory())
                local.index.extend(PROMPT_KEY, prompt)
            local.last_used = time.monotonic()
            local.own[request] = local.own.get(request, 0) + 1
            if local.index.length(request) != len(response):
                local.index.replace(request, response)
            key = (group, request)
            if key not in self.pending:
                self.pending[key] = PendingPush(len(response))
            return local.index

    def extend_own(self, group: int, request: int, tokens: Sequence[int]) -> None:
        with self.lock:
            local = self.groups.get(group)
            if local is None:
                return
            local.index.extend(request, tokens)
            push = self.pending.get((group, request))
            if push is not None:
                push.tokens.extend(tokens)

    def untrack(self, group: int, request: int) -> None:
        """The chunk ended here: push what is left; from now on the server's copy is the one to follow."""
        with self.lock:
            local = self.groups.get(group)
            if local is None:
                return
            remaining = local.own.get(request, 0) - 1
            if remaining > 0:
                local.own[request] = remaining
                return
            local.own.pop(request, None)
            push = self.pending.get((group, request))
            if push is not None:
                push.final = True
            gen = self.acked.get((group, request), (UNKNOWN_GEN, 0))[0]
            local.cursors[request] = (gen, local.index.length(request)) if gen != UNKNOWN_GEN else (UNKNOWN_GEN, 0)

    # ------------------------------------------------------------ background thread
    def _sync_loop(self) -> None:
        transport = None
        while not self._stop.wait(self.sync_interval_s):
            started = time.thread_time()
            try:
                if transport is None:
                    transport = self.transport_factory()
                self.sync_once(transport)
            except Exception as exc:  # the server is an accelerator, never a dependency
                self.sync_errors += 1
                if self.sync_errors in (1, 10, 100) or self.sync_errors % 1000 == 0:
                    log.warning("draft server sync failed (%d times so far): %r", self.sync_errors, exc)
                transport = None
                self._stop.wait(min(2.0, self.sync_interval_s * 10))
            finally:
                self.sync_cpu_s += time.thread_time() - started

    def sync_once(self, transport) -> None:  # noqa: ANN001
        self._push(transport)
        self._pull(transport)
        self._forget_idle_groups()

    def _push(self, transport) -> None:  # noqa: ANN001
        with self.lock:
            batch = [(key, push.prev_count, list(push.tokens)) for key, push in self.pending.items()
                     if push.tokens and (push.final or len(push.tokens) >= self.push_batch)]
            for key in [k for k, push in self.pending.items() if push.final and not push.tokens]:
                del self.pending[key]
        if not batch:
            return
        # Pending tokens leave the queue only once the server answered: a failed call sends them again.
        results = transport.append([DraftAppendItem(g, r, prev, tokens) for (g, r), prev, tokens in batch])
        self.pushed_tokens += sum(len(tokens) for _, _, tokens in batch)
        with self.lock:
            for ((group, request), _, tokens), result in zip(batch, results):
                push = self.pending.get((group, request))
                if push is not None:
                    del push.tokens[:len(tokens)]
                    push.prev_count += len(tokens)
                    if push.final and not push.tokens:
                        del self.pending[(group, request)]
                if result.ok:
                    self.acked[(group, request)] = (result.gen, result.count)

    def _pull(self, transport) -> None:  # noqa: ANN001
        with self.lock:
            cursors = {}
            for group, local in self.groups.items():
                mine = {r: self.acked.get((group, r), (UNKNOWN_GEN, 0)) for r in local.own}
                # A request absent from the cursors is one the server sends whole.
                cursors[group] = {r: c for r, c in {**local.cursors, **mine}.items() if c[0] != UNKNOWN_GEN}
        if not cursors:
            return
        reply = transport.fetch(cursors)
        with self.lock:
            for group in reply.unknown:  # finished, expired or evicted on the server
                local = self.groups.get(group)
                if local is not None and not local.own:
                    del self.groups[group]
            for group, requests in reply.dropped.items():
                local = self.groups.get(group)
                for request in requests if local is not None else ():
                    if request not in local.own:
                        local.index.drop(request)
                        local.cursors.pop(request, None)
            for group, changes in reply.changes.items():
                local = self.groups.get(group)
                if local is None:
                    continue
                for request, (gen, start, tokens) in changes.items():
                    if request in local.own:  # indexed from the engine's own row; just follow the server
                        self.acked[(group, request)] = (gen, start + len(tokens))
                        continue
                    held = local.cursors.get(request)
                    if start == 0 or held is None or held[0] != gen:
                        local.index.replace(request, tokens)
                    else:
                        local.index.extend(request, tokens)
                    local.cursors[request] = (gen, start + len(tokens))
                    self.fetched_tokens += len(tokens)

    def _forget_idle_groups(self) -> None:
        now = time.monotonic()
        with self.lock:
            for group, local in list(self.groups.items()):
                if not local.own and now - local.last_used > self.idle_group_s:
                    del self.groups[group]
                    for key in [k for k in self.acked if k[0] == group]:
                        del self.acked[key]

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
