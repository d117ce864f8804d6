#!/usr/bin/env python
"""What authenticating a KV pool block costs the engine's stepping thread, per block.

    python tools/bench/block_mac.py [--repeats 200]

For the block shapes of the models the pool is measured with (float32, vLLM-CPU's 128-token
blocks, one `[kv_heads, block, 2 * head_dim]` slice per layer): the connector's own `_block_mac`
(Poly1305 of the key's name, the header's fields and every layer's block under a one-time key from
HMAC-SHA256; run once when a block is saved and once when it is loaded), HMAC-SHA256 over the same
(the plain choice, not taken), and the CRC32 of the payload the MAC replaced (zlib, the same layer
views); and a save's copies of one block (`BlockCopier.gather` from the KV cache into its private
row, then into its staging row; a load makes the same two the other way; the store never reads or
writes the KV cache itself). Prints microseconds of CPU per block, medians of 5 rounds.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import statistics
import sys
import time
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout it is run from

# name: (layers, kv heads, head dim); float32, 128 tokens a block
SHAPES = {"motif (examples/motif_model)": (4, 4, 32), "tiny": (2, 2, 32), "gqa-24m": (8, 2, 64),
          "Llama-3-8B's bytes (32 x 8 x 64, f32)": (32, 8, 64)}
BLOCK_TOKENS = 128


def crc32(layers: list[np.ndarray], block_id: int) -> int:
    crc = 0
    for layer in layers:
        crc = zlib.crc32(layer[block_id], crc)
    return crc


def hmac_sha256(key: bytes, name: str, fields: bytes, layers: list[np.ndarray], block_id: int) -> bytes:
    mac = hmac.new(key, name.encode() + b"\0" + fields, hashlib.sha256)
    for layer in layers:
        mac.update(layer[block_id])
    return mac.digest()


def per_block_us(fn, repeats: int) -> float:  # noqa: ANN001
    fn()
    rounds = []
    for _ in range(5):
        started = time.thread_time()
        for _ in range(repeats):
            fn()
        rounds.append((time.thread_time() - started) / repeats * 1e6)
    return statistics.median(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    import torch

    from seerd.kvpool.blocks import BlockCopier
    from seerd.kvpool.transfer import FIELDS, HEADER_BYTES, MAGIC, NONCE_BYTES, VERSION, block_mac
    from seerd.signing import block_key

    key = block_key("bench")
    name = "seerd-kv/run/g1/r2/" + "ab" * 16
    print(f"{'block of':<38} {'bytes':>10} {'CRC32 us':>9} {'HMAC-SHA256 us':>15} {'Poly1305 us':>12} "
          f"{'x CRC':>6} {'copies us':>10}")
    for label, (layers, heads, head_dim) in SHAPES.items():
        row_bytes = heads * BLOCK_TOKENS * 2 * head_dim * 4
        caches = [np.random.default_rng(i).integers(0, 255, size=(8, row_bytes), dtype=np.uint8)
                  for i in range(layers)]
        copier = BlockCopier({f"layer{i}": torch.from_numpy(cache).view(torch.float32).view(8, heads, BLOCK_TOKENS, -1)
                              for i, cache in enumerate(caches)}, 8)
        private = np.zeros((2, copier.payload_bytes), np.uint8)
        staging = np.zeros((2, HEADER_BYTES + copier.payload_bytes), np.uint8)
        fields = FIELDS.pack(MAGIC, VERSION, layers, copier.signature, row_bytes * layers, os.urandom(NONCE_BYTES))
        crc = per_block_us(lambda: crc32(caches, 3), args.repeats)
        sha = per_block_us(lambda: hmac_sha256(key, name, fields, caches, 3), args.repeats)
        copier.gather([3], private)
        poly = per_block_us(lambda: block_mac(key, name, fields, private[0]), args.repeats)

        def save_copies() -> None:
            copier.gather([3], private)
            staging[0, HEADER_BYTES:] = private[0]

        copy = per_block_us(save_copies, args.repeats)
        print(f"{label:<38} {row_bytes * layers:>10,} {crc:>9.0f} {sha:>15.0f} {poly:>12.0f} "
              f"{poly / crc:>6.2f} {copy:>10.0f}")


if __name__ == "__main__":
    main()
