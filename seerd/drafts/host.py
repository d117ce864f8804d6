"""The job's grouped draft server, hosted in the coordinator process on a thread of its own.

The server (`seerd.drafts.server.DraftServer`) is single-owner: every call runs on the
`seerd-drafts` thread, so it needs no locks, and a slow database commit on the state thread never
delays a worker's fetch. Its inputs:
- workers push tokens of running chunks (HTTP `drafts/append`), so siblings running elsewhere
  draft from each other within a chunk;
- the lease book's committed chunks (the durable truth: a re-run chunk's tokens replace what a
  dead worker had pushed);
- at start, every unfinished group's tokens so far (a resumed run), and optionally the responses of
  an earlier rollout of the same prompt (`--spec-history`, as RhymeRL's HistoSpec does).
Groups are registered when the coordinator starts, refreshed while unfinished, and evicted when
their last response is done or their TTL passes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path


from seerd.book.leases import read_tokens
from seerd.db import Connection, queries, read
from seerd.drafts.server import DraftError, DraftServer
from seerd.ownership import Ownership
from seerd.protocol import DraftAppendItem, DraftAppendResult

log = logging.getLogger("seerd.coordinator")

GROUP_TTL_S = 1800.0  # refreshed every REFRESH_S while the group is unfinished; the TTL only catches leaks
REFRESH_S = 60.0
HISTORY_RESPONSES_PER_PROMPT = 16


class DraftHost:
    def __init__(self, server: DraftServer | None = None) -> None:
        self.server = server or DraftServer(first_gen=int(time.time() * 1000))
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="seerd-drafts")
        self.history_responses = 0

    async def run(self, fn, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201
        return await asyncio.get_running_loop().run_in_executor(self._thread, partial(fn, *args, **kwargs))

    def submit(self, fn, *args) -> None:  # noqa: ANN001, ANN002
        self._thread.submit(self._logged, fn, *args)

    @staticmethod
    def _logged(fn, *args) -> None:  # noqa: ANN001, ANN002
        try:
            fn(*args)
        except DraftError as exc:  # e.g. a chunk of a group evicted meanwhile: drafting loses nothing
            log.debug("draft server: %s", exc)

    def close(self) -> None:
        self._thread.shutdown(wait=True)

    # ------------------------------------------------------------------ from the lease book
    def committed(self, group: int, request: int, offset: int, tokens: Sequence[int]) -> None:
        """Called on the state thread after a commit: the chunk's tokens are the durable truth."""
        self.submit(self.server.append, group, request, offset, list(tokens))

    def group_finished(self, group: int) -> None:
        self.submit(self.server.finish, group)

    def register(self, groups: Sequence[int]) -> None:
        self.submit(self._register_all, list(groups))

    def _register_all(self, groups: list[int]) -> None:
        for group in groups:
            self.server.register(group, GROUP_TTL_S)
        self.server.expire()

    def seed(self, sequences: dict[int, dict[int, Sequence[int]]]) -> None:
        """Unfinished groups' tokens so far: {group: {request: tokens}}."""
        def load() -> None:
            for group, requests in sequences.items():
                self.server.register(group, GROUP_TTL_S)
                for request, tokens in requests.items():
                    if tokens:
                        self.server.append(group, request, 0, list(tokens))
        self.submit(load)


def book_sequences(book) -> dict[int, dict[int, list[int]]]:  # noqa: ANN001
    """On the state thread: every unfinished group's requests and their tokens so far."""
    with book.engine.connect() as conn:
        return {gid: {rid: response_tokens(book, conn, rid) for rid in book.state.groups[gid].request_ids}
                for gid in book.state.unfinished_groups}


def response_tokens(book, conn: Connection, request_id: int) -> list[int]:  # noqa: ANN001
    """A request's tokens so far: from the book's memory while it runs, else from its done chunks."""
    progress = book.progress[request_id]
    if progress.tokens is not None and not book.state.requests[request_id].finished:
        return list(progress.tokens)
    return list(read_tokens(conn, request_id))


def history_sequences(history_db: Path, this_db: Path, groups: Sequence[int], *,
                      ownership: Ownership | None = None,
                      rollouts: Sequence[int] | None = None) -> dict[int, dict[int, list[int]]]:
    """Responses of an earlier rollout of the same prompts (matched by prompt hash), as extra
    sequences of this run's groups, keyed by negative request ids so they never meet real ones.
    `ownership`: the coordinator's, of this run (its own database is never a remote coordinator's).
    `rollouts`: only these rollouts of `history_db` (`seerd serve`: its earlier batches, same database).

    Raises seerd.db.read.UnreadableDatabase."""
    from seerd.db.codec import unpack_ints

    wanted = set(groups)
    by_hash = defaultdict(list)
    with read.reading(this_db, ownership=ownership) as conn:
        for gid, prompt_hash in queries.groups.prompt_hashes(conn):
            if gid in wanted:
                by_hash[prompt_hash].append(gid)
    responses: dict[str, dict[int, list[int]]] = defaultdict(dict)
    with read.reading(history_db, ownership=ownership if history_db == this_db else None) as old:
        for _, prompt_hash, rid, blob in queries.responses.finished_response_chunks(old, rollouts):
            if prompt_hash in by_hash:
                per_prompt = responses[prompt_hash]
                if rid in per_prompt or len(per_prompt) < HISTORY_RESPONSES_PER_PROMPT:
                    per_prompt.setdefault(rid, []).extend(unpack_ints(blob))
    out: dict[int, dict[int, list[int]]] = {}
    for prompt_hash, per_prompt in responses.items():
        for gid in by_hash[prompt_hash]:
            out[gid] = {-(k + 1): tokens for k, tokens in enumerate(per_prompt.values())}
    return out


def append_items(server: DraftServer, items: Sequence[DraftAppendItem]) -> list[DraftAppendResult]:
    """On the drafts thread: one result per pushed segment; a bad one never spoils the others."""
    results = []
    for item in items:
        try:
            r = server.append(item.group, item.request, item.prev_count, item.tokens)
        except DraftError as exc:
            results.append(DraftAppendResult(False, error=str(exc)))
            continue
        results.append(DraftAppendResult(True, r.count, r.gen, r.appended, r.pending, r.rewritten, list(r.evicted)))
    return results
