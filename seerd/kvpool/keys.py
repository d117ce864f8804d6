"""Where a KV block lives in the pool: keys chained over token ids, scoped so cleanup is cheap.

A block's digest is chained over the token ids of every block up to and including it, starting
from a namespace digest (the run, the model's revision, dtype, block size, parallelism and the KV
layout the engine really has). So two blocks share a digest only if everything that shaped their
KV is the same; another model, dtype, block size or run never matches.

The key's text also says whose block it is, so the coordinator removes a finished request's
blocks, a finished group's prompt blocks, a finished batch's and a finished run's everything with
one `remove_by_regex` each, without knowing any digest:

    seerd-kv/<run>/b<batch>/g<group>/p/<digest>         blocks made only of prompt tokens (the group's)
    seerd-kv/<run>/b<batch>/g<group>/r<request>/<digest>  blocks holding any response token

`<run>/b<batch>` is the scope (`batch_scope`): the pool's run tag, then the rollout the chunk
belongs to, from its engine request id. Under `seerd serve` one pool lives across batches, each
batch runs under one set of weights (strictly on-policy) and its own rollout id, so a block
computed under other weights never matches, and a batch's keys go with it.

Blocks of identical responses in one group (greedy n > 1) are stored once per request: the cost is
pool space, and it lets a finished request drop its blocks without reference counts.
"""

from __future__ import annotations

import hashlib
import json
import re
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

KEY_ROOT = "seerd-kv"
DIGEST_BYTES = 16


def namespace_digest(parts: dict) -> bytes:
    """A digest of everything that must agree for two blocks' KV to be interchangeable."""
    canonical = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(canonical.encode(), digest_size=DIGEST_BYTES).digest()


def shard_key(key: str, shard: tuple[int, int], shards: tuple[int, int]) -> str:
    """The store's name of one rank's shard of a block: a tensor- or pipeline-parallel engine keeps
    each rank's part of a block under its own name, `key@tp<rank>.pp<rank>` (`shard` is the
    (tensor, pipeline) rank, `shards` the sizes). One rank alone: the key itself. The sizes are
    in every key's namespace digest, so another parallel layout never matches."""
    if shards == (1, 1):
        return key
    return f"{key}@tp{shard[0]}.pp{shard[1]}"


def shard_keys(key: str, shards: tuple[int, int]) -> list[str]:
    """Every rank's name of a block (a block is in the pool when every rank's shard is)."""
    return [shard_key(key, (tp, pp), shards) for pp in range(shards[1]) for tp in range(shards[0])]


def batch_scope(run_tag: str, batch: int) -> str:
    """The scope of one rollout's (one serve batch's) keys; what the patterns below take as `run_tag`."""
    return f"{run_tag}/b{batch}"


def run_prefix(run_tag: str) -> str:
    return f"{KEY_ROOT}/{run_tag}/"


def group_pattern(run_tag: str, group_id: int) -> str:
    """A regex over every key of one group (prompt and responses)."""
    return f"^{KEY_ROOT}/{_re(run_tag)}/g{group_id}/"


def request_pattern(run_tag: str, group_id: int, request_id: int) -> str:
    """A regex over the blocks that hold a request's response tokens."""
    return f"^{KEY_ROOT}/{_re(run_tag)}/g{group_id}/r{request_id}/"


def run_pattern(run_tag: str) -> str:
    """Every key under `run_tag`: a run's (its tag) or a batch's (its `batch_scope`)."""
    return f"^{KEY_ROOT}/{_re(run_tag)}/"


def _re(text: str) -> str:
    return re.escape(text)


def _block_bytes(token_ids: Sequence[int], start: int, stop: int) -> bytes:
    return array("i", token_ids[start:stop]).tobytes()


@dataclass
class BlockKeys:
    """The keys of one token sequence's full blocks, extended as the sequence grows.

    `prompt_len` decides which blocks are the group's (all tokens in the prompt) and which are the
    request's. Extending hashes only the new blocks: a request's tokens are only ever appended
    (vLLM keeps draft tokens apart from them), so what was hashed stays true.
    """

    namespace: bytes
    run_tag: str
    group_id: int
    request_id: int
    prompt_len: int
    block_size: int
    keys: list[str] = field(default_factory=list)
    _digest: bytes = b""

    def extend(self, token_ids: Sequence[int], num_tokens: int) -> list[str]:
        """Keys of the full blocks within the first `num_tokens` tokens (hashing only new ones)."""
        full = num_tokens // self.block_size
        if len(self.keys) > full:
            return self.keys[:full]
        digest = self._digest or self.namespace
        for index in range(len(self.keys), full):
            start, stop = index * self.block_size, (index + 1) * self.block_size
            digest = hashlib.blake2b(digest + _block_bytes(token_ids, start, stop),
                                     digest_size=DIGEST_BYTES).digest()
            self.keys.append(self._key(stop, digest))
        self._digest = digest
        return self.keys

    def _key(self, block_end: int, digest: bytes) -> str:
        scope = "p" if block_end <= self.prompt_len else f"r{self.request_id}"
        return f"{KEY_ROOT}/{self.run_tag}/g{self.group_id}/{scope}/{digest.hex()}"
