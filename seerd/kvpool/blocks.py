"""Whole KV blocks between an engine's KV cache and host memory, for every layout vLLM uses.

vLLM 0.32 views every attention layer's cache as a logical `[B, H, N, C]` tensor (blocks, head
slots, tokens of a block, content), whatever the backend and its physical order
(`vllm/v1/kv_cache_interface.py`, `create_kv_cache_views`; the order is a `KVCacheLayout`):
- the CPU backend: `[B, kv_heads, N, 2*head]` (K then V in the content), contiguous;
- FlashAttention, FlashInfer and the Triton backends: the same logical view, K and V in the
  content, physically in the layout's order (`LBHNC`, `LBNHC`, ... or block-outermost `BLHNC`
  for transfers), so a block may be strided;
- MLA (DeepSeek, Kimi, Moonlight): one latent vector per token, `H` = 1, `C` = latent + rope;
- kernel blocks: a manager block split into `r` kernel blocks shows as `B * r` rows
  (`group_kernel_blocks` views them back as `[B, r, ...]`);
- and the per-layer layouts of earlier vLLM versions: FlashAttention's K and V apart,
  `[2, B, N, H, D]` (the block axis second), FlashInfer's `[B, 2, N, H, D]`, MLA's `[B, N, C]`.

A block's bytes here are its logical content in that order (`index_select` on the block axis,
then contiguous), so the same code serves every layout, on CPU and GPU tensors alike: the
physical order never reaches the pool, and two engines whose logical shapes agree exchange blocks
whatever their physical layouts. What must agree (head slots, tokens, content bytes, dtype, kernel
split) is `signature`, which goes into every block's header and is checked on load.

On a GPU the copies are batched (one gather and one device-to-host copy per layer per batch of
blocks) into pinned host memory on a side stream that first waits for the compute stream, and
synchronize before the host reads them; on the CPU they are plain tensor copies.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch


class UnsupportedLayout(ValueError):
    """A KV cache this code cannot copy by whole blocks (the engine then runs without the pool)."""


@dataclass(frozen=True)
class LayerBlocks:
    name: str
    blocks: torch.Tensor  # uint8, block axis first: [num_blocks, ...] (a view of the KV cache)
    block_bytes: int


def layer_blocks(name: str, cache: torch.Tensor, num_blocks: int) -> LayerBlocks:
    """The byte view of one layer's cache with the manager block axis first."""
    if cache.dim() < 2:
        raise UnsupportedLayout(f"layer {name}: a KV cache of shape {tuple(cache.shape)} has no block axis")
    if cache.stride(-1) != 1:  # the content axis is innermost in every vLLM layout: bytes need it so
        raise UnsupportedLayout(f"layer {name}: content axis not innermost (strides {cache.stride()})")
    raw = cache.view(torch.uint8)
    if raw.shape[0] != num_blocks and raw.dim() > 2 and raw.shape[0] == 2 and raw.shape[1] == num_blocks:
        raw = raw.movedim(1, 0)  # K and V apart, blocks second (FlashAttention before vLLM's unified views)
    if raw.shape[0] != num_blocks:
        if raw.shape[0] % num_blocks:
            raise UnsupportedLayout(f"layer {name}: {raw.shape[0]} rows for {num_blocks} blocks")
        raw = raw.unflatten(0, (num_blocks, raw.shape[0] // num_blocks))  # kernel blocks
    return LayerBlocks(name, raw, int(np.prod(raw.shape[1:])))


class BlockCopier:
    """Copies whole blocks of every layer between the KV cache and host rows of `payload_bytes`
    (the layers' blocks one after another, in the order the engine registered them)."""

    def __init__(self, caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        if not caches:
            raise UnsupportedLayout("no KV cache layers")
        self.layers = [layer_blocks(name, cache, num_blocks) for name, cache in caches.items()]
        devices = {layer.blocks.device for layer in self.layers}
        if len(devices) != 1:
            raise UnsupportedLayout(f"KV cache layers on several devices: {sorted(map(str, devices))}")
        self.device = devices.pop()
        self.payload_bytes = sum(layer.block_bytes for layer in self.layers)
        self.signature = layout_signature(caches, self.layers)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._pinned: torch.Tensor | None = None

    def gather(self, block_ids: list[int], out: np.ndarray) -> None:
        """Blocks `block_ids` into `out[:len(block_ids)]` (host, `[rows, payload_bytes]` uint8)."""
        count = len(block_ids)
        host = torch.from_numpy(out[:count])
        if self._stream is None:
            ids = torch.tensor(block_ids, dtype=torch.long)
            offset = 0
            for layer in self.layers:
                host[:, offset:offset + layer.block_bytes] = layer.blocks.index_select(0, ids).reshape(count, -1)
                offset += layer.block_bytes
            return
        pinned = self._pinned_rows(count)
        with torch.cuda.stream(self._stream):
            self._stream.wait_stream(torch.cuda.current_stream(self.device))  # the step's writes first
            ids = torch.tensor(block_ids, dtype=torch.long).to(self.device, non_blocking=True)
            offset = 0
            for layer in self.layers:
                picked = layer.blocks.index_select(0, ids).reshape(count, -1)
                pinned[:, offset:offset + layer.block_bytes].copy_(picked, non_blocking=True)
                offset += layer.block_bytes
        self._stream.synchronize()
        host.copy_(pinned)

    def scatter(self, block_ids: list[int], rows: np.ndarray) -> None:
        """`rows[:len(block_ids)]` (host) into blocks `block_ids` of every layer."""
        count = len(block_ids)
        host = torch.from_numpy(rows[:count])
        if self._stream is None:
            ids = torch.tensor(block_ids, dtype=torch.long)
            offset = 0
            for layer in self.layers:
                part = host[:, offset:offset + layer.block_bytes].reshape(count, *layer.blocks.shape[1:])
                layer.blocks.index_copy_(0, ids, part)
                offset += layer.block_bytes
            return
        pinned = self._pinned_rows(count)
        pinned.copy_(host)
        with torch.cuda.stream(self._stream):
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            ids = torch.tensor(block_ids, dtype=torch.long).to(self.device, non_blocking=True)
            offset = 0
            for layer in self.layers:
                part = pinned[:, offset:offset + layer.block_bytes].to(self.device, non_blocking=True)
                layer.blocks.index_copy_(0, ids, part.reshape(count, *layer.blocks.shape[1:]))
                offset += layer.block_bytes
        # The forward that reads these blocks runs on the compute stream: it waits for the copies.
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        self._stream.synchronize()  # the pinned rows are reused by the next batch

    def _pinned_rows(self, count: int) -> torch.Tensor:
        if self._pinned is None or self._pinned.shape[0] < count:
            self._pinned = torch.empty((count, self.payload_bytes), dtype=torch.uint8, pin_memory=True)
        return self._pinned[:count]


def layout_signature(caches: dict[str, torch.Tensor], layers: list[LayerBlocks]) -> int:
    """32 bits naming what a block's bytes mean: per layer, its dtype and logical block shape (head
    slots, kernel split, tokens, content). Blocks are exchanged only between equal signatures."""
    text = ";".join(f"{layer.name}:{cache.dtype}:{tuple(layer.blocks.shape[1:])}"
                    for layer, cache in zip(layers, caches.values()))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "little")
