"""KV blocks of every cache layout vLLM uses, through the real Mooncake store (issue 19).

No GPU here: the caches are CPU tensors of each layout's shape, strides and dtype (bf16, fp8), and
they go through the same code a GPU engine's connector runs (`seerd.kvpool.blocks.BlockCopier`,
`seerd.kvpool.transfer.BlockIO`), on a real master, metadata server and holder. A block saved from
one engine's cache and loaded into another's, at other block ids, comes back bit-identical;
batches end partly full; tensor-parallel ranks keep their own shards; a block of another layout,
dtype or rank never loads.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from seerd.kvpool.blocks import BlockCopier, layer_blocks
from seerd.kvpool.pool import PoolClient
from seerd.kvpool.transfer import HEADER_BYTES, BlockIO, BlockTransfer
from tests.integration.harness import kv_pool

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(180)]

BLOCKS, LAYERS, TOKENS, HEADS, HEAD = 12, 3, 16, 2, 8  # small blocks: the layouts are the point
GENERATOR = torch.Generator().manual_seed(0)


def random_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), dtype=torch.uint8, generator=GENERATOR)
    return raw.view(dtype)


def unified(order: tuple[int, int, int, int], dtype: torch.dtype) -> Callable[[bool], dict]:
    """vLLM 0.32's per-layer logical view `[B, H, N, C]` over physical memory in `order`."""
    logical = (BLOCKS, HEADS, TOKENS, 2 * HEAD)

    def make(fill: bool) -> dict:
        caches = {}
        for layer in range(LAYERS):
            physical = tuple(logical[i] for i in order)
            data = random_bytes(physical, dtype) if fill else torch.zeros(physical, dtype=dtype)
            caches[f"layers.{layer}.attn"] = data.permute(*[order.index(i) for i in range(4)])
        return caches
    return make


def per_layer(shape: tuple[int, ...], dtype: torch.dtype) -> Callable[[bool], dict]:
    def make(fill: bool) -> dict:
        return {f"layers.{layer}.attn": random_bytes(shape, dtype) if fill else torch.zeros(shape, dtype=dtype)
                for layer in range(LAYERS)}
    return make


def cross_layer(dtype: torch.dtype) -> Callable[[bool], dict]:
    """Block-outermost across layers (`BLHNC`, for transfers): one tensor, every layer a view."""
    def make(fill: bool) -> dict:
        shape = (BLOCKS, LAYERS, HEADS, TOKENS, 2 * HEAD)
        whole = random_bytes(shape, dtype) if fill else torch.zeros(shape, dtype=dtype)
        return {f"layers.{layer}.attn": whole[:, layer] for layer in range(LAYERS)}
    return make


LAYOUTS = {
    "layout_cpu_float32": per_layer((BLOCKS, HEADS, TOKENS, 2 * HEAD), torch.float32),
    "layout_unified_lbhnc_bf16": unified((0, 1, 2, 3), torch.bfloat16),
    "layout_unified_lbnhc_bf16": unified((0, 2, 1, 3), torch.bfloat16),
    "layout_cross_layer_blhnc_fp8": cross_layer(torch.float8_e4m3fn),
    "layout_flash_attn_kv_apart_bf16": per_layer((2, BLOCKS, TOKENS, HEADS, HEAD), torch.bfloat16),
    "layout_flashinfer_nhd_bf16": per_layer((BLOCKS, 2, TOKENS, HEADS, HEAD), torch.bfloat16),
    "layout_mla_latent_bf16": per_layer((BLOCKS, TOKENS, 576), torch.bfloat16),
    "layout_mla_unified_fp8": per_layer((BLOCKS, 1, TOKENS, 656), torch.float8_e4m3fn),
    "layout_kernel_blocks_bf16": per_layer((BLOCKS * 2, HEADS, TOKENS // 2, 2 * HEAD), torch.bfloat16),
}


@pytest.fixture(scope="module")
def pool_dir(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("kvpool-layouts")
    with kv_pool(run_dir, 256 << 20):
        yield run_dir


@pytest.fixture
def pool(pool_dir):
    """Makes the pool's clients, one per engine (rank) of a test, as each engine process has one."""
    clients = []

    def client() -> PoolClient:
        made = PoolClient(str(pool_dir), "127.0.0.1")
        clients.append(made)
        deadline = time.monotonic() + 30
        while not made.usable():  # until the holder's segment is mounted (a second or two at first)
            assert time.monotonic() < deadline, "no pool"
            made._next_connect = 0.0
            time.sleep(0.2)
        return made

    yield client
    for made in clients:
        made._drop("the test is over")


def engine(client: PoolClient, caches: dict, *, shard=(0, 0), shards=(1, 1)) -> BlockIO:  # noqa: ANN001
    copier = BlockCopier(caches, BLOCKS)
    # Room for three blocks per store call: the seven blocks below go in batches of 3, 3 and 1.
    return BlockIO(client, copier, shard=shard, shards=shards, staging_bytes=3 * (HEADER_BYTES + copier.payload_bytes))


def block_bytes(caches: dict, block: int) -> list[torch.Tensor]:
    return [layer_blocks(name, cache, BLOCKS).blocks[block].contiguous() for name, cache in caches.items()]


SAVED = [3, 7, 1, 11, 0, 5, 9]  # source block ids, in a request's order
LOADED_AT = [2, 4, 6, 8, 10, 1, 0]  # where the second engine's allocator put them


def transfers(name: str, block_ids: list[int]) -> list[BlockTransfer]:
    return [BlockTransfer(f"seerd-kv/{name}/b1/g1/r1/{i:02d}", block) for i, block in enumerate(block_ids)]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_blocks_come_back_bit_identical_at_other_block_ids(pool, layout):
    make = LAYOUTS[layout]
    source, target = make(True), make(False)
    saver, loader = engine(pool(), source), engine(pool(), target)
    assert saver.slots == 3
    saver.save(transfers(layout, SAVED))
    assert saver.client.stats.blocks_saved == len(SAVED) and saver.client.stats.save_failures == 0
    assert loader.load(transfers(layout, LOADED_AT)) == set()
    assert loader.client.stats.blocks_loaded == len(SAVED)
    for src, dst in zip(SAVED, LOADED_AT):
        assert all(torch.equal(a, b) for a, b in zip(block_bytes(source, src), block_bytes(target, dst))), (src, dst)
    untouched = set(range(BLOCKS)) - set(LOADED_AT)
    assert all(not block.any() for b in untouched for block in block_bytes(target, b))  # nothing spilled over


def test_layout_of_another_shape_or_dtype_never_loads(pool):
    """Same bytes per block, other meaning: head slots and content swapped, or fp16 for bf16."""
    source = per_layer((BLOCKS, HEADS, TOKENS, 2 * HEAD), torch.bfloat16)(True)
    engine(pool(), source).save(transfers("mismatch", SAVED))
    for other in (per_layer((BLOCKS, 2 * HEADS, TOKENS, HEAD), torch.bfloat16)(False),
                  per_layer((BLOCKS, HEADS, TOKENS, 2 * HEAD), torch.float16)(False)):
        loader = engine(pool(), other)
        assert loader.copier.payload_bytes == BlockCopier(source, BLOCKS).payload_bytes
        assert loader.load(transfers("mismatch", LOADED_AT)) == set(LOADED_AT)
        assert loader.client.stats.blocks_loaded == 0
        assert all(not cache.any() for cache in other.values())


def test_layout_tensor_parallel_ranks_keep_their_own_shards(pool):
    """Two TP ranks, each with its half of the heads: each loads its own shard back; a block counts
    as present only once every rank's shard is; a rank never loads another's."""
    make = per_layer((BLOCKS, HEADS, TOKENS, 2 * HEAD), torch.bfloat16)
    ranks = [make(True), make(True)]
    keys = transfers("tp2", SAVED)
    rank0 = engine(pool(), ranks[0], shard=(0, 0), shards=(2, 1))
    rank0.save(keys)
    plain_keys = [t.key for t in keys]
    assert rank0.client.leading_present(plain_keys, (2, 1)) == 0  # rank 1's shards are not there yet
    assert engine(pool(), make(False), shard=(1, 0), shards=(2, 1)).load(keys) == set(SAVED)
    engine(pool(), ranks[1], shard=(1, 0), shards=(2, 1)).save(keys)
    assert rank0.client.leading_present(plain_keys, (2, 1)) == len(SAVED)
    assert rank0.client.leading_present(plain_keys, (4, 1)) == 0  # another parallel layout: other names
    for rank, caches in enumerate(ranks):
        target = make(False)
        at = transfers("tp2", LOADED_AT)
        assert engine(pool(), target, shard=(rank, 0), shards=(2, 1)).load(at) == set()
        for src, dst in zip(SAVED, LOADED_AT):
            assert all(torch.equal(a, b) for a, b in zip(block_bytes(caches, src), block_bytes(target, dst)))
