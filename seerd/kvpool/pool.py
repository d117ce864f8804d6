"""The engine process's one client of the job's KV pool, shared by both sides of the connector.

It contributes no memory to the pool (the node's holder does: an engine may exit with its data),
follows the pool's address file (`kvpool.json` in the run directory) so that a restarted master is
picked up, and degrades to "no pool" on any error: every caller then treats the pool as empty and
vLLM recomputes. Counters feed the worker's heartbeat (`seerd status`).

At each (re)connection it reads the run's secret (`RUN_DIR/secret`, which every coordinator start
writes anew before it starts a pool) and derives the key that authenticates blocks
(`seerd.signing.block_key`): read from the file, never passed through vLLM's configuration, which
vLLM logs.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from seerd.kvpool.address import POOL_FILE, PoolAddress, PoolAddressError, read_pool_address
from seerd.kvpool.holder import local_address_towards
from seerd.kvpool.keys import shard_keys
from seerd.kvpool.store import PoolUnavailable, close_quietly, open_store
from seerd.rundir import RunDir, RunDirError
from seerd.signing import block_key

log = logging.getLogger("vllm.seerd.kvpool")

ENGINE_BUFFER_BYTES = 16 << 20  # staging for unregistered copies; KV moves from registered caches
RECONNECT_EVERY_S = 2.0
ADDRESS_CHECK_EVERY_S = 1.0
FAILURES_BEFORE_RECONNECT = 3


@dataclass
class PoolStats:
    lookups: int = 0
    lookup_blocks: int = 0  # blocks asked about past the local prefix-cache hit
    hit_blocks: int = 0  # of those, found in the pool
    blocks_loaded: int = 0
    bytes_loaded: int = 0
    load_failures: int = 0  # blocks that failed a check (size, header, MAC) or did not arrive: recomputed
    blocks_rejected: int = 0  # of those, blocks whose MAC did not match: forged or corrupted in the pool
    load_s: float = 0.0
    blocks_saved: int = 0
    bytes_saved: int = 0
    save_failures: int = 0
    save_s: float = 0.0
    errors: int = 0  # store calls that failed
    reconnects: int = 0
    generation: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


class PoolClient:
    def __init__(self, run_dir: str, local_host: str | None) -> None:
        self.run_dir = Path(run_dir)
        self.local_host = local_host
        self.stats = PoolStats()
        self._store = None
        self._address: PoolAddress | None = None
        self._buffers: list = []  # numpy arrays registered for zero-copy transfers
        self._next_connect = 0.0
        self._next_address_check = 0.0
        self._address_mtime = 0.0
        self._failures = 0
        self.disabled: str | None = None
        self.block_key: bytes | None = None  # authenticates blocks (connector.py); set at each connection

    # ---------------------------------------------------------------- connection

    def disable(self, why: str) -> None:
        """No pool for this process's life (e.g. a KV layout the connector cannot copy)."""
        log.error("KV pool disabled in this engine: %s", why)
        self.disabled = why
        self._drop(why)

    def usable(self) -> bool:
        if self.disabled:
            return False
        now = time.monotonic()
        if self._store is not None and now >= self._next_address_check:
            self._next_address_check = now + ADDRESS_CHECK_EVERY_S
            if self._address_changed():
                self._drop("the pool's address changed (master restarted)")
        if self._store is None and now >= self._next_connect:
            self._next_connect = now + RECONNECT_EVERY_S
            self._connect()
        return self._store is not None

    def _address_changed(self) -> bool:
        try:
            mtime = os.stat(self.run_dir / POOL_FILE).st_mtime
        except OSError:
            return True
        if mtime == self._address_mtime:
            return False
        address = read_pool_address(self.run_dir)
        return address is None or self._address is None or address.generation != self._address.generation

    def _connect(self) -> None:
        try:
            address = read_pool_address(self.run_dir)
            if address is None:
                return
            self._address_mtime = os.stat(self.run_dir / POOL_FILE).st_mtime
            # The secret of the coordinator that started this pool generation (it wrote it first).
            key = block_key(RunDir(self.run_dir).read_secret())
            # None: this node's address on the route to the master (what peers reach us at).
            local_host = self.local_host or local_address_towards(address)
            store = open_store(address, local_host=local_host, segment_bytes=0,
                               buffer_bytes=ENGINE_BUFFER_BYTES)
            for buffer in self._buffers:
                code = store.register_buffer(buffer.ctypes.data, buffer.nbytes)
                if code != 0:
                    raise PoolUnavailable(f"register_buffer failed with {code}", code)
        except (PoolUnavailable, PoolAddressError, RunDirError, OSError, ValueError) as exc:
            log.warning("KV pool unavailable (chunks recompute their context): %s", exc)
            return
        self._store, self._address, self._failures, self.block_key = store, address, 0, key
        self.stats.generation = address.generation
        self.stats.reconnects += 1
        log.info("KV pool connected: master %s, generation %d", address.master, address.generation)

    def _drop(self, why: str) -> None:
        log.warning("KV pool client dropped: %s", why)
        store, self._store = self._store, None
        self._next_connect = 0.0
        if store is not None:
            close_quietly(store)  # closing a broken client must not fail the step

    def _failed(self, what: str, detail: object) -> None:
        self.stats.errors += 1
        self._failures += 1
        if self._failures >= FAILURES_BEFORE_RECONNECT:
            self._drop(f"{what} failed {self._failures} times in a row ({detail})")

    def register_buffers(self, buffers: list) -> None:
        self._buffers = list(buffers)
        if self._store is not None:
            for buffer in self._buffers:
                if self._store.register_buffer(buffer.ctypes.data, buffer.nbytes) != 0:
                    self._drop("register_buffer failed")
                    return

    # ---------------------------------------------------------------- operations

    def leading_present(self, keys: list[str], shards: tuple[int, int] = (1, 1)) -> int:
        """How many of `keys`, from the first, are in the pool with every parallel rank's shard
        (`keys.shard_keys`; 0 when the pool is unreachable)."""
        if not keys or not self.usable():
            return 0
        names = [name for key in keys for name in shard_keys(key, shards)]
        try:
            found = self._store.batch_is_exist(names)
        except Exception as exc:  # noqa: BLE001
            self._failed("batch_is_exist", exc)
            return 0
        if any(code < 0 for code in found):
            self._failed("batch_is_exist", found)
        self._failures = 0 if all(code >= 0 for code in found) else self._failures
        per_block = len(names) // len(keys)
        count = 0
        while count < len(keys) and all(code == 1 for code in found[count * per_block:(count + 1) * per_block]):
            count += 1
        return count

    def put_blocks(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        if not keys or not self.usable():
            return [-1] * len(keys)
        try:
            codes = list(self._store.batch_put_from_multi_buffers(keys, ptrs, sizes))
        except Exception as exc:  # noqa: BLE001
            self._failed("batch_put_from_multi_buffers", exc)
            return [-1] * len(keys)
        return codes

    def get_blocks(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        if not keys or not self.usable():
            return [-1] * len(keys)
        try:
            return list(self._store.batch_get_into_multi_buffers(keys, ptrs, sizes))
        except Exception as exc:  # noqa: BLE001
            self._failed("batch_get_into_multi_buffers", exc)
            return [-1] * len(keys)


_CLIENT: PoolClient | None = None


def pool_client(run_dir: str, local_host: str | None) -> PoolClient:
    """The process's client (the scheduler-side and worker-side connectors share it)."""
    global _CLIENT
    if _CLIENT is None:
        _CLIENT = PoolClient(run_dir, local_host)
    return _CLIENT


def pool_stats() -> dict | None:
    """This process's pool counters, or None when no connector made a client here."""
    return None if _CLIENT is None else _CLIENT.stats.to_dict()


def reset_pool_stats() -> None:
    """Counters from zero (`seerd serve`: a worker's figures are of its batch); between batches,
    while no request runs in the engine."""
    if _CLIENT is not None:
        _CLIENT.stats = PoolStats(generation=_CLIENT.stats.generation)

