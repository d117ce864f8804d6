"""The pool's budget on a real Mooncake master and holder (no vLLM): past 70% full, the coordinator
removes the blocks of the requests queued longest until the pool is under 60%, before Mooncake's
own eviction (from 80%) acts; a running request's blocks and the prompt blocks stay."""

from __future__ import annotations

import asyncio
import time

import pytest

from seerd.book.records import WaitingRequest
from seerd.kvpool.holder import HolderProcess
from seerd.kvpool.host import TRIM_ABOVE, TRIM_BELOW, PoolHost
from seerd.kvpool.keys import BlockKeys
from seerd.kvpool.service import EVICTION_HIGH_WATERMARK, PoolService
from seerd.kvpool.store import MiB, close_quietly, open_store
from tests.integration.harness import wait_for

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(120)]

SEGMENT = 64 * MiB
BLOCK = 1 * MiB  # a block's size in the pool; the connector's are a few hundred kB to a few MB
PROMPT, BLOCK_TOKENS, OWN_BLOCKS = 256, 128, 7
RUNNING = (1, 11)
QUEUED_OLDEST_FIRST = [(1, 13), (2, 22), (1, 12), (2, 23), (2, 21)]


def keys_of(group: int, request: int) -> list[str]:
    """The keys the connector would save for a request: 2 prompt blocks, then 7 of its own."""
    tokens = list(range(group * 10_000, group * 10_000 + PROMPT))
    tokens += [request * 1_000 + i for i in range(OWN_BLOCKS * BLOCK_TOKENS)]
    return BlockKeys(b"n" * 16, "run1", group, request, PROMPT, BLOCK_TOKENS).extend(tokens, len(tokens))


def present(store, keys: list[str]) -> int:  # noqa: ANN001
    return sum(code == 1 for code in store.batch_is_exist(keys))


def test_the_longest_queued_requests_go_before_mooncake_evicts(tmp_path):
    service = PoolService(tmp_path, "127.0.0.1", log_dir=tmp_path)
    host = PoolHost(service, "run1", local_host="127.0.0.1")
    address = host.start()
    holder = HolderProcess(tmp_path, SEGMENT, log_path=tmp_path / "holder.log")
    holder.spawn()
    store = None
    try:
        wait_for(lambda: service.stats().get("capacity_bytes") == SEGMENT, 30, "the holder's segment")
        store = open_store(address, local_host="127.0.0.1", segment_bytes=0, buffer_bytes=16 * MiB)
        requests = {scope: keys_of(*scope) for scope in [RUNNING, *QUEUED_OLDEST_FIRST]}
        for key in sorted({key for keys in requests.values() for key in keys}):
            assert store.put(key, b"x" * BLOCK) == 0
        before = service.stats()
        # 2 groups x 2 prompt blocks + 6 requests x 7 of their own: 46 MiB of 64, over 70%, under 80%.
        assert before["bytes_used"] == 46 * BLOCK and before["keys"] == 46, before
        assert TRIM_ABOVE * SEGMENT <= before["bytes_used"] < EVICTION_HIGH_WATERMARK * SEGMENT

        asked = []

        async def queued_longest(limit: int, after: WaitingRequest | None) -> list[WaitingRequest]:
            asked.append((limit, after))
            return [WaitingRequest(group, request, float(queued_at))
                    for queued_at, (group, request) in enumerate(QUEUED_OLDEST_FIRST)]

        started = time.perf_counter()
        asyncio.run(host.check(queued_longest))
        took = time.perf_counter() - started
        after = service.stats()
        print(f"check with trimming took {took * 1000:.1f} ms; before {before}; after {after}; "
              f"figures {host.latest}")
        assert asked == [(64, None)]

        # 46 - 7 = 39 MiB is not under 60% (38.4 MiB); 46 - 14 = 32 MiB is.
        left = {scope: present(store, keys[2:]) for scope, keys in requests.items()}
        assert left == {RUNNING: 7, (1, 13): 0, (2, 22): 0, (1, 12): 7, (2, 23): 7, (2, 21): 7}, left
        assert all(present(store, keys[:2]) == 2 for keys in requests.values())  # the prompt blocks
        assert after["bytes_used"] == 32 * BLOCK < TRIM_BELOW * SEGMENT
        assert (host.latest["trimmed_requests"], host.latest["trimmed_blocks"],
                host.latest["trimmed_bytes"]) == (2, 14, 14 * BLOCK)
        assert after["evicted_keys"] == 0 and after["evicted_bytes"] == 0  # Mooncake's eviction never ran

        # The counter does see Mooncake's own eviction: past 80% without trimming it evicts, in its order.
        extra = [f"seerd-kv/run1/g3/r31/{i:032x}" for i in range(20)]
        codes = [store.put(key, b"x" * BLOCK) for key in extra]
        evicted = wait_for(lambda: service.stats().get("evicted_keys"), 10, "Mooncake's own eviction")
        print(f"Mooncake evicted {evicted} keys at {52 * BLOCK / SEGMENT:.0%} full (put codes {set(codes)}); "
              f"blocks left per request: {[present(store, keys) for keys in requests.values()]}")
    finally:
        if store is not None:
            close_quietly(store)
        holder.stop()
        host.close(run_finished=False)
