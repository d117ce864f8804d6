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
  tokens never count), copied whole from the KV cache, authenticated (a MAC under a key from the
  run's secret: Poly1305, 0.2 of HMAC-SHA256's CPU per block, `tools/bench/block_mac.py`) and put
  through a registered staging buffer, never the KV cache itself (`transfer.py`). Synchronous: a
  step's saves finish before it returns, so a block is never freed or overwritten while being read.
- Load: before the forward, into the blocks vLLM allocated; only the leading run of sound blocks
  (size, header, layout signature, MAC) reaches the KV cache; from the first that fails on, blocks
  are reported (`get_block_ids_with_load_errors`) and vLLM recomputes them
  (`kv_load_failure_policy="recompute"`). A missing pool costs recomputes, never a request.
- Layouts (`blocks.py`): every layout vLLM 0.32 uses (CPU, FlashAttention, FlashInfer, MLA's latent
  cache, kernel-block splits) is a logical `[blocks, head slots, tokens, content]` view per layer;
  a block's bytes are its logical content, gathered in batches (on a GPU: one gather and one copy to
  pinned memory per layer, on a side stream). A layout it cannot copy makes the engine run without
  the pool. Tensor- and pipeline-parallel engines: each rank saves and loads its own shard under a
  name with its ranks (`keys.shard_key`); a block counts as present when every rank's shard is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from seerd.kvpool.blocks import BlockCopier, UnsupportedLayout
from seerd.kvpool.keys import BlockKeys, batch_scope, namespace_digest
from seerd.kvpool.pool import PoolClient, pool_client
from seerd.kvpool.transfer import BlockIO, BlockTransfer
from seerd.protocol import ChunkIdentity, parse_engine_id

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

CONNECTOR_CLASS = "SeerdPoolConnector"
MODULE_PATH = "seerd.kvpool.connector"


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
        self._shards = (parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
        # scheduler side
        self._tracked: dict[str, _Tracked] = {}
        self._pending_loads: dict[str, list[BlockTransfer]] = {}
        # worker side
        self._io: BlockIO | None = None  # once the KV cache is registered (and copyable)
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
        found = self._client.leading_present(keys[first:usable], self._shards)
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
                tracked.saved_blocks = self._client.leading_present(keys[:done], self._shards)
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
        try:
            copier = BlockCopier(kv_caches, self._num_blocks(kv_caches))
        except UnsupportedLayout as exc:  # run without the pool rather than copy wrongly
            self._client.disable(f"seerd's KV pool connector cannot copy this KV cache by blocks: {exc}")
            return
        self._io = BlockIO(self._client, copier, shard=_parallel_rank(), shards=self._shards)

    def _num_blocks(self, kv_caches: dict[str, torch.Tensor]) -> int:
        config = self._kv_cache_config
        if config is not None and getattr(config, "num_blocks", 0):
            return int(config.num_blocks)
        return int(next(iter(kv_caches.values())).shape[0])

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        for transfers in meta.loads.values():
            if self._io is None:  # this side never got a KV cache to copy into: recompute
                self._load_errors.update(t.block_id for t in transfers)
                self._client.stats.load_failures += len(transfers)
            else:
                self._load_errors |= self._io.load(transfers)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole blocks are saved after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if self._io is None:
            self._client.stats.save_failures += len(meta.saves)
            return
        self._io.save(meta.saves)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors


def _parallel_rank() -> tuple[int, int]:
    """This worker's (tensor, pipeline) parallel rank; (0, 0) where no parallel group exists."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank(), get_pp_group().rank_in_group
    except (AssertionError, ImportError, RuntimeError):
        return 0, 0


def _layout_signature(kv_cache_config: KVCacheConfig | None) -> str:
    if kv_cache_config is None:
        return ""
    return ";".join(f"{sorted(group.layer_names)}:{group.kv_cache_spec!r}" for group in kv_cache_config.kv_cache_groups)
