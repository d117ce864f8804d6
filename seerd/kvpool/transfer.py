"""Blocks between an engine's KV cache and the pool: the worker side of seerd's connector
(connector.py is vLLM's glue around it), usable without an engine (tests/integration/
test_kvpool_layouts.py drives it with KV tensors of every layout).

An object in the pool is a 64-byte header (magic, version, layer count, the layout's signature,
payload size, a random nonce, a MAC) then the block's payload (`blocks.BlockCopier`: every layer's
logical block, one after another). The MAC is Poly1305 over the object's name, the header's fields
and the payload, under a one-time key HMAC-SHA256(block key, nonce); the block key
(`seerd.signing.block_key`) comes from the secret of the coordinator that started the pool. The
pool is open to anyone on the network: a block under a seerd name that none of the run's engines
saved, or that was changed since, fails it.

The store reads and writes only the staging rows (registered with the store, so open to any peer);
a MAC is computed over a private copy (gathered from the KV cache before a save, copied out of
staging before a load), and a loaded block reaches the KV cache only from that copy, once checked.
"""

from __future__ import annotations

import hmac
import logging
import os
import struct
import time
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives.poly1305 import Poly1305

from seerd.kvpool.blocks import BlockCopier
from seerd.kvpool.keys import shard_key
from seerd.kvpool.pool import PoolClient

log = logging.getLogger("vllm.seerd.kvpool")  # under vllm's namespace: the engine's log shows it

# magic, version, layers, the layout's signature (blocks.layout_signature), payload bytes, nonce: under the MAC
FIELDS = struct.Struct("<4sHHIQ16s")
HEADER = struct.Struct("<4sHHIQ16s16s")  # the fields, then the MAC (Poly1305)
NONCE_BYTES = 16
HEADER_BYTES = 64
MAGIC = b"SKV3"
VERSION = 3
REJECTIONS_LOGGED = 10  # then one in 1000: an attack must not flood the engine's log
BATCH = 64  # blocks per store call at most
STAGING_BYTES = 32 << 20  # rows of header + block: the only memory of the engine its store client registers


@dataclass
class BlockTransfer:
    key: str
    block_id: int


class BlockIO:
    """One engine rank's saves and loads of whole blocks (`shard`: its (tensor, pipeline) rank,
    `shards`: the sizes; each rank's part of a block has a name of its own, `keys.shard_key`)."""

    def __init__(self, client: PoolClient, copier: BlockCopier, *, shard: tuple[int, int] = (0, 0),
                 shards: tuple[int, int] = (1, 1), staging_bytes: int = STAGING_BYTES) -> None:
        self.client, self.copier, self.shard, self.shards = client, copier, shard, shards
        row = HEADER_BYTES + copier.payload_bytes
        self.slots = max(1, min(BATCH, staging_bytes // row))
        self.staging = np.zeros((self.slots, row), dtype=np.uint8)  # what the store reads and writes
        self.private = np.zeros((self.slots, copier.payload_bytes), dtype=np.uint8)  # what MACs cover
        client.register_buffers([self.staging])  # never the KV cache: see the module's docstring

    def names(self, transfers: list[BlockTransfer]) -> list[str]:
        """The store's names of this rank's shards of the blocks."""
        return [shard_key(t.key, self.shard, self.shards) for t in transfers]

    def save(self, transfers: list[BlockTransfer]) -> None:
        for start in range(0, len(transfers), self.slots):
            self._save(transfers[start:start + self.slots])

    def load(self, transfers: list[BlockTransfer]) -> set[int]:
        """Load `transfers` into the KV cache; returns the block ids that were not (from the first
        that failed on: vLLM recomputes them)."""
        started = time.perf_counter()
        stats = self.client.stats
        failed: list[BlockTransfer] = []
        for start in range(0, len(transfers), self.slots):
            batch = transfers[start:start + self.slots]
            names = self.names(batch)
            rows = self.staging[:len(batch)]
            codes = self.client.get_blocks(names, [[row.ctypes.data] for row in rows], [[row.nbytes] for row in rows])
            good = 0  # only the leading run of sound blocks goes into the KV cache
            while good < len(batch) and self._verified(good, names[good], codes[good]):
                good += 1
            if good:
                self.copier.scatter([t.block_id for t in batch[:good]], self.private)
                stats.blocks_loaded += good
                stats.bytes_loaded += good * (self.copier.payload_bytes + HEADER_BYTES)
            if good < len(batch):
                failed = transfers[start + good:]
                break
        stats.load_failures += len(failed)
        stats.load_s += time.perf_counter() - started
        return {t.block_id for t in failed}

    def _save(self, transfers: list[BlockTransfer]) -> None:
        started = time.perf_counter()
        stats = self.client.stats
        key = self.client.block_key if self.client.usable() else None
        if key is None:  # no pool now (a MAC needs the key of the pool's run)
            stats.save_failures += len(transfers)
            return
        payload = self.copier.payload_bytes
        self.copier.gather([t.block_id for t in transfers], self.private)
        names = self.names(transfers)
        for slot, name in enumerate(names):
            fields = FIELDS.pack(MAGIC, VERSION, len(self.copier.layers), self.copier.signature, payload,
                                 os.urandom(NONCE_BYTES))
            header = fields + block_mac(key, name, fields, self.private[slot])
            self.staging[slot, :len(header)] = np.frombuffer(header, dtype=np.uint8)
            self.staging[slot, HEADER_BYTES:] = self.private[slot]
        rows = self.staging[:len(transfers)]
        codes = self.client.put_blocks(names, [[row.ctypes.data] for row in rows], [[row.nbytes] for row in rows])
        saved = sum(1 for code in codes if code == 0)
        stats.blocks_saved += saved
        stats.bytes_saved += saved * (payload + HEADER_BYTES)
        stats.save_failures += len(transfers) - saved
        stats.save_s += time.perf_counter() - started

    def _verified(self, slot: int, name: str, code: int) -> bool:
        """Whether the block fetched into staging row `slot` is sound: its size, its header (this
        engine's layout signature) and its MAC, checked over its copy in private row `slot`."""
        payload = self.copier.payload_bytes
        if code != payload + HEADER_BYTES:
            return False
        header = bytes(self.staging[slot, :HEADER.size])
        magic, version, layers, signature, size, _, mac = HEADER.unpack(header)
        if not (magic == MAGIC and version == VERSION and layers == len(self.copier.layers)
                and signature == self.copier.signature and size == payload):
            return False
        self.private[slot] = self.staging[slot, HEADER_BYTES:]
        key = self.client.block_key
        if key is not None and hmac.compare_digest(mac, block_mac(key, name, header[:FIELDS.size], self.private[slot])):
            return True
        stats = self.client.stats
        stats.blocks_rejected += 1
        if stats.blocks_rejected <= REJECTIONS_LOGGED or stats.blocks_rejected % 1000 == 0:
            log.warning("KV pool block %s failed its MAC (forged, or corrupted in the pool): not used, "
                        "recomputed (%d so far)", name, stats.blocks_rejected)
        return False


def block_mac(key: bytes, name: str, fields: bytes, payload: np.ndarray) -> bytes:
    """The MAC of a block stored under `name` (the name, the header's fields, the payload): Poly1305
    under a key used for this block only, derived from the block key and the header's nonce (a
    Poly1305 key must never tag two messages)."""
    mac = Poly1305(hmac.digest(key, fields[-NONCE_BYTES:], "sha256"))
    mac.update(name.encode() + b"\0" + fields)
    mac.update(payload)
    return mac.finalize()
