"""What crosses process boundaries for drafting: engine request ids and the spec settings.

The drafter runs inside vLLM's model runner, which hands it token rows and request ids only
(in the engine-core process under AsyncLLM). So a chunk's engine request id carries what the
drafter needs to know about it: the chunk and lease epoch (the worker's own key), the group whose
siblings it drafts from, the database request id, where the response starts in the token row,
and whether it is its group's probe (high priority for draft depth).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SPEC_MODES = ("off", "ngram", "suffix", "grouped", "request")  # "request": own tokens only (ablation)
DEFAULT_GAMMA_MAX = 8
DEFAULT_PROBE_WEIGHT = 2.0  # the paper's lambda

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
