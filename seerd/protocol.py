"""What crosses the coordinator/worker boundary: the API's path prefix, the long-poll constants,
the chunk grant and report, and the engine request id codec.

Dependency-light (the standard library and msgspec only): the worker, the draft client inside the
engine, `seerd status` and the simulator import it without FastAPI or the lease book. Field names
are the JSON names on the wire.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import msgspec

API_PREFIX = "/v1"

# How long a lease call waits for work (the simulator answers calls in the daemon's order with these).
LONG_POLL_MAX_S = 5.0  # the coordinator holds an empty lease call at most this long
LEASE_LONG_POLL_S = 1.0  # what a worker asks for: a freed slot is noticed soon, idling stays cheap


# ----------------------------------------------------------------------------- grants and reports
class ChunkGrant(msgspec.Struct, frozen=True):
    """What a worker needs to run one chunk."""

    chunk_id: int
    epoch: int
    request_id: int
    prompt_token_ids: list[int]  # the group's prompt + the request's tokens so far
    max_tokens: int
    sampling: dict
    deadline: float
    # Tokens left to the response's target length (benchmark rows), else None. The worker ends
    # the chunk there with finish reason "length_target"; max_tokens stays the scheduler's budget.
    target_remaining: int | None = None
    # Who the chunk belongs to, for the worker's drafter: the group's sibling responses are what
    # it drafts from, and response tokens start after the group's prompt.
    group_id: int = 0
    prompt_len: int = 0
    is_probe: bool = False


class ChunkReport(msgspec.Struct, frozen=True):
    chunk_id: int
    epoch: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    cached_tokens: int | None = None


# ----------------------------------------------------------------------------- engine request ids
# The drafter runs inside vLLM's model runner, which hands it token rows and request ids only (in
# the engine-core process under AsyncLLM); the KV connector sees request ids too. So a chunk's
# engine request id carries what they need: the chunk and lease epoch (the worker's own key), the
# group whose siblings it drafts from, the database request id, where the response starts in the
# token row, and whether it is its group's probe (high priority for draft depth).

# vLLM 0.32 appends "-<8 random hex>" to every request id inside the engine (the runner sees that).
_ENGINE_ID = re.compile(r"^c(\d+)e(\d+)g(\d+)r(\d+)p(\d+)(h?)(?:-[0-9a-zA-Z]+)?$")


@dataclass(frozen=True)
class ChunkIdentity:
    chunk_id: int
    epoch: int
    group_id: int
    request_id: int
    prompt_len: int  # response tokens start here in the engine's token row
    is_probe: bool

    @property
    def engine_id(self) -> str:
        return (f"c{self.chunk_id}e{self.epoch}g{self.group_id}r{self.request_id}p{self.prompt_len}"
                f"{'h' if self.is_probe else ''}")

    @property
    def lease_key(self) -> str:
        """The worker's own key for a running chunk (what its stats and aborts use)."""
        return lease_key(self.chunk_id, self.epoch)


def lease_key(chunk_id: int, epoch: int) -> str:
    return f"c{chunk_id}e{epoch}"


def parse_engine_id(engine_id: str) -> ChunkIdentity | None:
    """The identity a seerd worker encoded, or None for any other request id."""
    match = _ENGINE_ID.match(engine_id)
    if match is None:
        return None
    chunk, epoch, group, request, prompt_len, probe = match.groups()
    return ChunkIdentity(int(chunk), int(epoch), int(group), int(request), int(prompt_len), probe == "h")
