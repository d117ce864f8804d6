"""A trainer's side of `seerd serve`: submit a batch, follow its groups, collect its rows.

    client = seerd.Client("/shared/runs/serve")
    rows = client.rollout(prompts, weights="/shared/ckpt/step-40", n=8, temperature=1.0)
    for group in client.stream(prompts, weights=...):   # each group once its last response ended
        ...

The client runs beside the serve on the filesystem they share: it reads the serve's address and
secret from the run directory at every call (a restarted serve has new ones), signs each call and
believes only answers the serve signed (seerd/signing.py), so a process on a stale address learns
nothing. Prompts given as a list are written to a private file in the run directory, whose path
the batch names. A submission carries a key of the client's: sent again after a lost answer, or
after the serve restarted, it answers the batch it created, never a second one.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

import httpx
import msgspec

from seerd.protocol import BATCH_GROUPS_AFTER, BATCH_GROUPS_WAIT, BATCHES, BatchBody, BatchState, ErrorReply, GroupsReply
from seerd.rundir import RunDir, RunDirError, write_private
from seerd.signing import Signer, call_key, httpx_auth

SAMPLING_OPTIONS = ("n", "max_tokens", "temperature", "top_p", "top_k", "seed")
POLL_S = 0.25  # between calls the serve did not answer
GROUPS_WAIT_S = 5.0  # how long the serve may hold a call for groups while none ends


class ServeError(RuntimeError):
    """The serve refused a call (bad prompts, settings or weights: the message says which), or
    did not answer within the client's patience."""


class BatchFailed(ServeError):
    """The batch ended failed (its reason in the message)."""


class Client:
    def __init__(self, server_dir: str | os.PathLike, *, patience_s: float = 120.0, poll_s: float = POLL_S) -> None:
        self.run_dir = RunDir(Path(server_dir).resolve())
        self.patience_s = patience_s
        self.poll_s = poll_s

    # ------------------------------------------------------------------ the calls
    def _call(self, method: str, path: str, body: msgspec.Struct | None = None,
              params: dict | None = None) -> bytes:
        """One signed call, sent again while the serve does not answer (restarting, between
        address files) for up to the patience; a refusal raises ServeError at once."""
        deadline = time.monotonic() + self.patience_s
        problem = ""
        while time.monotonic() < deadline:
            try:
                host, port = self.run_dir.read_address()
                secret = self.run_dir.read_secret()
                reply = httpx.request(method, f"http://{host}:{port}{path}", params=params, timeout=60.0,
                                      content=None if body is None else msgspec.json.encode(body),
                                      auth=httpx_auth(Signer(call_key(secret, f"{host}:{port}"))))
            except (RunDirError, httpx.HTTPError) as exc:
                problem = str(exc) or type(exc).__name__
            else:
                if not reply.extensions.get("seerd_verified"):
                    problem = f"{host}:{port} answered {reply.status_code} without the serve's signature"
                elif reply.status_code == 200:
                    return reply.content
                elif reply.status_code < 500 and reply.status_code != 401:
                    raise ServeError(_detail(reply.content))
                else:
                    problem = f"{reply.status_code}: {_detail(reply.content)}"
            time.sleep(self.poll_s)
        raise ServeError(f"the serve at {self.run_dir.path} did not answer within {self.patience_s:.0f}s: {problem}")

    def submit(self, prompts: Iterable[dict] | str | os.PathLike, weights: str | os.PathLike | None = None, *,
               key: str | None = None, **sampling: object) -> BatchState:
        """Queue a batch; returns its state (`.batch` is its id). `prompts`: a prompt file, or rows
        as a prompt file holds them ({"id", "prompt"} or {"prompt_token_ids"}, optional "n", ...).
        `sampling`: n, max_tokens, temperature, top_p, top_k, seed (else the serve's)."""
        unknown = set(sampling) - set(SAMPLING_OPTIONS)
        if unknown:
            raise TypeError(f"unknown sampling options {sorted(unknown)}; known: {', '.join(SAMPLING_OPTIONS)}")
        key = key or uuid.uuid4().hex
        path = self._input_file(prompts, key)
        body = BatchBody(str(path), key, str(Path(weights).resolve()) if weights else None, **sampling)
        return msgspec.json.decode(self._call("POST", BATCHES.path, body), type=BatchState)

    def state(self, batch: int) -> BatchState:
        return msgspec.json.decode(self._call("GET", f"{BATCHES.path}/{batch}"), type=BatchState)

    def groups(self, batch: int) -> Iterator[dict]:
        """Each group of `batch` once, as soon as its last response ended, until every group has:
        {"group_index", "prompt_id", "prompt_token_ids" (as the serve tokenized it), "rows"}.
        BatchFailed if the batch fails."""
        after, delivered = 0, 0
        while True:
            reply = msgspec.json.decode(self._call("GET", f"{BATCHES.path}/{batch}/groups", params={
                BATCH_GROUPS_AFTER: after, BATCH_GROUPS_WAIT: GROUPS_WAIT_S}), type=GroupsReply)
            yield from reply.groups
            delivered += len(reply.groups)
            if delivered >= reply.groups_total:  # every group ended (the batch may still be exporting)
                return
            after = reply.cursor
            if reply.status == "failed":
                raise BatchFailed(f"batch {batch} failed: {self.state(batch).reason}")
            # "interrupted": the serve is stopping; a serve started again runs the batch on, and
            # the calls wait for it up to the patience. The serve holds each call while nothing
            # ends (GROUPS_WAIT_S), so this loop asks again at once.

    def stream(self, prompts: Iterable[dict] | str | os.PathLike, weights: str | os.PathLike | None = None,
               **sampling: object) -> Iterator[dict]:
        """`submit`, then `groups`: a trainer scores each group while the tail still runs."""
        yield from self.groups(self.submit(prompts, weights, **sampling).batch)

    def rollout(self, prompts: Iterable[dict] | str | os.PathLike, weights: str | os.PathLike | None = None,
                **sampling: object) -> list[dict]:
        """Every response row of a new batch, in (group, response) order, once it ended."""
        rows = [row for group in self.stream(prompts, weights, **sampling) for row in group["rows"]]
        return sorted(rows, key=lambda row: (row["group_index"], row["response_index"]))

    # ------------------------------------------------------------------ helpers
    def _input_file(self, prompts: Iterable[dict] | str | os.PathLike, key: str) -> Path:
        if isinstance(prompts, (str, os.PathLike)):
            return Path(prompts).resolve()
        folder = self.run_dir.path / "batches" / "inputs"
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = folder / f"{key}.jsonl"
        write_private(path, "".join(json.dumps(row) + "\n" for row in prompts))
        return path


def _detail(content: bytes) -> str:
    try:
        return msgspec.json.decode(content, type=ErrorReply).detail
    except msgspec.DecodeError:
        return content[:300].decode(errors="replace")
